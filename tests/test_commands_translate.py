"""The translate program (commands/translate.py, translate.py) end to end on a trained tiny run: order, empty
lines, BLEU, averaging, one-line errors."""

import gzip
import json
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest

from flax_transformer import checkpointing, workdirs
from flax_transformer.commands import average as average_command, translate as translate_command
from tests.conftest import ROOT, free_port, subprocess_env
from tests.helpers import programs


@pytest.fixture
def trained(trained_run):
  """The suite's shared 12-step tiny run (checkpoints 3, 6, 9, 12) and the config it saved."""
  workdir, _ = trained_run
  return workdir, workdirs.read_config(workdir)


def _translate(workdir, *flags, stdin=b'', cwd=None):
  """translate.py with these flags, run in this process (tests/helpers/programs.py)."""
  return programs.run(translate_command.main, ['translate.py', f'--workdir={workdir}', *flags], stdin=stdin, cwd=cwd)


@pytest.mark.slow
def test_translates_in_order_with_empty_lines_and_bleu(trained, tmp_path):
  workdir, config = trained
  lines = ['the cat sat on the mat', '', 'a dog runs ' * 40, 'red house']
  source = tmp_path / 'in.txt.gz'
  with gzip.open(source, 'wt', encoding='utf-8') as f:
    f.write('\n'.join(lines) + '\n')
  reference = tmp_path / 'ref.txt'
  reference.write_text('THE CAT\n\nRUNS\nHOUSE RED\n')
  output = tmp_path / 'out.txt'
  result = _translate(workdir, f'--input={source}', f'--output={output}', f'--reference={reference}')
  assert result.returncode == 0, result.stderr.decode()[-2000:]
  translations = output.read_text().split('\n')[:-1]
  assert len(translations) == len(lines)
  assert translations[1] == ''  # an empty line translates to an empty line


@pytest.mark.parametrize('flags,stdin,message', [
    (['--input=-', '--average_last=7'], b'hello\n', 'cannot average the last 7 checkpoints'),
    (['--input=-'], b'ok\n\xff\n', 'standard input: line 2 is not valid UTF-8'),
    (['--input=-', '--step=999'], b'x\n', 'no checkpoint at step 999'),
    (['--input=-', '--beam_size=0'], b'x\n', '--beam_size=0: must be a positive integer'),
    (['--input=/no/such/file.txt'], b'', '--input file /no/such/file.txt does not exist; check the --input path'),
    (['--input=-', '--score'], b'x\n', '--score needs --reference=FILE'),
])
@pytest.mark.slow
def test_bad_input_is_a_one_line_error(trained, flags, stdin, message):
  workdir, _ = trained
  result = _translate(workdir, *flags, stdin=stdin)
  errors = [l for l in result.stderr.decode().splitlines() if l.startswith('error: ')]
  assert result.returncode == 1 and len(errors) == 1 and message in errors[0], result.stderr.decode()[-1500:]


@pytest.mark.slow
def test_workdir_without_checkpoints_or_with_another_vocabulary(trained, tmp_path):
  workdir, _ = trained
  empty = tmp_path / 'empty'
  empty.mkdir()
  result = _translate(str(empty), '--input=-', stdin=b'x\n')
  assert result.returncode == 1 and b'has no config.json' in result.stderr
  # A vocabulary file that disagrees with the model's vocabulary size.
  import shutil
  copy = tmp_path / 'copy'
  shutil.copytree(workdir, copy)
  config_text = (copy / 'config.json').read_text().replace('"vocab_size": 64', '"vocab_size": 65')
  (copy / 'config.json').write_text(config_text)
  result = _translate(str(copy), '--input=-', stdin=b'x\n')
  assert result.returncode == 1 and b'has 64 pieces but config.model.vocab_size=65' in result.stderr


