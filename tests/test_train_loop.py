"""train_and_evaluate end to end: workdir contents, tfds path, exact resume after SIGKILL, SIGTERM, bad input."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import flax.linen as nn
import jax
import numpy as np
import pytest
import tensorflow_datasets as tfds

from tools import compare_runs
from flax_transformer import checkpointing, hooks, metrics_log, partitioning, saver, train_loop, validation_hooks, weights, workdirs
from flax_transformer.errors import WorkdirError
from tests.conftest import ROOT, TRAINED_FLAGS, TRAINED_STEPS, subprocess_env, train_command
from tests.helpers.corpus import write_corpus


def one_device():
  """The devices for small_run's mesh_shape (1, 1, 1), out of the 8 virtual CPU devices."""
  return jax.local_devices()[:1]


def small_run(config, tmp_path):
  (train_src, train_tgt), _, _ = write_corpus(str(tmp_path), 200, 0, 'train')
  (eval_src, eval_tgt), _, _ = write_corpus(str(tmp_path), 10, 1, 'eval')
  config.dataset = 'files'
  config.train_source, config.train_target = train_src, train_tgt
  config.eval_source, config.eval_target = eval_src, eval_tgt
  config.num_bucket_boundaries = 1  # few shapes: few compilations
  config.max_train_length = 16
  config.max_eval_length = 16
  config.num_train_steps = 6
  config.checkpoint_every_steps = 3
  config.eval_every_steps = 6
  config.log_every_steps = 1
  config.num_eval_bleu_sentences = 4
  config.mesh_shape = (1, 1, 1)
  return config


@pytest.mark.slow  # 8 s or more of compilation and steps on 2 cores (the marker)
def test_files_run_writes_checkpoints_vocab_and_events(tiny_config, tmp_path, monkeypatch):
  config = small_run(tiny_config, tmp_path)
  config.eval_every_steps = 3
  workdir = str(tmp_path / 'work')
  built = []
  monkeypatch.setattr(validation_hooks.token_table, 'eval_batches',
                      lambda *args, f=validation_hooks.token_table.eval_batches: built.append(args) or f(*args))
  result = train_loop.train_and_evaluate(config, workdir, one_device())
  assert checkpointing.available_steps(workdir) == [3, 6]
  with open(os.path.join(workdir, metrics_log.METRICS_FILENAME)) as f:
    evaluations = [json.loads(line) for line in f if '"eval"' in line]
  assert [e['step'] for e in evaluations] == [3, 6]
  assert len(built) == 1  # the validation batches are built once, not at every evaluation
  assert os.path.exists(os.path.join(workdir, 'sentencepiece.model'))
  assert os.path.exists(os.path.join(workdir, 'config.json'))
  assert any(name.startswith('events') for name in os.listdir(os.path.join(workdir, 'tensorboard')))
  assert 'bleu' in result['eval'] and result['eval']['perplexity'] > 1
  # A workdir holding another model is refused and left as it is.
  config.model.d_model = 32
  with pytest.raises(WorkdirError, match='holds a run with model.d_model=16'):
    train_loop.train_and_evaluate(config, workdir, one_device())
  assert checkpointing.available_steps(workdir) == [3, 6]


@pytest.mark.slow  # 8 s or more of compilation and steps on 2 cores (the marker)
def test_wmt14_mock_run(tiny_config, tmp_path, monkeypatch):
  config = small_run(tiny_config, tmp_path)
  config.dataset = 'wmt14_translate/de-en'
  config.num_train_steps = 3
  # mock_data patches file I/O in a way Orbax cannot write through: record the saves instead.
  saved = []
  monkeypatch.setattr(checkpointing, 'save_state', lambda manager, state, *data: saved.append(int(state.step)))
  with tfds.testing.mock_data(num_examples=30, policy=tfds.testing.MockPolicy.USE_CODE):
    result = train_loop.train_and_evaluate(config, str(tmp_path / 'wmt'), one_device())
  assert saved == [3] and result['step'] == 3 and result['eval']['tokens'] > 0
  assert os.path.exists(str(tmp_path / 'wmt' / 'sentencepiece.model'))


