"""The translation server's HTTP API and web page: FastAPI (an ASGI framework on Starlette, with pydantic request
models and an OpenAPI description at /docs and /openapi.json) served by uvicorn (commands/serve.py).

    POST /translate  {"sentences": "A dog runs." | [...], "beam_size": 4, "n_best": 2, "strategy": "sampling", ...}
    POST /score      {"sources": [...], "targets": [...]}   -> log p(target | source) each
    POST /align      {"sources": [...], "targets": [...]}   -> Pharaoh word alignments
    GET  /health (live), /ready (model loaded, common shapes compiled), /metrics (Prometheus), / (the page)

Translations go through one serving.Scheduler: every request's sentences join the engine's batches as slots
free up, so concurrent requests share each step. A request is refused with one line naming the problem: 400
(not JSON, not UTF-8, a field of the wrong shape or value), 413 (more bytes or sentences than the server
takes), 429 with Retry-After (the queue is full), 504 (its deadline passed; its slots are freed). A client that
disconnects frees its slots too. No request names a file: the model is fixed when the server starts.
"""

import asyncio
import dataclasses
import importlib.resources
import time
from typing import Annotated

import fastapi
import prometheus_client
import pydantic
from fastapi import responses
from starlette.concurrency import run_in_threadpool

from flax_transformer import decoding_settings, serving
from flax_transformer.decoding_settings import DecodeSettings
from flax_transformer.errors import UserError

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
DISCONNECT_POLL = 0.25  # seconds between checks that a waiting request's client is still connected


@dataclasses.dataclass(frozen=True)
class Limits:
  """What one request may ask and how long it may wait."""
  max_request_bytes: int = 1 << 20
  max_request_sentences: int = 1024
  max_waiting: int = 4096  # sentences waiting for a slot, all requests together (then 429)
  timeout_seconds: float = 120.0  # a request's deadline unless it asks for a shorter one
  split_long: bool = False  # a sentence longer than the model takes: split at punctuation, or refused (400)


Positive = Annotated[int, pydantic.Field(ge=1)]


class _Request(pydantic.BaseModel):
  """A /translate request: the sentences and, each optional (default: the server's), how to decode them (the
  decoding settings declared `given` a request are added from their declarations: `TranslateRequest`)."""
  model_config = pydantic.ConfigDict(extra='forbid', allow_inf_nan=False)
  sentences: str | list[str] = pydantic.Field(description='One sentence, or a list of them.')
  n_best: Positive | None = pydantic.Field(None, description="The beam's K best of each sentence, with scores.")
  prefixes: list[str] | None = pydantic.Field(None, description='Per sentence, text its translation begins with.')
  constraints: list[list[str]] | None = pydantic.Field(None, description='Per sentence, phrases it must hold.')
  alignment: bool = pydantic.Field(False, description="Each best translation's word alignment (Pharaoh i-j).")
  timeout: float | None = pydantic.Field(None, gt=0, description='Seconds before the request is abandoned (504).')


def _request_field(field: dataclasses.Field):
  """A decoding setting as an optional request field: its type, its bounds, its description (its values and
  every other rule are checked by DecodeSettings.replace, as for a flag or a config)."""
  meta = field.metadata
  bounds = {'ge': meta['minimum'] if meta['minimum'] is not None else meta['low'], 'gt': meta['greater']}
  description = meta['doc'] + (f' One of {", ".join(meta["choices"])}.' if meta['choices'] else '')
  return field.type | None, pydantic.Field(None, description=description,
                                           **{k: v for k, v in bounds.items() if v is not None})


TranslateRequest = pydantic.create_model(
    'TranslateRequest', __base__=_Request, __doc__=_Request.__doc__,
    **{f.name: _request_field(f) for f in dataclasses.fields(DecodeSettings) if 'request' in f.metadata['given']})
DECODING = tuple(name for name in decoding_settings.given('request') if name != 'beam_size')  # to DecodeSettings;
# the beam size goes to the plan with n_best


class PairsRequest(pydantic.BaseModel):
  """A /score or /align request: source and target sentences, pair by pair."""
  model_config = pydantic.ConfigDict(extra='forbid')
  sources: list[str]
  targets: list[str]


