"""The translation server, as a client meets it: a real uvicorn server on 127.0.0.1 (in a thread of this process, or
flax-transformer-serve as a process), spoken to over HTTP with httpx, its page in headless Chromium."""

import concurrent.futures
import contextlib
import shutil
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from flax_transformer import server
from flax_transformer.translator import Translator
from tests.conftest import free_port, subprocess_env

SENTENCES = ['the cat sat on the mat', 'red house', 'a dog runs', 'the red cat and the dog sat on a house']


@contextlib.contextmanager
def _serving(app):
  """`app` served by uvicorn on a free port of 127.0.0.1 in a thread: yields its base URL."""
  import uvicorn
  port = free_port()
  listening = uvicorn.Server(uvicorn.Config(app, host='127.0.0.1', port=port, log_level='warning'))
  thread = threading.Thread(target=listening.run, daemon=True)
  thread.start()
  deadline = time.monotonic() + 120
  while not listening.started:
    assert thread.is_alive() and time.monotonic() < deadline, 'the server did not start'
    time.sleep(0.05)
  try:
    yield f'http://127.0.0.1:{port}'
  finally:
    listening.should_exit = True
    thread.join(60)


@pytest.fixture(scope='module')
def translator(trained_run):
  return Translator.from_workdir(trained_run[0], decode_slots=8)


@pytest.fixture(scope='module')
def served(translator):
  app = server.create_app(translator, server.Limits(max_request_bytes=4096, max_request_sentences=16))
  with _serving(app) as url, httpx.Client(base_url=url, timeout=120) as client:
    yield client, app


def _one_line_error(response, status: int, start: str) -> None:
  assert response.status_code == status, response.text
  message = response.json()['error']
  assert message.startswith(start) and '\n' not in message, message


@pytest.mark.slow  # 8 s or more of compilation and steps on 2 cores (the marker)
def test_the_api_answers_what_the_translator_answers(served, translator):
  """Beam search, its 2 best, sampling (3 samples, a seed), prefixes, constraints, scores and alignments over HTTP
  equal the Translator's for the same sentences and settings; one sentence as a string gives one answer."""
  client, _ = served
  assert client.get('/health').json() == {'status': 'live'}
  assert client.get('/ready').json()['status'] == 'ready'
  answer = client.post('/translate', json={'sentences': SENTENCES, 'alignment': True}).json()
  assert answer['translations'] == translator.translate(SENTENCES)
  assert answer['alignments'] == translator.alignments(SENTENCES, answer['translations'])
  assert client.post('/translate', json={'sentences': SENTENCES[1]}).json() == {
      'translations': translator.translate(SENTENCES[1:2])[0]}
  listed = client.post('/translate', json={'sentences': SENTENCES, 'n_best': 2, 'beam_size': 3}).json()
  assert [[(h['text'], h['score']) for h in found] for found in listed['hypotheses']] == [
      [(text, round(score, 4)) for text, score in found] for found in translator.n_best(SENTENCES, 2, beam_size=3)]
  sampled = client.post('/translate', json={'sentences': SENTENCES, 'strategy': 'sampling', 'num_samples': 3,
                                            'sampling_seed': 7, 'top_k': 5}).json()
  expected = Translator(translator.params, translator.model_config, translator.processor,
                        decoding=translator.decoding, strategy='sampling', sampling_seed=7, top_k=5).n_best(SENTENCES, 3)
  assert [[h['text'] for h in found] for found in sampled['hypotheses']] == [[t for t, _ in f] for f in expected]
  steered = {'prefixes': ['RED', '', '', 'DOG'], 'constraints': [[], ['CAT'], ['HOUSE', 'DOG'], []]}
  assert client.post('/translate', json={'sentences': SENTENCES, **steered}).json()['translations'] == (
      translator.translate(SENTENCES, **steered))
  targets = ['CAT MAT', 'HOUSE RED', 'DOG', 'CAT DOG HOUSE']
  scores = client.post('/score', json={'sources': SENTENCES, 'targets': targets}).json()['scores']
  assert scores == pytest.approx(translator.score(SENTENCES, targets), abs=1e-5)
  links = client.post('/align', json={'sources': SENTENCES, 'targets': targets}).json()['alignments']
  assert links == translator.alignments(SENTENCES, targets)
  assert 'paths' in client.get('/openapi.json').json() and client.get('/docs').status_code == 200
  metrics = client.get('/metrics').text
  assert 'translation_requests_total{endpoint="translate",status="200"}' in metrics
  assert 'translation_request_seconds_bucket' in metrics and 'translation_queue_sentences' in metrics