def _run_until(command, workdir, step, sig, wait_for_checkpoint=False):
  """Starts training and sends `sig` once step `step` has been logged (and a checkpoint is on disk)."""
  process = subprocess.Popen(command, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  for line in process.stdout:
    if line.startswith(f'step {step}/'):
      deadline = time.time() + 300
      while wait_for_checkpoint and not checkpointing.available_steps(workdir) and time.time() < deadline:
        time.sleep(0.05)
      process.send_signal(sig)
      break
  output = process.communicate(timeout=300)[0]
  return process.returncode, output


@pytest.fixture(scope='module')
def corpus(tmp_path_factory):
  directory = tmp_path_factory.mktemp('corpus')
  write_corpus(str(directory), 200, 0, 'train')
  write_corpus(str(directory), 10, 1, 'eval')
  return str(directory)


@pytest.mark.slow
def test_exact_resume_after_sigkill(trained_run, tmp_path):
  reference, corpus = trained_run  # uninterrupted
  steps, command = TRAINED_STEPS, lambda workdir: train_command(workdir, corpus, TRAINED_STEPS, *TRAINED_FLAGS)
  killed = str(tmp_path / 'killed')
  code, _ = _run_until(command(killed), killed, 5, signal.SIGKILL, wait_for_checkpoint=True)
  assert code == -signal.SIGKILL
  restored_from = checkpointing.available_steps(killed)[-1]
  assert 3 <= restored_from < steps
  result = subprocess.run(command(killed), env=subprocess_env(), check=True, capture_output=True, text=True, timeout=600)
  assert f'resumed from step {restored_from}' in result.stdout
  assert 'taking over the lock of workdir' in result.stderr and 'is no longer running' in result.stderr
  expected, resumed = compare_runs.read_run(reference)[0], compare_runs.read_run(killed)[0]
  assert sorted(expected) == list(range(1, steps + 1))
  for step in range(restored_from + 1, steps + 1):  # every step after the restored checkpoint, bitwise
    assert resumed[step] == expected[step], (step, resumed[step], expected[step])
  abstract = nn.meta.unbox(partitioning.abstract_params(workdirs.read_settings(reference).model))
  for kind in ('params', 'ema'):  # the weights and their moving average, bitwise
    ours, theirs = (jax.device_get(weights.restore_params(w, steps, abstract, weights=kind)) for w in (killed, reference))
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree_util.tree_leaves(ours), jax.tree_util.tree_leaves(theirs)))


@pytest.mark.slow
def test_a_second_run_on_a_busy_workdir_is_refused_and_writes_nothing(corpus, tmp_path):
  """A run holds the workdir's lock (here a process that only holds it); train.py on that workdir stops in
  one line before its vocabulary, config, metrics or first compile."""
  workdir = tmp_path / 'busy'
  workdir.mkdir()
  holder = subprocess.Popen([sys.executable, '-c', 'import sys, time; from flax_transformer import run_lock; '
                             'run_lock.RunLock(sys.argv[1]).acquire(); print("locked", flush=True); time.sleep(300)',
                             str(workdir)], env=subprocess_env(), stdout=subprocess.PIPE, text=True)
  try:
    assert holder.stdout.readline().strip() == 'locked'
    result = subprocess.run(train_command(str(workdir), corpus), env=subprocess_env(), capture_output=True, text=True,
                            timeout=300)
  finally:
    holder.kill()
  errors = [line for line in result.stderr.splitlines() if line.startswith('error: ')]
  assert result.returncode == 1 and len(errors) == 1, result.stderr[-2000:]
  assert errors[0].startswith(f'error: workdir {workdir} is in use by a run started ') and 'on this host' in errors[0]
  written = sorted(str(p.relative_to(workdir)) for p in workdir.rglob('*'))
  assert written == ['checkpoints', 'run.lock'] and not any((workdir / 'checkpoints').iterdir())  # probed only