class Refused(Exception):
  """A request answered with `status` and one line."""

  def __init__(self, status: int, message: str, headers: dict | None = None):
    super().__init__(message)
    self.status, self.headers = status, headers


def _one_line(error: pydantic.ValidationError) -> str:
  """pydantic's first error as one line naming the field."""
  first = max(error.errors(), key=lambda e: len(e['loc']))  # the deepest: inside a list, the item that is wrong
  location = [str(part) for part in first['loc']]
  if len(location) > 1 and not location[1].isdigit() and location[0] in TranslateRequest.model_fields:  # a union
    if len(location) > 2:  # an item of the list branch
      return f'{location[0]}[{location[2]}] must be a string, not {type(first.get("input")).__name__}'
    kinds = TranslateRequest.model_fields[location[0]].annotation
    return f'{location[0]} must be {_kind(kinds)}, not {type(first.get("input")).__name__}'
  where = '.'.join(location) or 'the body'
  if first['type'] == 'json_invalid':
    return f'the body is not valid JSON ({first["msg"]}); send a JSON object such as {{"sentences": ["A dog runs."]}}'
  if first['type'] == 'extra_forbidden':
    return f'{where} is not a field of this request; see /docs for the fields'
  if first['type'] == 'missing':
    return f'{where} is missing; see /docs for the fields'
  return f'{where}: {first["msg"]}'


def _kind(annotation) -> str:
  """'a string or a list of strings' for str | list[str], and so on."""
  names = {str: 'a string', list[str]: 'a list of strings', type(None): 'null'}
  return ' or '.join(names.get(kind, str(kind)) for kind in getattr(annotation, '__args__', (annotation,)))


class Metrics:
  """The server's Prometheus metrics (its own registry, so that several servers can live in one process)."""

  def __init__(self, scheduler: serving.Scheduler):
    self.registry = registry = prometheus_client.CollectorRegistry()
    self.requests = prometheus_client.Counter('translation_requests', 'Requests answered, by endpoint and status.',
                                              ('endpoint', 'status'), registry=registry)
    self.latency = prometheus_client.Histogram('translation_request_seconds', 'Seconds from arrival to answer.',
                                               ('endpoint',), buckets=LATENCY_BUCKETS, registry=registry)
    self.sentences = prometheus_client.Counter('translation_sentences', 'Sentences translated.', registry=registry)
    for name, what, read in (
        ('translation_queue_sentences', 'Sentences waiting for a decoding slot.', lambda: scheduler.waiting),
        ('translation_busy_slots', 'Decoding slots holding a sentence.', lambda: scheduler.occupancy()[0]),
        ('translation_slots', 'Decoding slots of the running batches.', lambda: scheduler.occupancy()[1]),
        ('translation_output_tokens', 'Tokens produced (counter: rate() gives tokens per second).',
         lambda: scheduler.counts['tokens']),
        ('translation_engine_steps', 'Engine steps run (counter).', lambda: scheduler.counts['steps'])):
      prometheus_client.Gauge(name, what, registry=registry).set_function(read)