@pytest.mark.slow
def test_average_writes_a_workdir_that_translate_reads(trained, tmp_path):
  """train -> average -> translate -> BLEU, with workdirs given as relative paths as a user types them; a
  second average into the same directory is refused, then replaced with --overwrite."""
  workdir, config = trained
  output = str(tmp_path / 'averaged')
  relative = lambda path: os.path.relpath(path, tmp_path)  # the commands run in tmp_path
  average = lambda *flags: programs.run(
      average_command.main, ['average', f'--workdir={relative(workdir)}', f'--output={relative(output)}', *flags],
      cwd=tmp_path, text=True)
  result = average()
  assert result.returncode == 0, result.stderr[-2000:]
  steps = checkpointing.available_steps(workdir)
  assert result.stdout.strip().splitlines()[-1].startswith(f'averaged steps {steps[-config.average_last:]}')
  assert 'INFO' not in result.stderr  # Orbax's logging stays quiet
  assert checkpointing.available_steps(output) == [steps[-1]]
  source, reference = tmp_path / 'in.txt', tmp_path / 'ref.txt'
  source.write_text('the cat sat on the mat\nred house\n')
  reference.write_text('THE CAT SAT ON THE MAT\nHOUSE RED\n')
  translated = _translate(relative(output), f'--input={source}', f'--reference={reference}', cwd=tmp_path)
  assert translated.returncode == 0, translated.stderr.decode()[-2000:]
  assert b'BLEU' in translated.stdout + translated.stderr
  assert len(translated.stdout.decode().splitlines()) >= 2
  # The averaged parameters equal the mean of the checkpoints' (checked in tests/test_average.py); the same
  # through translate.py: averaging in translate.py gives the same translations.
  direct = _translate(workdir, f'--input={source}')
  assert translated.stdout.decode().splitlines()[:2] == direct.stdout.decode().splitlines()[:2]
  again = average()
  assert again.returncode == 1 and again.stderr.strip().splitlines()[-1] == (
      f'error: {output} is not empty; choose a new --output or pass --overwrite to replace it')
  assert average('--overwrite', '--last=1').returncode == 0
  assert checkpointing.available_steps(output) == [steps[-1]]


@pytest.mark.slow
def test_long_lines_are_counted_and_can_be_split(trained, tmp_path):
  """A line past the model's 127 source tokens is named in a warning; --split_long translates it in pieces
  cut after sentence punctuation (each within the limit) and joins their translations on its line."""
  workdir, config = trained
  long_line = ' '.join(['the cat sat on the mat.'] * 30)  # ~6 tokens a sentence, far beyond 127
  source = tmp_path / 'in.txt'
  source.write_text(f'red house\n{long_line}\n')
  cut = _translate(workdir, f'--input={source}')
  assert cut.returncode == 0, cut.stderr.decode()[-2000:]
  warning = [line for line in cut.stderr.decode().splitlines() if line.startswith('warning: ')]
  assert warning == ["warning: 1 input line(s) longer than the model's 127 tokens (line 2) are cut to fit "
                     "(--split_long translates them in pieces split at sentence punctuation)"]
  split = _translate(workdir, f'--input={source}', '--split_long')
  assert split.returncode == 0 and 'split at sentence punctuation and translated in pieces' in split.stderr.decode()
  cut_lines, split_lines = cut.stdout.decode().splitlines(), split.stdout.decode().splitlines()
  assert len(split_lines) == 2 and split_lines[0] == cut_lines[0]
  decoded = lambda result: result.stderr.decode().splitlines()[-1].split()[0]  # the last progress line's count
  assert decoded(cut) == '2/2'
  pieces = int(decoded(split).split('/')[1])
  assert pieces >= 3  # the long line went in pieces (this 6-step model's translations are mostly empty)


@pytest.mark.slow
def test_a_reference_of_another_length_is_refused_before_decoding(trained, tmp_path):
  workdir, _ = trained
  source, reference, output = tmp_path / 'in.txt', tmp_path / 'ref.txt', tmp_path / 'out.txt'
  source.write_text('red house\nthe cat\n')
  reference.write_text('HOUSE RED\n')
  result = _translate(workdir, f'--input={source}', f'--reference={reference}', f'--output={output}')
  assert result.returncode == 1
  assert result.stderr.decode().strip().splitlines()[-1] == (
      f'error: {reference} has 1 lines but the input has 2; give the reference of this input')
  assert 'translating' not in result.stderr.decode() and not output.exists()