def test_concurrent_requests_share_the_engines_steps(served, monkeypatch):
  """Eight one-sentence requests sent at once take far fewer engine steps than the same eight one after the
  other: their sentences decode in the same steps."""
  client, app = served
  scheduler = app.state.scheduler
  sentences = [f'{SENTENCES[3]} {SENTENCES[i % 3]} {i}' for i in range(8)]  # long enough for many steps each

  def steps_of(send):
    before = scheduler.counts['steps']
    send()
    return scheduler.counts['steps'] - before
  alone = steps_of(lambda: [client.post('/translate', json={'sentences': [s]}).raise_for_status() for s in sentences])
  # "At once": the eight reach the queue together. Sent from eight threads alone, a fast CPU's engine finishes
  # the first arrivals' few steps before the last requests are parsed (seen: 18 steps against 35). The server
  # submits on its event loop's thread, which here holds the queue's (reentrant) lock from the first of the
  # eight to the last, so the engine's thread takes them in one go.
  submit, submitted, holding = scheduler.submit, [], []

  def submit_together(plan):
    if not submitted:
      scheduler.condition.acquire()
      holding.append(True)
    submitted.append(plan)
    try:
      return submit(plan)
    finally:  # released after the eighth, or at once if one fails
      if holding and (len(submitted) == 8 or sys.exc_info()[0] is not None):
        holding.clear()
        scheduler.condition.release()
  monkeypatch.setattr(scheduler, 'submit', submit_together)
  with concurrent.futures.ThreadPoolExecutor(8) as pool:
    together = steps_of(lambda: list(pool.map(
        lambda s: client.post('/translate', json={'sentences': [s]}).raise_for_status(), sentences)))
  print(f'engine steps: {alone} one after the other, {together} at once')
  assert together * 2 <= alone


def test_bad_requests_get_one_line_and_a_status_and_the_server_goes_on(served, translator):
  """Bodies that are not JSON, not UTF-8, of the wrong shape or values, too large or too many: 400 or 413 with one
  line naming the field; then 1,000 malformed requests in a row, after which it still translates correctly."""
  client, _ = served
  post = lambda body, **kw: client.post('/translate', content=body, headers={'Content-Type': 'application/json'}, **kw)
  _one_line_error(post(b'{"sentences": '), 400, 'the body is not valid JSON')
  _one_line_error(post(b'{"sentences": ["caf\xe9"]}'), 400, 'the body is not UTF-8 (byte 19)')
  _one_line_error(post(b'{"sentences": 5}'), 400, 'sentences must be a string or a list of strings, not int')
  _one_line_error(post(b'{"sentences": ["a", null]}'), 400, 'sentences[1] must be a string, not NoneType')
  _one_line_error(post(b'{"sentence": ["a"]}'), 400, 'sentence is not a field of this request')
  _one_line_error(post(b'{"sentences": ["a"], "top_p": 2}'), 400, 'top_p=2.0: must be in (0, 1]')
  _one_line_error(post(b'{"sentences": ["a"], "beam_size": 0}'), 400, 'beam_size: Input should be greater')
  _one_line_error(post(b'{"sentences": ["a"], "timeout": Infinity}'), 400, 'timeout: Input should be a finite number')
  _one_line_error(post(b'{"sentences": ["a"], "temperature": NaN}'), 400, 'temperature: Input should be a finite')
  _one_line_error(post(b'{"sentences": ["a"], "strategy": "sampling", "n_best": 2}'), 400,
                  "n_best=2 lists the beam's best and the strategy is sampling")
  _one_line_error(post(b'{"sentences": ["a"], "constraints": [["\xe2\x98\x83"]]}'), 400,
                  "constraint '\u2603' of sentence 0 has text the vocabulary has no piece for")
  _one_line_error(post(('{"sentences": ["' + 'a ' * 300 + '"]}').encode()), 400,
                  f'sentence 0 has 600 tokens and the model takes at most {translator.max_source_tokens}; split it')
  _one_line_error(post(b'{"sentences": ["' + b'a' * 5000 + b'"]}'), 413, 'the body has 50')
  _one_line_error(post(b'{"sentences": ' + str(['a'] * 17).replace("'", '"').encode() + b'}'), 413,
                  '17 sentences and the server takes at most 16 a request')
  _one_line_error(client.post('/score', json={'sources': ['a'], 'targets': []}), 400, '1 sources but 0 targets')
  malformed = [b'', b'[', b'{"sentences": {}}', b'\xff\xfe', b'{"sentences": ["a"], "timeout": -1}', b'null',
               b'{"sentences": [[1]]}', b'"a"']
  statuses = {post(malformed[i % len(malformed)]).status_code for i in range(1000)}
  assert statuses == {400}
  assert client.post('/translate', json={'sentences': SENTENCES}).json()['translations'] == (
      translator.translate(SENTENCES))