def create_app(translator, limits: Limits = Limits(), warm_up: bool = True, start_engine: bool = True
               ) -> fastapi.FastAPI:
  """The server's app around `translator` (translator.Translator): see the module docstring. `warm_up`: compile the
  common shapes before /ready says ready; `start_engine`: start the engine's thread with the server (else
  app.state.scheduler.start() does, later: requests wait in its queue meanwhile)."""
  scheduler = serving.Scheduler(translator, max_waiting=limits.max_waiting)
  metrics = Metrics(scheduler)
  state = {'ready': False}

  async def lifespan(app):
    if start_engine:
      scheduler.start()
    if warm_up:
      await run_in_threadpool(_warm_up, translator, scheduler)
    state['ready'] = True
    yield
    await run_in_threadpool(scheduler.stop)

  app = fastapi.FastAPI(title='flax-transformer translation server', lifespan=lifespan, redoc_url=None,
                        description=__doc__.split('\n\n')[2])
  app.state.scheduler, app.state.metrics, app.state.translator = scheduler, metrics, translator

  @app.exception_handler(Refused)
  async def refused(request, error: Refused):
    return responses.JSONResponse({'error': str(error)}, status_code=error.status, headers=error.headers)

  async def body_of(request: fastapi.Request, model):
    declared = request.headers.get('content-length')
    if declared and declared.isdigit() and int(declared) > limits.max_request_bytes:
      raise Refused(413, f'the body has {declared} bytes and the server takes at most {limits.max_request_bytes}; '
                         f'send fewer sentences a request')
    body = await request.body()
    if len(body) > limits.max_request_bytes:
      raise Refused(413, f'the body has {len(body)} bytes and the server takes at most {limits.max_request_bytes}; '
                         f'send fewer sentences a request')
    try:
      body.decode('utf-8')
    except UnicodeDecodeError as error:
      raise Refused(400, f'the body is not UTF-8 (byte {error.start}); send JSON encoded as UTF-8') from None
    try:
      return model.model_validate_json(body)
    except pydantic.ValidationError as error:
      raise Refused(400, _one_line(error)) from None

  def counted(endpoint: str):
    def decorate(handler):
      async def handle(request: fastapi.Request):
        start = time.monotonic()
        status = 500
        try:
          response = await handler(request)
          status = 200
          return response
        except Refused as error:
          status = error.status
          raise
        finally:
          metrics.requests.labels(endpoint, str(status)).inc()
          metrics.latency.labels(endpoint).observe(time.monotonic() - start)
      handle.__name__ = handler.__name__
      return handle
    return decorate

  def checked(sentences: list, what: str = 'sentences') -> None:
    if len(sentences) > limits.max_request_sentences:
      raise Refused(413, f'{len(sentences)} {what} and the server takes at most {limits.max_request_sentences} a '
                         f'request; send them in several requests')

  schema = lambda model: {'requestBody': {'required': True, 'content': {'application/json': {
      'schema': model.model_json_schema(ref_template='#/components/schemas/{model}')}}}}

  @app.post('/translate', openapi_extra=schema(TranslateRequest), summary='Translate sentences')
  @counted('translate')
  async def translate(request: fastapi.Request):
    asked = await body_of(request, TranslateRequest)
    single = isinstance(asked.sentences, str)
    sentences = [asked.sentences] if single else asked.sentences
    checked(sentences)
    try:
      planned, listed = _plan(translator, asked, sentences, limits)
    except UserError as error:
      raise Refused(400, str(error)) from None
    try:
      queued = scheduler.submit(planned)
    except serving.QueueFull as error:
      raise Refused(429, f'{error}; retry after a second', {'Retry-After': '1'}) from None
    except serving.TooLarge as error:
      raise Refused(413, str(error)) from None
    deadline = min(asked.timeout or limits.timeout_seconds, limits.timeout_seconds)
    hypotheses = await _awaited(request, scheduler, queued, deadline)
    metrics.sentences.inc(len(sentences))
    answer = {'translations': translator.joined(planned, hypotheses)}
    if listed:
      answer['hypotheses'] = [[{'text': text, 'score': round(score, 4)} for text, score in found]
                              for found in hypotheses]
    if asked.alignment:
      answer['alignments'] = await run_in_threadpool(translator.alignments, sentences, answer['translations'])
    if single:
      answer = {name: values[0] for name, values in answer.items()}
    return answer

  async def pairs(request: fastapi.Request, work):
    asked = await body_of(request, PairsRequest)
    if len(asked.sources) != len(asked.targets):
      raise Refused(400, f'{len(asked.sources)} sources but {len(asked.targets)} targets; give one target a source')
    checked(asked.sources, 'pairs')
    try:
      return await run_in_threadpool(work, asked.sources, asked.targets)
    except UserError as error:
      raise Refused(400, str(error)) from None

  @app.post('/score', openapi_extra=schema(PairsRequest), summary='log p(target | source) of each pair')
  @counted('score')
  async def score(request: fastapi.Request):
    return {'scores': await pairs(request, translator.score)}

  @app.post('/align', openapi_extra=schema(PairsRequest), summary='Word alignments (Pharaoh i-j) of each pair')
  @counted('align')
  async def align(request: fastapi.Request):
    return {'alignments': await pairs(request, translator.alignments)}

  @app.get('/health', summary='Live')
  async def health():
    return {'status': 'live'}

  @app.get('/ready', summary='Ready: the model loaded and its common shapes compiled')
  async def ready():
    if not state['ready']:
      raise Refused(503, 'the model is still compiling; retry shortly', {'Retry-After': '1'})
    return {'status': 'ready', 'checkpoints': [str(c) for c in translator.checkpoints]}

  @app.get('/metrics', summary='Prometheus metrics')
  async def metrics_page():
    return responses.Response(prometheus_client.generate_latest(metrics.registry),
                              media_type=prometheus_client.CONTENT_TYPE_LATEST)

  @app.get('/', include_in_schema=False)
  async def page():
    return responses.HTMLResponse(PAGE)

  @app.get('/settings', summary="The server's decoding defaults and limits")
  async def settings():
    return {'decoding': dataclasses.asdict(translator.decoding), 'limits': dataclasses.asdict(limits)}

  return app