@pytest.mark.slow
def test_stdin_is_translated_line_by_line_as_it_arrives(trained, tmp_path):
  """One line written, its translation read back, then the next: the model is loaded once, each output
  line flushed when its line is done (an empty line gives an empty line); TensorFlow is never imported (its
  seconds of start-up)."""
  workdir, _ = trained
  process = subprocess.Popen([sys.executable, '-X', 'importtime', os.path.join(ROOT, 'translate.py'), f'--workdir={workdir}', '--input=-',
                              '--beam_size=1'], env=subprocess_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=(tmp_path / 'stderr').open('wb'))  # a file: the import times fill a pipe
  try:
    replies = []
    for line in (b'the cat sat on the mat\n', b'\n', b'red house\n'):
      process.stdin.write(line)
      process.stdin.flush()
      replies.append(process.stdout.readline())  # blocks until this line's translation is written
    process.stdin.close()
    assert process.wait(timeout=120) == 0, (tmp_path / 'stderr').read_text()[-1500:]
  finally:
    process.kill()
  assert [r.endswith(b'\n') for r in replies] == [True] * 3 and replies[1] == b'\n'
  stderr = (tmp_path / 'stderr').read_text()
  assert stderr.count('translating standard input line by line') == 1
  imported = [line.rsplit('|', 1)[-1].strip() for line in stderr.splitlines() if line.startswith('import time:')]
  assert 'jax' in imported and not [name for name in imported if name.startswith('tensorflow')]


def _two_processes(workdir, flags):
  """translate.py as processes 0 and 1 of one job on localhost, 2 CPU devices each, a 10 s heartbeat."""
  port = free_port()
  command = [sys.executable, os.path.join(ROOT, 'translate.py'), f'--workdir={workdir}', *flags, '--devices=2',
             '--num_processes=2', f'--coordinator_address=localhost:{port}', '--heartbeat_timeout_seconds=10']
  return [subprocess.Popen(command + [f'--process_id={i}'], env=subprocess_env(2), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True) for i in (0, 1)]


@pytest.mark.slow
def test_a_long_job_on_two_processes_killed_mid_way_goes_on_from_its_committed_parts(trained, tmp_path):
  """translate.py drawing 2 samples a line on 2 processes × 2 devices, process 1 killed with SIGKILL once two
  parts are committed: process 0 stops by itself within seconds, naming it. Another command on the same output is refused while
  the parts are there; the same command started again goes on after them, and the output is byte for byte
  what one process on one device writes; the parts are gone once the output is whole."""
  workdir, _ = trained
  source = tmp_path / 'in.txt'
  words = ('the', 'a', 'red', 'one', 'big', 'small', 'old', 'new', 'my', 'your')
  source.write_text(''.join(f'{first} {second} cat sat on the mat\n' for first in words for second in words[:4]))
  flags = (f'--input={source}', '--strategy=sampling', '--num_samples=2', '--seed=3', '--part_lines=4')
  assert _translate(workdir, *flags, f'--output={tmp_path / "whole.txt"}').returncode == 0
  output = tmp_path / 'out.txt'
  processes = _two_processes(workdir, [*flags, f'--output={output}'])
  try:
    second = tmp_path / 'out.txt.parts' / 'part-000001.jsonl'
    while not second.exists():  # 10 parts: the run is seconds from its end when the second is committed
      assert processes[0].poll() is None, processes[0].stdout.read()[-1500:]
      time.sleep(0.01)
    processes[1].kill()
    killed_at = time.monotonic()
    log = processes[0].communicate(timeout=60)[0]
  finally:
    for process in processes:
      process.kill()
      process.wait()
  print(f'process 0 exited {time.monotonic() - killed_at:.1f} s after process 1 was killed')
  assert processes[0].returncode == 1
  assert log.strip().splitlines()[-1].startswith('error: process 1 of 2 stopped responding 2.5 s ago'), log[-1500:]
  assert not output.exists()
  other = _translate(workdir, *flags[:-1], '--part_lines=3', f'--output={output}')
  assert other.returncode == 1 and b'holds the parts of another translation' in other.stderr
  processes = _two_processes(workdir, [*flags, f'--output={output}'])
  logs = [process.communicate(timeout=300)[0] for process in processes]
  assert [process.returncode for process in processes] == [0, 0], logs[0][-1500:] + logs[1][-1500:]
  committed = int(re.search(r'going on after (\d+) of 10 parts committed', logs[0]).group(1))
  assert 2 <= committed < 10
  assert output.read_bytes() == (tmp_path / 'whole.txt').read_bytes()  # the same samples of every line
  assert not (tmp_path / 'out.txt.parts').exists()
  lines = [json.loads(line) for line in output.read_text().splitlines()]
  assert [line['n'] for line in lines] == list(range(40)) and all(len(line['hypotheses']) == 2 for line in lines)