def test_a_full_queue_answers_429_and_a_deadline_frees_the_request(translator):
  """With the engine's thread held back, a request of 2 sentences fills a queue of 3: another of 2 gets 429 with
  Retry-After, one of 4 (more than the queue holds) 413; the first passes its 1 s deadline (504) and leaves the
  queue, so once the engine runs the same request of 2 is translated."""
  app = server.create_app(translator, server.Limits(max_waiting=3), warm_up=False, start_engine=False)
  scheduler = app.state.scheduler
  with _serving(app) as url, httpx.Client(base_url=url, timeout=60) as client:
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
      first = pool.submit(client.post, '/translate', json={'sentences': SENTENCES[:2], 'timeout': 1})
      while scheduler.waiting < 2:
        time.sleep(0.01)
      full = client.post('/translate', json={'sentences': SENTENCES[2:]})
      _one_line_error(full, 429, '2 sentences are waiting and this request brings 2; the queue holds 3')
      assert full.headers['Retry-After'] == '1'
      _one_line_error(client.post('/translate', json={'sentences': SENTENCES}), 413,
                      'the request brings 4 sentences and the queue holds 3')
      _one_line_error(first.result(), 504, 'the translation took longer than its 1 s deadline')
    scheduler.start()
    answer = client.post('/translate', json={'sentences': SENTENCES[2:]})
    assert answer.json()['translations'] == translator.translate(SENTENCES[2:])
    assert scheduler.waiting == 0 and scheduler.counts['sentences'] == 2  # the abandoned request never decoded


def test_a_client_that_goes_away_frees_its_slots(translator, monkeypatch):
  """A request of 16 long sentences on an engine slowed to a step per 0.25 s, whose client hangs up after 0.5 s: the
  server notices, drops what waits and frees the slots its sentences hold at once, long before they would end."""
  from flax_transformer import engine
  advance = engine.Running.advance
  monkeypatch.setattr(engine.Running, 'advance', lambda self, *a: time.sleep(0.25) or advance(self, *a))
  app = server.create_app(translator, server.Limits(), warm_up=False)
  scheduler = app.state.scheduler
  scheduler.step_budget = 1
  sentences = [f'{SENTENCES[3]} {SENTENCES[3]} {i}' for i in range(16)]
  with _serving(app) as url:
    httpx.post(f'{url}/translate', json={'sentences': sentences}, timeout=120).raise_for_status()  # compiled
    done, steps = scheduler.counts['sentences'], scheduler.counts['steps']  # whole, they take `steps` steps
    with httpx.Client(base_url=url, timeout=0.5) as client, pytest.raises(httpx.ReadTimeout):
      client.post('/translate', json={'sentences': sentences})
    left = time.monotonic()
    while scheduler.occupancy()[0] or scheduler.waiting:
      assert time.monotonic() < left + 5, (scheduler.occupancy(), scheduler.waiting)
      time.sleep(0.01)
    print(f"slots freed {time.monotonic() - left:.2f} s after the client left, after "
          f"{scheduler.counts['steps'] - steps} of the {steps} steps the sentences take")
    assert scheduler.counts['sentences'] == done and scheduler.counts['steps'] - steps < steps / 2