def _plan(translator, asked: TranslateRequest, sentences: list[str], limits: Limits):
  """The Translator.plan of a /translate request, and whether it lists several hypotheses a sentence."""
  changes = {name: getattr(asked, name) for name in DECODING}
  decoding = translator.decoding.replace(**changes)
  if asked.n_best and decoding.strategy == 'sampling':
    raise UserError(f'n_best={asked.n_best} lists the beam\'s best and the strategy is sampling; give '
                    f'num_samples={asked.n_best} for that many samples a sentence')
  samples = decoding.num_samples if decoding.strategy == 'sampling' else 1
  listed = asked.n_best or (samples if samples > 1 else None)
  beam = asked.beam_size or decoding.beam_size
  if asked.n_best and decoding.strategy == 'beam':
    beam = max(beam, asked.n_best)
  encoded = translator.encode(sentences)
  too_long = translator.too_long(encoded)
  if too_long and (listed or not limits.split_long):
    i = too_long[0]
    fix = ('ask without n_best or num_samples' if limits.split_long else
           'split it, or start the server with --split_long')
    raise UserError(f'sentence {i} has {len(encoded[i])} tokens and the model takes at most '
                    f'{translator.max_source_tokens}; {fix}')
  return translator.plan(sentences, decoding=decoding, beam_size=beam, num_results=listed,
                         split_long=limits.split_long, encoded=encoded, prefixes=asked.prefixes,
                         constraints=asked.constraints), listed


async def _awaited(request: fastapi.Request, scheduler: serving.Scheduler, queued: serving.Request,
                   deadline: float):
  """The request's hypotheses once the engine is done with them; cancelled (its slots freed) when the client
  disconnects (then 499, which no client reads) or the deadline passes (504)."""
  future = asyncio.wrap_future(queued.future)
  end = time.monotonic() + deadline
  while True:  # woken by the answer at once; every DISCONNECT_POLL seconds to see whether the client is still there
    done, _ = await asyncio.wait({future}, timeout=min(DISCONNECT_POLL, max(0.0, end - time.monotonic())))
    if done:
      try:
        return future.result()
      except asyncio.CancelledError:
        raise Refused(499, 'the request was cancelled') from None
      except Exception as error:  # the engine's thread stopped: every request learns why
        raise Refused(500, f'the decoding engine stopped: {type(error).__name__}: {error}') from None
    if await request.is_disconnected():
      scheduler.cancel(queued)
      raise Refused(499, 'the client disconnected')
    if time.monotonic() >= end:
      scheduler.cancel(queued)
      raise Refused(504, f'the translation took longer than its {deadline:g} s deadline; ask for fewer sentences or '
                         f'a longer timeout')


def _warm_up(translator, scheduler: serving.Scheduler) -> None:
  """Compiles the default strategy's programs for the two shortest source lengths (most sentences), for every
  number of sentences arriving together at the shortest (powers of two) and for one and many at the next, by
  translating through the scheduler."""
  slots, counts = translator.decoding.decode_slots, [1]
  while counts[-1] < slots:
    counts.append(min(max(8, counts[-1] * 2), slots))
  for length, sizes in ((serving.SMALLEST_SOURCE, counts), (2 * serving.SMALLEST_SOURCE, (1, slots))):
    sentence = ' '.join(['a'] * (length // 2 + 2))
    for count in sizes:
      pieces = translator.encode([sentence])[0][:length - 1]
      planned = translator.plan([sentence] * count, encoded=[pieces] * count)
      scheduler.submit(planned).future.result()


PAGE = importlib.resources.files('flax_transformer').joinpath('page.html').read_text(encoding='utf-8')
