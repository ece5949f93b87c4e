"""Two processes × 4 CPU devices through train.py, as on a two-host pod: 3 length buckets, strided
gradient accumulation, evaluation with BLEU, kill -9 and resume on a gs:// workdir (a local GCS emulator),
averaging and translation from gs://; one-process evaluation agrees; the global batch stream continued by one
process and then by two again."""

import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import pytest

from tools import compare_runs
from flax_transformer import settings, train_state, workdirs
from flax_transformer import checkpointing, parallel_text, partitioning, scoring, steps, storage, token_table, tokenizer
from flax_transformer.commands import average as average_command, translate as translate_command
from flax_transformer.translator import Translator
from tests.helpers import programs
from tests.helpers.corpus import write_corpus
from tests.test_partitioning import _free_port
from tests.conftest import ROOT, subprocess_env

STEPS = 12
# Each test starts train.py processes that compile every batch shape; the module's tests share one reference run.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group('two_hosts')]


def _commands(workdir, corpus, extra=()):
  """Processes 0 and 1 of one run on localhost, 4 CPU devices each, mesh (data 2, fsdp 2, model 2)."""
  port = _free_port()
  base = [sys.executable, os.path.join(ROOT, 'train.py'), '--config', os.path.join(ROOT, 'configs/tiny.py'),
          f'--workdir={workdir}', '--config.dataset=files',
          f'--config.train_source={corpus}/train.src.gz', f'--config.train_target={corpus}/train.tgt.gz',
          f'--config.eval_source={corpus}/eval.src.gz', f'--config.eval_target={corpus}/eval.tgt.gz',
          '--config.bucket_shapes=longer_side', '--config.num_bucket_boundaries=3', '--config.max_train_length=32',
          '--config.max_eval_length=32', '--config.tokens_per_batch=512', '--config.gradient_accumulation_steps=2',
          f'--config.num_train_steps={STEPS}', '--config.checkpoint_every_steps=4', '--config.eval_every_steps=6',
          '--config.log_every_steps=1', '--config.num_eval_bleu_sentences=6', '--config.mesh_shape=(2,2,2)',
          '--config.num_processes=2', f'--config.coordinator_address=localhost:{port}', *extra]
  return [base + [f'--config.process_id={i}'] for i in (0, 1)]


def _run(commands, kill_after_step=None, workdir=None, env=None, cwd=None):
  """Runs both processes; with `kill_after_step`, kill -9 process 1 once that step is logged and two
  checkpoints are written (process 0 must then stop by itself within 60 s). Returns the processes, their
  outputs and the seconds process 0 took to exit after the kill."""
  processes = [subprocess.Popen(c, env=env or subprocess_env(4), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, cwd=cwd) for c in commands]
  exit_seconds, head = None, ''
  if kill_after_step is not None:
    for line in processes[0].stdout:
      head += line
      if line.startswith(f'step {kill_after_step}/'):
        deadline = time.time() + 300
        while len(checkpointing.available_steps(workdir)) < 2 and time.time() < deadline:
          time.sleep(0.05)
        processes[1].kill()  # one host dies
        killed_at = time.time()
        break
    try:  # process 0 must stop by itself (a generous wait: the event, not its speed, is what is tested)
      processes[0].wait(timeout=300)
      exit_seconds = time.time() - killed_at
    except subprocess.TimeoutExpired:
      processes[0].kill()
  outputs = [p.communicate(timeout=600)[0] for p in processes]
  return processes, [head + outputs[0], outputs[1]], exit_seconds


@pytest.fixture(scope='module')
def corpus(tmp_path_factory):
  directory = tmp_path_factory.mktemp('corpus')
  write_corpus(str(directory), 400, 0, 'train')
  write_corpus(str(directory), 24, 1, 'eval')
  return str(directory)


@pytest.fixture(scope='module')
def reference(corpus, tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp('reference'))
  processes, outputs, _ = _run(_commands(workdir, corpus))
  assert [p.returncode for p in processes] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
  return workdir, outputs