@pytest.mark.slow
def test_n_best_score_and_alignment_outputs(trained, tmp_path):
  import json
  workdir, _ = trained
  source, reference = tmp_path / 'in.txt', tmp_path / 'ref.txt'
  source.write_text('the cat sat\nred house\na dog\n')
  reference.write_text('SAT CAT THE\nHOUSE RED\nDOG A\n')
  result = _translate(workdir, f'--input={source}', '--n_best=3', '--alignment')
  assert result.returncode == 0, result.stderr.decode()[-1500:]
  lines = [json.loads(line) for line in result.stdout.decode().splitlines()]
  assert [line['n'] for line in lines] == [0, 1, 2]
  for line in lines:
    assert len(line['hypotheses']) == 3 and {'text', 'score', 'alignment'} <= set(line['hypotheses'][0])
    assert [h['score'] for h in line['hypotheses']] == sorted((h['score'] for h in line['hypotheses']), reverse=True)
  scored = _translate(workdir, f'--input={source}', f'--reference={reference}', '--score', '--alignment')
  assert scored.returncode == 0, scored.stderr.decode()[-1500:]
  rows = [line.split(' ||| ') for line in scored.stdout.decode().splitlines()]
  assert len(rows) == 3 and all(float(score) < 0 for score, _ in rows)
  assert all(pair.split('-')[1].isdigit() for _, links in rows for pair in links.split())
  from flax_transformer.translator import Translator
  translator = Translator.from_workdir(workdir)
  expected = translator.score(source.read_text().splitlines(), reference.read_text().splitlines())
  np.testing.assert_allclose([float(score) for score, _ in rows], expected, atol=1e-4)  # printed with 4 decimals
  # --prefix_file: each translation begins with its line's prefix (an empty line: none); scored as forced.
  prefixes = tmp_path / 'prefixes.txt'
  prefixes.write_text('HOUSE\n\nDOG DOG\n')
  plain = _translate(workdir, f'--input={source}', '--beam_size=2').stdout.decode().splitlines()
  prefixed = _translate(workdir, f'--input={source}', '--beam_size=2', f'--prefix_file={prefixes}')
  assert prefixed.returncode == 0, prefixed.stderr.decode()[-1500:]
  found = prefixed.stdout.decode().splitlines()
  assert found[0].startswith('HOUSE') and found[2].startswith('DOG DOG') and found[1] == plain[1]
  listed = _translate(workdir, f'--input={source}', '--n_best=2', f'--prefix_file={prefixes}')
  hypotheses = [json.loads(line)['hypotheses'] for line in listed.stdout.decode().splitlines()]
  texts = [h['text'] for h in hypotheses[2]]
  assert all(text.startswith('DOG DOG') for text in texts)
  forced = translator.score(['a dog'] * 2, texts)  # log p, and the beam's α-penalised score
  lengths = [len(ids) + 1 for ids in translator.encode(texts)]
  np.testing.assert_allclose([h['score'] for h in hypotheses[2]],
                             [s / ((5 + n) / 6) ** 0.6 for s, n in zip(forced, lengths)], atol=1e-3)
  # --constraints_file: each translation holds its line's phrases ([]: none, as without the file).
  constraints = tmp_path / 'constraints.jsonl'
  constraints.write_text('["RED", "DOG A"]\n[]\n["HOUSE"]\n')
  for order in ('unordered', 'ordered'):
    constrained = _translate(workdir, f'--input={source}', '--beam_size=2', f'--constraints_file={constraints}',
                             f'--constraint_order={order}')
    assert constrained.returncode == 0, constrained.stderr.decode()[-1500:]
    found = constrained.stdout.decode().splitlines()
    assert found[1] == plain[1] and 'HOUSE' in found[2].split(), found
    assert 'RED' in found[0].split() and 'DOG A' in found[0], found
    if order == 'ordered':
      assert found[0].index('RED') < found[0].index('DOG A'), found