@pytest.mark.slow
def test_sigterm_saves_exits_zero_and_abandons_an_evaluation(corpus, tmp_path):
  # The signal is sent as step 4's line appears, i.e. as step 4's evaluation (loss, then BLEU) starts: the
  # evaluation is abandoned, the checkpoint of step 4 saved, and the run exits 0.
  workdir = str(tmp_path / 'term_eval')
  command = train_command(workdir, corpus, steps=50) + ['--config.eval_every_steps=4',
                                                          '--config.num_eval_bleu_sentences=4']
  code, output = _run_until(command, workdir, 4, signal.SIGTERM)
  assert code == 0, output[-2000:]
  assert 'evaluation at step 4 abandoned: SIGTERM received' in output and 'eval step 4:' not in output
  assert 'SIGTERM received: checkpoint saved at step 4' in output
  assert checkpointing.available_steps(workdir)[-1] == 4


@pytest.mark.slow
def test_bad_input_is_a_one_line_error(corpus, tmp_path):
  unwritable = tmp_path / 'ro'
  unwritable.mkdir()
  unwritable.chmod(0o500)
  blocker = tmp_path / 'file'
  blocker.write_text('not a directory')
  for workdir, message in ((str(blocker / 'sub'), 'cannot be written'),):
    result = subprocess.run(train_command(workdir, corpus), env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 1
    errors = [l for l in result.stderr.splitlines() if l.startswith('error: ')]
    assert len(errors) == 1 and message in errors[0]
  result = subprocess.run(train_command(str(tmp_path / 'w'), corpus) + ['--config.train_source=/nonexistent.gz'],
                          env=subprocess_env(), capture_output=True, text=True, timeout=300)
  assert result.returncode == 1 and ('error: config.train_source=/nonexistent.gz does not exist; set the path '
                                    '(--config.train_source=PATH); for Multi30k, python tools/get_multi30k.py') in result.stderr


def test_nan_loss_stops_before_the_next_checkpoint(tiny_config, tmp_path):
  config = small_run(tiny_config, tmp_path)
  config.learning_rate_factor = 1e30  # the first update overflows the parameters
  config.num_train_steps = 10
  config.max_skipped_steps = 3  # each non-finite step's update is skipped; the fourth in a row stops the run
  with pytest.raises(hooks.TrainingDiverged,
                     match='the training loss became (nan|inf|-inf) at step 2 and stayed non-finite for 4 steps; '
                           'the run stopped and no checkpoint was written before it'):
    train_loop.train_and_evaluate(config, str(tmp_path / 'nan'), one_device())
  assert checkpointing.available_steps(str(tmp_path / 'nan')) == []  # step 3's checkpoint was not written


def test_loss_guard_skips_isolated_non_finite_steps_and_stops_a_spike():
  guard = hooks.LossGuard(max_skipped=2, factor=3.0, patience=4, verbose=False)
  guard.saved(10)
  for step in range(1, 31):
    guard.update(step, 5.0 - step * 0.1)
  guard.update(31, float('nan'))  # skipped, not fatal
  guard.update(32, float('nan'))
  guard.update(33, 1.9)
  guard.saved(40)
  for step in range(34, 50):  # a lone spike is forgiven
    guard.update(step, 20.0 if step == 40 else 1.9)
  for step in range(50, 53):
    guard.update(step, 9.0)  # 3 of the 4 steps the guard waits for
  with pytest.raises(hooks.TrainingDiverged, match=r'rose to 9 at step 53, above 3 x its running median '
                                                        r'\S+ for 4 steps \(since step 50\); the run stopped and '
                                                        r'checkpoint 40 is from before it'):
    guard.update(53, 9.0)
  nan_guard = hooks.LossGuard(max_skipped=1, factor=0.0, patience=4, verbose=False)
  nan_guard.update(1, float('inf'))
  with pytest.raises(hooks.TrainingDiverged, match='became inf at step 1 and stayed non-finite for 2 steps'):
    nan_guard.update(2, float('nan'))


@pytest.mark.slow  # 8 s or more of compilation and steps on 2 cores (the marker)
def test_failed_save_stops_the_run_and_keeps_earlier_checkpoints(tiny_config, tmp_path, monkeypatch):
  config = small_run(tiny_config, tmp_path)
  original = checkpointing.save_state

  def disk_full_after_first(manager, state, data_state, metrics=None):
    if int(state.step) > 3:
      raise OSError(28, 'No space left on device')
    original(manager, state, data_state, metrics)

  monkeypatch.setattr(checkpointing, 'save_state', disk_full_after_first)
  with pytest.raises(saver.CheckpointSaveFailed, match='saving the checkpoint at step 6 .* No space left'):
    train_loop.train_and_evaluate(config, str(tmp_path / 'full'), one_device())
  assert checkpointing.available_steps(str(tmp_path / 'full')) == [3]


def test_compare_runs_finds_the_first_differing_step(tmp_path):
  def write(name, losses, perplexity, bleu=None):
    os.makedirs(tmp_path / name)
    with open(tmp_path / name / metrics_log.METRICS_FILENAME, 'w') as f:
      for end in range(2, len(losses) + 1, 2):  # logged every 2 steps, as the loop writes them
        f.write(json.dumps({'step': end, 'split': 'train_steps', 'losses': losses[end - 2:end]}) + '\n')
      f.write(json.dumps({'step': len(losses), 'split': 'eval', 'perplexity': perplexity,
                          **({'bleu': bleu} if bleu is not None else {})}) + '\n')
    return str(tmp_path / name)

  losses = [5.0, 4.5, 4.25, 4.0, 3.875, 3.75]
  a = write('a', losses, 9.5, bleu=12.0)
  same = compare_runs.compare(a, write('b', list(losses), 9.5))  # no BLEU: compared on perplexity
  assert same['steps'] == 6 and same['differing_steps'] == [] and same['differing_evaluations'] == []
  changed = losses[:3] + [4.0 + 1e-12] + losses[4:]
  other = compare_runs.compare(a, write('c', changed, 9.5000001))
  assert other['differing_steps'] == [4] and other['differing_evaluations'] == [6]


@pytest.mark.slow
def test_failed_write_inside_the_checkpointer_exits_promptly(corpus, tmp_path):
  """A write that fails inside Orbax's save (here: the data-state item, as a full disk would) is reported
  at that save in one line, the process exits 1 at once, and no step without its data state appears."""
  for kind, cause in (('write', 'OSError: [Errno 28] No space left on device'),
                      ('folder', 'PermissionError: [Errno 1] Operation not permitted')):
    workdir = str(tmp_path / kind)
    command = [sys.executable, os.path.join(ROOT, 'tests', 'helpers', 'save_failure_worker.py')] + train_command(
        workdir, corpus, 9)[2:]
    process = subprocess.Popen(command, env=dict(subprocess_env(), FAIL_FROM_STEP='6', FAIL_KIND=kind),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in process.stdout:
      if line.startswith('step 6/'):
        break
    saved_at = time.time()  # step 6's line is printed just before its save
    _, stderr = process.communicate(timeout=600)  # it must exit by itself, not wait in Orbax's threads
    print(f'{kind}: exited {time.time() - saved_at:.1f} s after the failing save')
    assert process.returncode == 1
    assert stderr.strip().splitlines()[-1].startswith(
        f'error: saving the checkpoint at step 6 in {workdir} failed ({cause}')
    assert stderr.strip().endswith('the run stopped and checkpoint 3 is the newest intact one')
    assert checkpointing.available_steps(workdir) == [3]
    assert len(stderr.strip().splitlines()) == 1, stderr[-3000:]  # no traceback from Orbax's thread beside it
    assert sorted(os.listdir(os.path.join(workdir, 'checkpoints'))) == ['3']  # the partial save removed


def _step_losses(workdir):
  """{step: loss} from every 'train_steps' line of the run's metrics (log_every_steps=1: one loss a line)."""
  losses = {}
  with open(os.path.join(workdir, metrics_log.METRICS_FILENAME)) as f:
    for record in map(json.loads, f):
      if record['split'] == 'train_steps':
        first = record['step'] - len(record['losses']) + 1
        losses.update({first + i: loss for i, loss in enumerate(record['losses'])})
  return losses


def _truncate_largest_array_file(checkpoint):
  files = [os.path.join(d, f) for d, _, names in os.walk(os.path.join(checkpoint, 'params')) for f in names
           if f'{os.sep}d{os.sep}' in os.path.join(d, f) or os.path.basename(d) == 'd']
  largest = max(files, key=os.path.getsize)
  with open(largest, 'r+b') as f:
    f.truncate(os.path.getsize(largest) // 2)


def _remove_params(checkpoint):
  shutil.rmtree(os.path.join(checkpoint, 'params'))


def _truncate_data_state(checkpoint):
  path = os.path.join(checkpoint, 'data', 'process_0.json')
  with open(path, 'r+b') as f:
    f.truncate(os.path.getsize(path) // 2)


@pytest.mark.slow
def test_damaged_checkpoints_are_set_aside_and_the_run_resumes_from_the_newest_intact_one(trained_run, tmp_path):
  """Three kinds of damage, one to each of the newest three checkpoints (an array file cut short, the
  parameters gone, the data-iterator state cut short): each is named, renamed to .corrupt and kept, and the
  run resumes from checkpoint 3 bitwise, as if it had been killed after step 3."""
  reference_run, corpus = trained_run  # checkpoints 3, 6, 9, 12
  workdir = str(tmp_path / 'run')
  shutil.copytree(reference_run, workdir)
  damages = {12: _truncate_largest_array_file, 9: _remove_params, 6: _truncate_data_state}
  for step, damage in damages.items():
    damage(os.path.join(workdir, 'checkpoints', str(step)))
  result = subprocess.run(train_command(workdir, corpus, TRAINED_STEPS, *TRAINED_FLAGS), env=subprocess_env(),
                          capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-2000:]
  for step in damages:
    notice = [line for line in result.stderr.splitlines() if line.startswith(f'checkpoint {step} cannot be restored')]
    assert len(notice) == 1 and notice[0].endswith('.corrupt, trying the one before'), result.stderr[-3000:]
    assert os.path.isdir(os.path.join(workdir, 'checkpoints', f'{step}.corrupt'))  # kept for inspection
  assert 'resumed from step 3' in result.stdout
  assert checkpointing.available_steps(workdir) == [3, 6, 9, 12]  # 6, 9 and 12 written anew
  reference, resumed = _step_losses(reference_run), _step_losses(workdir)
  assert [resumed[s] for s in range(4, 13)] == [reference[s] for s in range(4, 13)]  # bitwise


@pytest.mark.slow
def test_a_damaged_config_file_is_a_one_line_error(trained_run, tmp_path):
  reference_run, corpus = trained_run
  workdir = str(tmp_path / 'run')
  shutil.copytree(reference_run, workdir)
  path = os.path.join(workdir, 'config.json')
  with open(path, 'r+b') as f:
    f.truncate(os.path.getsize(path) // 2)
  result = subprocess.run(train_command(workdir, corpus, TRAINED_STEPS, *TRAINED_FLAGS), env=subprocess_env(),
                          capture_output=True, text=True, timeout=300)
  assert result.returncode == 1
  errors = [line for line in result.stderr.splitlines() if line.startswith('error: ')]
  assert len(errors) == 1 and errors[0].startswith(f'error: {path} is damaged'), result.stderr[-1000:]
  assert checkpointing.available_steps(workdir) == [3, 6, 9, 12]


@pytest.mark.slow  # 8 s or more of compilation and steps on 2 cores (the marker)
def test_a_learning_rate_far_too_large_stops_the_run(tiny_config, tmp_path):
  """10^4 x the paper's rate: the loss climbs into the thousands but stays finite; the run stops instead
  of training on, and names the last checkpoint from before the rise."""
  config = small_run(tiny_config, tmp_path)
  config.learning_rate_factor = 1e4
  config.num_train_steps = 30
  config.loss_spike_steps = 5
  with pytest.raises(hooks.TrainingDiverged, match=r'the training loss rose to \S+ at step \d+, above 3 x its '
                                                        r'running median'):
    train_loop.train_and_evaluate(config, str(tmp_path / 'spike'), one_device())