def test_two_hosts_on_gcs_resume_bitwise_after_kill(corpus, reference, gcs, tmp_path):
  """The run's data, workdir, averaged model and translations all on gs://; nothing written locally."""
  expected_dir, outputs = reference
  bucket_corpus, killed = 'gs://bucket/corpus', 'gs://bucket/run'
  for name in os.listdir(corpus):
    (storage.path(bucket_corpus) / name).write_bytes((storage.path(corpus) / name).read_bytes())
  env, cwd = {**subprocess_env(4), **gcs}, tmp_path / 'cwd'
  cwd.mkdir()
  # Checkpoints at 2 and 4 before the kill, 6 and 12 after (the losses do not depend on it; each save to the
  # emulator takes seconds); a 10 s heartbeat: process 0 names the lost process after 2.5 s.
  commands = _commands(killed, bucket_corpus, ['--config.checkpoint_every_steps=2', '--config.heartbeat_timeout_seconds=10'])
  processes, outputs, exit_seconds = _run(commands, kill_after_step=5, workdir=killed, env=env, cwd=cwd)  # after checkpoint 4
  assert processes[1].returncode == -signal.SIGKILL
  print(f'process 0 exited {exit_seconds} s after process 1 was killed:', outputs[0].strip().splitlines()[-1])
  assert processes[0].returncode == 1  # it stopped by itself, naming the lost process
  assert outputs[0].strip().splitlines()[-1].startswith('error: process 1 of 2 stopped responding 2.5 s ago')
  assert checkpointing.available_steps(killed)[:2] == [2, 4]
  data_state = storage.path(killed) / 'checkpoints' / '4' / 'data' / 'process_1.json'
  data_state.write_text(data_state.read_text()[:20])  # damage that process 1 alone reads
  processes, outputs, _ = _run([c + ['--config.checkpoint_every_steps=6'] for c in commands], env=env, cwd=cwd)
  assert [p.returncode for p in processes] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
  assert 'checkpoint 4 cannot be restored on process 1 (JSONDecodeError' in outputs[0]
  assert all('resumed from step 2' in output and 'restarts' not in output for output in outputs)  # both fall back
  comparison = compare_runs.compare(expected_dir, killed)
  print(comparison)
  assert comparison['last_step'] == STEPS and comparison['differing_steps'] == []
  assert comparison['evaluations'] >= 1 and comparison['differing_evaluations'] == []
  data = storage.path(killed) / 'checkpoints' / str(STEPS) / 'data'
  saved = sorted(p.name for p in data.iterdir() if p.name.endswith('.json'))
  assert saved == ['process_0.json', 'process_1.json']
  states = [json.loads((data / name).read_text()) for name in saved]
  assert states[0] == states[1] and states[0]['step'] == STEPS  # one global stream, one state
  assert (storage.path(killed) / 'tensorboard').is_dir() and (storage.path(killed) / 'translations').is_dir()

  # The averaged model and its translations, on gs:// too (the programs run in this process, on its devices).
  averaged = programs.run(average_command.main, ['average', f'--workdir={killed}', '--output=gs://bucket/averaged',
                                                 '--last=2'], cwd=cwd, text=True)
  assert averaged.returncode == 0, averaged.stderr[-2000:]
  chosen = ['--workdir=gs://bucket/averaged', f'--input={bucket_corpus}/eval.src.gz', '--n_best=2',
            f'--reference={bucket_corpus}/eval.tgt.gz']
  translated = programs.run(translate_command.main, ['translate.py', *chosen, '--output=gs://bucket/eval.de.gz'],
                            cwd=cwd, text=True)
  assert translated.returncode == 0, translated.stderr[-2000:]
  assert 'BLEU = ' in translated.stderr
  lines = parallel_text.read_lines('gs://bucket/eval.de.gz')
  assert len(lines) == len(parallel_text.read_lines(f'{bucket_corpus}/eval.src.gz')) == 24
  # The same n-best lists from translate.py on two processes × 2 devices, each translating its share.
  processes = [subprocess.Popen(c, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True) for c in _translate_commands([*chosen, '--output=gs://bucket/two.de.gz'])]
  logs = [p.communicate(timeout=300)[0] for p in processes]
  assert [p.returncode for p in processes] == [0, 0], logs[0][-3000:] + logs[1][-3000:]
  assert translated.stderr.splitlines()[-1] in logs[0]  # the same BLEU line
  # The same lists: the same texts in the same order, and scores equal to their printed 4 decimals (a sentence
  # decoded beside other sentences on other devices may round its last printed digit the other way).
  two, one = ([json.loads(line) for line in parallel_text.read_lines(f'gs://bucket/{name}.de.gz')]
              for name in ('two', 'eval'))
  assert [[h['text'] for h in line['hypotheses']] for line in two] == \
      [[h['text'] for h in line['hypotheses']] for line in one]
  assert [[h['score'] for h in line['hypotheses']] for line in two] == \
      [[pytest.approx(h['score'], abs=1.5e-4) for h in line['hypotheses']] for line in one]
  assert list(cwd.iterdir()) == []  # nothing was written where the processes ran