@pytest.mark.slow
def test_average_refuses_an_output_that_would_destroy_the_run(trained, tmp_path):
  import shutil
  workdir, _ = trained
  copy = tmp_path / 'run'
  shutil.copytree(workdir, copy)
  (tmp_path / 'file.txt').write_text('x')
  before = sorted(p.name for p in (copy / 'checkpoints').iterdir())
  for output, message in ((copy, 'is the workdir'), (tmp_path, 'holds the workdir'),
                          (copy / 'averaged', 'is inside the workdir'), (tmp_path / 'file.txt', 'is a file')):
    result = programs.run(average_command.main, ['average', f'--workdir={copy}', f'--output={output}', '--overwrite'],
                          text=True)
    errors = [l for l in result.stderr.splitlines() if l.startswith('error: ')]
    assert result.returncode == 1 and len(errors) == 1 and message in errors[0], result.stderr[-1500:]
  assert sorted(p.name for p in (copy / 'checkpoints').iterdir()) == before
  assert checkpointing.available_steps(str(copy)) == checkpointing.available_steps(workdir)


@pytest.mark.slow
def test_installed_commands_are_the_scripts(tmp_path):
  """pyproject's console scripts name the functions the root scripts and `python -m` run, and behave alike."""
  import shutil
  from importlib.metadata import entry_points
  commands = {e.name: e.value for e in entry_points(group='console_scripts') if e.name.startswith('flax-transformer-')}
  assert commands == {f'flax-transformer-{name}': f'flax_transformer.commands.{module}:console' for name, module in (
      ('train', 'train'), ('translate', 'translate'), ('serve', 'serve'), ('average', 'average'), ('export', 'export'),
      ('plan', 'plan'), ('inspect', 'inspect_batches'), ('prepare', 'prepare'))}
  for script, module in (('train.py', 'flax_transformer.commands.train'), ('translate.py', 'flax_transformer.commands.translate')):
    assert f'from {module} import console' in open(os.path.join(ROOT, script)).read()
  installed = shutil.which('flax-transformer-translate')
  if installed is None:
    pytest.skip('the package is not installed (pip install -e .)')
  run = lambda command: subprocess.run(command + [f'--workdir={tmp_path}', '--input=-', '--beam_size=0'],
                                       env=subprocess_env(), capture_output=True, text=True, timeout=120, cwd=tmp_path)
  script, command = run([sys.executable, os.path.join(ROOT, 'translate.py')]), run([installed])
  assert script.returncode == command.returncode == 1
  assert script.stderr.splitlines()[-1] == command.stderr.splitlines()[-1] == \
      'error: --beam_size=0: must be a positive integer (§6.1 beam size (4); a beam of 1 decodes as greedy search does)'


def test_an_ensemble_of_a_run_with_itself_and_its_moving_average_translate(trained, tmp_path):
  """--workdir=W,W decodes as W alone (two copies of one model); --weights=ema translates with the moving
  average, which the shared run keeps."""
  workdir, _ = trained
  source = tmp_path / 'in.txt'
  source.write_text('the cat sat on the mat\nred house\na dog runs fast\n')
  outputs = {}
  for name, flags in (('one', [f'--workdir={workdir}']), ('two', [f'--workdir={workdir},{workdir}']),
                      ('ema', [f'--workdir={workdir}', '--weights=ema'])):
    result = programs.run(translate_command.main, ['translate.py', *flags, f'--input={source}'])
    assert result.returncode == 0, result.stderr.decode()[-2000:]
    outputs[name] = result.stdout.decode().splitlines()
  assert outputs['two'] == outputs['one'] and len(outputs['ema']) == 3


def test_beam_stop_is_the_configs_unless_the_flag_says(trained, monkeypatch):
  workdir, config = trained
  loaded = []
  monkeypatch.setattr(translate_command, 'translate',
                      lambda f, argv=(): loaded.append(translate_command.load(f).beam_stop))
  for flags in ([], ['--beam_stop=beam_ended']):
    assert translate_command.main(['translate.py', f'--workdir={workdir}', *flags]) == 0
  assert loaded == [config.beam_stop, 'beam_ended'] and config.beam_stop == 'bound'
  assert _translate(workdir, '--beam_stop=sometimes').returncode != 0