@pytest.mark.slow
def test_sigterm_drains_the_requests_in_flight_then_exits_0(trained_run, tmp_path):
  """flax-transformer-serve as a process: a port already taken is refused in one line before the model loads;
  started, it answers; a SIGTERM while a request is in flight lets that request finish with its translations,
  refuses new connections, and the process exits 0."""
  workdir = trained_run[0]
  port = free_port()
  command = [sys.executable, '-m', 'flax_transformer', 'serve', f'--workdir={workdir}', f'--port={port}',
             '--decode_slots=8']
  with __import__('socket').socket() as taken:
    taken.bind(('127.0.0.1', port))
    refused = subprocess.run(command, env=subprocess_env(), capture_output=True, text=True, timeout=120)
  assert refused.returncode == 1 and refused.stderr.startswith(f'error: cannot listen on 127.0.0.1:{port}'), (
      refused.stderr[-2000:])
  process = subprocess.Popen(command, env=subprocess_env(), stderr=subprocess.PIPE, text=True)
  try:
    url = f'http://127.0.0.1:{port}'
    deadline = time.monotonic() + 240
    while True:
      assert process.poll() is None and time.monotonic() < deadline, process.stderr.read()[-2000:]
      with contextlib.suppress(httpx.HTTPError):
        if httpx.get(f'{url}/ready', timeout=5).status_code == 200:
          break
      time.sleep(0.2)
    many = ['the red cat and the dog sat on a house ' * 3 + str(i) for i in range(256)]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
      in_flight = pool.submit(httpx.post, f'{url}/translate', json={'sentences': many}, timeout=120)
      time.sleep(0.3)
      process.send_signal(signal.SIGTERM)
      signalled = time.monotonic()
      answer = in_flight.result()
      print(f'the request in flight was answered {time.monotonic() - signalled:.2f} s after SIGTERM')
    assert answer.status_code == 200 and len(answer.json()['translations']) == 256, answer.text
    assert process.wait(timeout=60) == 0, process.stderr.read()[-2000:]
    with pytest.raises(httpx.ConnectError):
      httpx.get(f'{url}/health', timeout=5)
  finally:
    if process.poll() is None:
      process.kill()


def test_the_page_translates_what_is_typed_in_a_real_browser(served, translator):
  """Headless Chromium (Debian's chromium, driven by Playwright) opens the page, types two sentences, asks for the
  2 best with alignments, and reads the translations the API gives for them; the page fetches nothing from
  another host."""
  chromium = shutil.which('chromium') or shutil.which('chromium-browser')
  if not chromium:
    pytest.skip('Debian\'s chromium is not installed (.ci/run installs it: apt-get install chromium)')
  from playwright.sync_api import sync_playwright
  client, _ = served
  url = str(client.base_url)
  elsewhere = []
  with sync_playwright() as playwright:
    browser = playwright.chromium.launch(executable_path=chromium, args=['--no-sandbox'])
    try:
      page = browser.new_page()
      page.on('request', lambda r: elsewhere.append(r.url) if not r.url.startswith(url) else None)
      page.goto(url + '/')
      page.fill('#source', '\n'.join(SENTENCES[:2]))
      page.fill('#nbest', '2')
      page.check('#alignment')
      page.click('#translate')
      page.wait_for_selector('#output .sentence >> nth=1', timeout=60_000)
      shown = page.locator('#output .translation').all_inner_texts()
      listed = page.locator('#output ol').first.locator('li').all_inner_texts()
      lines = page.locator('#output svg.alignment').count()
    finally:
      browser.close()
  expected = client.post('/translate', json={'sentences': SENTENCES[:2], 'n_best': 2, 'beam_size': 4}).json()
  assert [s.strip() for s in shown] == [t.strip() for t in expected['translations']]
  assert len(listed) == 2 and listed[0].startswith(expected['hypotheses'][0][0]['text'].strip())
  assert lines == 2 and not elsewhere, elsewhere