def test_evaluation_equals_one_process(corpus, reference, tiny_config):
  workdir, _ = reference
  config = workdirs.read_config(workdir)
  _, evaluations, _ = compare_runs.read_run(workdir)
  logged = evaluations[STEPS]
  model_config = settings.model_settings(config)
  mesh = partitioning.create_mesh((8, 1, 1))
  state, shardings = train_state.create_train_state(model_config, settings.resolve(config).optimizer, mesh, jax.random.key(0))
  manager = checkpointing.create_manager(workdir, 10)
  state = checkpointing.restore_state(manager, STEPS, state, shardings)
  manager.close()
  processor, vocab_path = tokenizer.train_or_load(settings.resolve(config).data, workdir, None)
  eval_step = partitioning.jit_eval_step(functools.partial(steps.eval_step, model_config=model_config,
                                                           label_smoothing=config.label_smoothing),
                                         mesh, shardings.params)
  batches = token_table.eval_batches(settings.resolve(config).data, vocab_path, 'eval', 8)
  sharding = partitioning.batch_sharding(mesh)
  results = scoring.evaluate_loss(eval_step, state.params, batches,
                                     lambda b: {k: jax.device_put(v, sharding) for k, v in b.items()})
  pairs = list(parallel_text.python_pairs(settings.resolve(config).data, 'eval'))[:config.num_eval_bleu_sentences]
  hypotheses = Translator(jax.device_get(state.params), model_config, processor, beam_size=config.beam_size,
                          length_penalty_alpha=config.length_penalty_alpha, max_extra_length=config.max_extra_length,
                          eval_tokens_per_batch=config.eval_tokens_per_batch).translate([p[0] for p in pairs])
  bleu, _ = scoring.bleu(hypotheses, [p[1] for p in pairs])
  print('two processes:', logged, '\none process:', results, bleu, hypotheses)
  with open(os.path.join(workdir, 'translations', f'eval_{STEPS}.txt')) as f:
    assert f.read().splitlines() == hypotheses  # the same translations, line for line
  assert results['tokens'] == logged['tokens']
  for name in ('loss', 'perplexity', 'accuracy'):
    assert results[name] == pytest.approx(logged[name], rel=1e-5)
  assert bleu == pytest.approx(logged['bleu'], abs=1e-9)


def _one_process(command):
  return [a for a in command if not a.startswith(('--config.num_processes', '--config.coordinator_address',
                                                  '--config.process_id'))]


def test_resume_on_one_process_then_on_two_continues_the_global_stream(corpus, reference, tmp_path):
  """The two-process run's checkpoint 4 continued by one process with all 8 devices to step 8, then by two
  processes again to step 12: every step's global batch holds the reference run's rows."""
  expected_dir, _ = reference
  workdir = tmp_path / 'moved'
  shutil.copytree(expected_dir, workdir, ignore=shutil.ignore_patterns('8', '12', 'tensorboard'))
  metrics = workdir / 'train_metrics.jsonl'
  metrics.write_text(''.join(line for line in metrics.read_text().splitlines(True) if json.loads(line)['step'] <= 4))
  commands = _commands(str(workdir), corpus)
  one = subprocess.run(_one_process(commands[0]) + ['--config.num_train_steps=8'], env=subprocess_env(8),
                       capture_output=True, text=True, timeout=600)
  assert one.returncode == 0 and 'resumed from step 4' in one.stdout, one.stdout[-3000:] + one.stderr[-3000:]
  processes, outputs, _ = _run(commands)
  assert [p.returncode for p in processes] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
  assert all('resumed from step 8' in output for output in outputs)
  comparison = compare_runs.compare(expected_dir, str(workdir))
  print(comparison)
  assert comparison['last_step'] == STEPS and comparison['differing_batches'] == []
  assert len(compare_runs.read_run(str(workdir))[2]) == STEPS
  assert comparison['largest_loss_difference'] < 1e-5  # one mesh, other processes: float rounding at most


def _translate_commands(flags):
  """translate.py with `flags` as processes 0 and 1 of one job on localhost, 2 CPU devices each; a 10 s
  heartbeat."""
  port = _free_port()
  base = [sys.executable, os.path.join(ROOT, 'translate.py'), *flags, '--devices=2',
          '--num_processes=2', f'--coordinator_address=localhost:{port}', '--heartbeat_timeout_seconds=10']
  return [base + [f'--process_id={i}'] for i in (0, 1)]
