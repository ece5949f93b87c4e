"""`train_and_evaluate(config, workdir)`: `set_up` (the config read once by settings.py, cluster, checks, mesh,
vocabulary, state resumed from the newest good checkpoint, data, jitted steps), then `_train`, a loop that only
orchestrates batches, the pure step and hooks (MetricsLog, Saver, Evaluator, Progress, LossGuard) in the order
its docstring lists.

Hooks: progress line and TensorBoard every `log_every_steps`, validation loss/perplexity/accuracy and
BLEU on a validation sample every `eval_every_steps`, an Orbax checkpoint (with each process's
data-iterator state) every `checkpoint_every_steps`, on the last step and on SIGTERM/SIGINT. A NaN/Inf
loss stops the run before the next checkpoint is written, so the last good one stays untouched.
"""

import collections
import dataclasses
import functools
import json
import math
import os
import signal
import sys
import time
from collections.abc import Callable

import jax
import numpy as np
import orbax.checkpoint as ocp
import sentencepiece as spm
import tensorflow as tf
from etils import epath

from flax_transformer import (checkpointing, cluster, evaluation, finetuning, input_pipeline, optim, parallel_text,
                              partitioning, platforms, run_lock, settings, steps, storage, tensorflow_setup,
                              token_table, tokenizer, train_state, translator, workdirs)
from flax_transformer.errors import UserError, WorkdirError
from flax_transformer.model import TransformerConfig
from flax_transformer.settings import Settings
from flax_transformer.translator import Translator

METRICS_FILENAME = 'train_metrics.jsonl'
TRANSLATIONS_DIR = 'translations'  # translations/eval_<step>.txt: the BLEU sample's translations
VOCABULARY_TIMEOUT_SECONDS = 4 * 3600  # How long other processes wait for process 0 to train the vocabulary.


class TrainingDiverged(UserError):
  """The loss became NaN or Inf."""


class CheckpointSaveFailed(UserError):
  """A checkpoint could not be written (disk full, permissions...)."""


def _say(line: str) -> None:
  """A line on stdout from a signal handler: written at once, past Python's buffer (which the interrupted code
  may be in the middle of)."""
  os.write(sys.stdout.fileno(), (line + '\n').encode())


class _StopSignal:
  """Turns SIGTERM/SIGINT into a flag the loop checks after each step (checkpoint, then exit 0).

  A multi-process run must stop every process at the same step, or the others wait forever in the next
  collective. There SIGTERM is left to JAX's preemption service (set up by `jax.distributed.initialize`),
  SIGINT is passed on to it as a SIGTERM of this process, and `check(step)` reports the signal at the step
  `multihost_utils.reached_preemption_sync_point` agrees on across processes; evaluations are not abandoned.
  """

  def __init__(self, multi_process: bool = False):
    self.received = None
    self.multi_process = multi_process
    self._previous = {}
    for sig in (signal.SIGINT,) if multi_process else (signal.SIGTERM, signal.SIGINT):
      self._previous[sig] = signal.signal(sig, self._handle)

  def _handle(self, signum, frame):
    name = signal.Signals(signum).name
    if self.received is not None:  # pressed again while the run stops: the stop's checkpoint is being written
      _say(f'{name} received again: the run is saving its checkpoint and exits once it is written')
    elif self.multi_process:
      os.kill(os.getpid(), signal.SIGTERM)  # to the preemption service, which tells every process
    else:
      self.received = name
      _say(f'{name} received: the run stops after this step and saves a checkpoint')

  def check(self, step: int) -> str | None:
    """The signal to stop on after `step`, or None; call after every step, on every process."""
    if self.multi_process and self.received is None:
      from jax.experimental import multihost_utils
      if multihost_utils.reached_preemption_sync_point(step):
        self.received = 'SIGTERM'
    return self.received

  def restore(self):
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)


class LossGuard:
  """Stops a run whose loss is lost: non-finite for more than `max_skipped` consecutive steps (each such
  step's update is skipped by optax.apply_if_finite), or above `factor` × its running median (of the last
  `window` finite losses) for `patience` consecutive steps. Names the last checkpoint from before the trouble."""

  def __init__(self, max_skipped: int, factor: float, patience: int, window: int = 200, verbose: bool = True,
               checkpoints: list[int] | None = None):
    self.max_skipped, self.factor, self.patience, self.verbose = max_skipped, factor, patience, verbose
    self.history = collections.deque(maxlen=window)
    self.nonfinite, self.high = [], []  # steps of the current runs of non-finite and of too-high losses
    self.checkpoints = list(checkpoints or [])  # steps saved so far, the run's earlier ones included

  def saved(self, step: int) -> None:
    self.checkpoints.append(step)

  def last_good(self, trouble_start: int) -> str:
    good = [s for s in self.checkpoints if s < trouble_start]
    return f'checkpoint {good[-1]} is from before it' if good else 'no checkpoint was written before it'

  def update(self, step: int, loss: float) -> None:
    if not np.isfinite(loss):
      self.nonfinite.append(step)
      self.first_nonfinite = loss if len(self.nonfinite) == 1 else self.first_nonfinite
      if self.verbose:
        print(f'step {step}: loss {loss}, the update was skipped', flush=True)
      if len(self.nonfinite) > self.max_skipped:
        raise TrainingDiverged(
            f'the training loss became {self.first_nonfinite} at step {self.nonfinite[0]} and stayed non-finite for '
            f'{len(self.nonfinite)} steps; the run stopped and {self.last_good(self.nonfinite[0])}; lower '
            f'config.learning_rate_factor or enable config.grad_clip_norm')
      return
    self.nonfinite = []
    median = float(np.median(self.history)) if self.history else None
    if self.factor and median is not None and loss > self.factor * median:
      self.high.append(step)
      if len(self.high) >= self.patience:
        raise TrainingDiverged(
            f'the training loss rose to {loss:.4g} at step {step}, above {self.factor:g} x its running median '
            f'{median:.4g} for {len(self.high)} steps (since step {self.high[0]}); the run stopped and '
            f'{self.last_good(self.high[0])}; lower config.learning_rate_factor or enable config.grad_clip_norm')
      return  # a spike does not move the median it is judged against
    self.high = []
    self.history.append(loss)


def _finite_mean(values) -> float:
  """Mean of the finite values (steps whose update was skipped do not count); NaN if none."""
  values = np.asarray(values, np.float64)
  finite = values[np.isfinite(values)]
  return float(finite.mean()) if finite.size else float('nan')


def _format_eta(seconds: float) -> str:
  seconds = int(max(seconds, 0))
  return f'{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}'


def enable_compilation_cache() -> None:
  """Persists compiled programs (one per batch shape) so a restarted or resumed run skips recompiling."""
  directory = os.environ.get('JAX_COMPILATION_CACHE_DIR') or os.path.join(
      os.path.expanduser('~'), '.cache', 'flax_transformer', 'jax')
  jax.config.update('jax_compilation_cache_dir', directory)
  jax.config.update('jax_persistent_cache_min_compile_time_secs', 1.0)


def data_seed(seed: int, start_step: int) -> int:
  """The data stream's seed: the run's, or for a stream restarted at `start_step` one derived from both
  (so a restart does not replay the first steps' batches)."""
  if start_step == 0:
    return seed
  return int(np.random.SeedSequence([seed, start_step]).generate_state(1)[0] % 2 ** 31)


@dataclasses.dataclass
class Run:
  """What set-up builds, for the loop to read: one training run on one mesh."""
  settings: Settings
  workdir: epath.Path  # a local directory or a storage URL
  is_chief: bool
  mesh: jax.sharding.Mesh
  processor: spm.SentencePieceProcessor
  vocab_path: str
  state: train_state.TrainState
  state_shardings: train_state.TrainState  # a NamedSharding per leaf
  manager: ocp.CheckpointManager
  start_step: int
  train_iter: input_pipeline.TrainBatches
  train_step: Callable  # partitioning.jit_train_step's
  eval_step: Callable  # partitioning.jit_eval_step's
  learning_rate: Callable[[int], float]  # optax schedule, by update count
  dropout_rng: jax.Array
  data_shard: partitioning.DataShard  # the rows of every batch this process feeds
  lock: run_lock.RunLock | None  # the workdir's lock (process 0)

  @property
  def model_config(self) -> TransformerConfig:
    return self.settings.model

  @functools.cached_property
  def batch_sharding(self):
    return partitioning.batch_sharding(self.mesh)

  def to_global(self, batch):
    """This process's rows of a training batch -> the global batch."""
    return {k: self.data_shard.to_global(v, self.batch_sharding) for k, v in batch.items()}

  def eval_to_global(self, batch):
    """An evaluation batch every process holds whole -> a global array."""
    return {k: jax.make_array_from_callback(v.shape, self.batch_sharding, lambda index, v=v: v[index])
            for k, v in batch.items()}


def _vocabulary(data: settings.DataSettings, workdir: str, is_chief: bool):
  """Trained once by process 0 into the workdir, then read by every process: (processor, path)."""
  if is_chief:
    tokenizer.train_or_load(data, workdir, lambda: parallel_text.python_pairs(data))
  if jax.process_count() > 1:  # a coordination-service barrier: a device collective on CPU gives up after 30 s
    from orbax.checkpoint import multihost
    multihost.get_barrier_sync_fn()(key='vocabulary', timeout_ms=VOCABULARY_TIMEOUT_SECONDS * 1000)
  return tokenizer.train_or_load(data, workdir, None)


def _resume(restore_data_state: bool, workdir: str, state, state_shardings, manager):
  """The newest checkpoint that restores (state, data state), or the fresh state: (state, data state)."""
  state, data_state, step = checkpointing.restore_latest(manager, state, state_shardings, restore_data_state)
  if step is not None:
    if data_state is None:
      print(f'the data stream restarts at step {step} with a seed derived from it', flush=True)
    print(f'resumed from step {step} in {workdir}', flush=True)
  return state, data_state


def banner(s: Settings, mesh, num_params: int, num_batch_shapes: int, cluster_kind: str = 'single process') -> str:
  """What this run is on and what it will compile, printed before the first compilation."""
  devices = mesh.devices.flatten()
  dp = math.prod(mesh.shape[a] for a in ('data', 'fsdp'))
  lines = [
      f'platform: {s.platform} ({devices[0].device_kind}), {devices.size} devices '
      f'({jax.local_device_count()} on this process); process {jax.process_index()} of {jax.process_count()}',
      f'cluster: {cluster_kind}',
      f'mesh: {" x ".join(f"{name}={size}" for name, size in mesh.shape.items())}',
      f'model: {num_params:,} parameters (float32), compute dtype {s.model.dtype}, attention '
      f'{s.model.attention}, dropout masks {s.model.dropout_masks}, '
      f'{"fused" if s.loop.fused_output_loss else "optax"} output loss, beam top-k {s.decode.beam_top_k}',
      f'batch: {s.data.tokens_per_batch:,} tokens per side per step globally, {s.data.tokens_per_batch // dp:,} '
      f'per data-parallel device, {s.data.gradient_accumulation_steps} micro-batch(es); '
      f'{num_batch_shapes} batch shapes to compile',
  ]
  return '\n'.join(lines)


def set_up(config, workdir: str, devices=None) -> Run:
  """The run config read once (settings.py), the cluster, checks, the workdir's lock, mesh, vocabulary,
  train state (resumed if the workdir has a checkpoint), data and jitted steps."""
  enable_compilation_cache()
  tensorflow_setup.import_quietly()
  settings.check(config)  # every field, before any process starts
  cluster_kind = cluster.start(settings.cluster_settings(config)).kind  # before JAX's backend is touched
  cluster.watch_peers(settings.cluster_settings(config))
  cluster.check_same('config', settings.comparable(config))  # the processes run one config
  s = settings.resolve(config)  # the 'auto' choices, for the platform JAX now runs on
  platforms.check(s.loop.platform)
  is_chief, workdir = jax.process_index() == 0, storage.path(workdir)
  storage.check_reachable(workdir, '--workdir')
  for split in ('train', 'eval'):  # what the run reads, before anything is written or compiled
    parallel_text.check_split(s.data, split)
  origin = finetuning.source(s.loop.init_from, s.model, s.data.vocab_path)
  workdirs.check_inputs(workdir, s.data, origin.workdir if origin else '')
  workdirs.check(workdir, config, s.model)
  mesh = partitioning.create_mesh(s.loop.mesh_shape, devices)
  partitioning.check_model_fits_mesh(s.model, mesh)  # before the vocabulary's minute, not after
  shard = partitioning.data_shard(mesh.devices)
  lock, lock_error = None, None
  if is_chief:  # before anything is written to the workdir
    try:
      lock = run_lock.RunLock(workdir).acquire()
    except WorkdirError as error:
      lock_error = error
  cluster.agree('workdir lock', lock_error)
  try:
    return _build(config, s, workdir, mesh, shard, is_chief, lock, cluster_kind, origin)
  except BaseException:
    if lock is not None:
      lock.release()
    raise


def _build(config, s: Settings, workdir, mesh, shard, is_chief, lock, cluster_kind, origin) -> Run:
  """set_up's part after the workdir is locked; `origin`: the run to fine-tune from (finetuning.source)."""
  if origin and is_chief:
    finetuning.copy_vocabulary(origin, s.data.vocab_path, workdir)
  processor, vocab_path = _vocabulary(s.data, workdir, is_chief)
  if is_chief:  # once the data and vocabulary are known to work: a failed start leaves no config behind
    workdirs.write_config(workdir, config)
  init_rng, dropout_rng = jax.random.split(jax.random.key(s.loop.seed, impl=s.loop.dropout_rng_impl))
  state, state_shardings = train_state.create_train_state(s.model, s.optimizer, mesh, init_rng)
  manager = checkpointing.create_manager(workdir, s.loop.keep_checkpoints)
  state, data_state = _resume(s.loop.restore_data_state, workdir, state, state_shardings, manager)
  start_step = int(jax.device_get(state.step))
  if origin and start_step == 0:  # a fine-tuning run's first start: the source's parameters, a fresh optimizer
    state = finetuning.initial_params(origin, state, state_shardings)
    print(f'parameters from {origin.workdir} step {origin.step}; optimizer and schedule start at step 0', flush=True)
  train_iter = input_pipeline.process_train_batches(s.data, vocab_path, (shard.index, shard.count),
                                                    partitioning.data_parallel_size(mesh),
                                                    data_seed(s.loop.seed, start_step), data_state)
  if is_chief:
    num_params = sum(x.size for x in jax.tree_util.tree_leaves(state.params))
    print(banner(s, mesh, num_params, len(train_iter.batching.used_shapes), cluster_kind), flush=True)
  train_step = partitioning.jit_train_step(
      functools.partial(steps.train_step, model_config=s.model, label_smoothing=s.loop.label_smoothing,
                        gradient_accumulation_steps=s.loop.gradient_accumulation_steps,
                        fused_output_loss=s.loop.fused_output_loss), mesh, state_shardings)
  eval_step = partitioning.jit_eval_step(
      functools.partial(steps.eval_step, model_config=s.model, label_smoothing=s.loop.label_smoothing),
      mesh, state_shardings.params)
  return Run(s, workdir, is_chief, mesh, processor, vocab_path, state, state_shardings, manager,
             start_step, train_iter, train_step, eval_step,
             optim.learning_rate(s.optimizer, s.model.d_model), dropout_rng, shard, lock)


class MetricsLog:
  """TensorBoard scalars, the JSONL of metrics and every step's loss, and the console (process 0 only)."""

  def __init__(self, workdir, is_chief: bool, timeout: float):
    self.is_chief, self.writer, self.file, self.timeout = is_chief, None, None, timeout
    self.where = storage.path(workdir)
    if is_chief:
      self.tensorboard = storage.MirroredDirectory(self.where / 'tensorboard')
      self.writer = tf.summary.create_file_writer(self.tensorboard.local)
      self.file = storage.AppendedFile(self.where / METRICS_FILENAME)

  def scalars(self, step: int, scalars: dict, prefix: str) -> None:
    if not self.is_chief:
      return

    def write():
      with self.writer.as_default(step=step):
        for name, value in scalars.items():
          tf.summary.scalar(f'{prefix}/{name}', value)
      self.writer.flush()
      self.tensorboard.sync()
      self.file.write(json.dumps({'step': step, 'split': prefix, **scalars}) + '\n')
      self.file.flush()
    storage.within(self.timeout, f'writing the metrics of step {step} to {self.where}', write)

  def step_losses(self, step: int, losses) -> None:
    """Every step's loss, exactly (json floats round-trip), for resume checks and plots."""
    if self.is_chief:
      self.file.write(json.dumps({'step': step, 'split': 'train_steps', 'losses': [float(x) for x in losses]}) + '\n')

  def say(self, text: str) -> None:
    if self.is_chief:
      print(text, flush=True)

  def close(self) -> None:
    if self.file:
      self.writer.close()
      self.tensorboard.sync()
      self.file.close()


class Saver:
  """Asynchronous checkpoints whose failure is reported at once, naming the step that failed; a save still
  unfinished after `timeout` seconds (a storage server that stopped answering) is a failure too."""

  def __init__(self, manager, workdir: str, timeout: float):
    self.manager, self.workdir, self.timeout = manager, workdir, timeout
    self.step, self.started, self.failed = None, None, False  # the save in flight and when it began; whether one failed

  def _failure(self, step, error) -> CheckpointSaveFailed:
    self.failed = True  # Orbax's threads may wait forever now: the run exits without closing them

    def look():  # what the failed save left, and the newest checkpoint before it
      removed = checkpointing.remove_partial(self.workdir, step) if jax.process_index() == 0 else False
      return removed, [s for s in checkpointing.available_steps(self.workdir) if s < step]

    try:
      removed, saved = storage.within(min(self.timeout, 60), 'looking at the checkpoints', look)
      intact = f'checkpoint {saved[-1]} is the newest intact one' if saved else 'no earlier checkpoint exists'
    except Exception:  # the storage itself may be what failed
      removed, intact = False, 'earlier checkpoints were not checked'
    cause = str(error) if isinstance(error, storage.StorageError) else checkpointing.reason(error)
    return CheckpointSaveFailed(f'saving the checkpoint at step {step} in {self.workdir} failed '
                                f'({cause}){"; its partial files were removed" if removed else ""}; '
                                f'the run stopped and {intact}')

  def _waited(self, what: str, call):
    """`call()` within what is left of the save's `timeout` (at least a second)."""
    left = self.timeout - (time.monotonic() - self.started) if self.started else self.timeout
    return storage.within(max(left, 1.0), what, call)

  def check(self) -> None:
    """Raises for a failed or overdue asynchronous save, at the first step after it failed."""
    if self.step is None:
      return
    try:
      self.manager.check_for_errors()
      if time.monotonic() - self.started > self.timeout and self.manager.is_saving_in_progress():
        raise storage.overdue('the save', self.timeout)
    except Exception as error:  # disk full, permission denied, storage gone quiet...
      raise self._failure(self.step, error) from None

  def finish(self) -> None:
    """Waits for the save in flight (within its timeout); raises if it failed."""
    try:
      if self.manager.is_saving_in_progress():
        self._waited('the save', self.manager.wait_until_finished)
      else:
        self.manager.wait_until_finished()  # returns at once, raising a failure of the last save
    except Exception as error:
      raise self._failure(self.step, error) from None

  def save(self, step: int, state, data_state: dict) -> None:
    self.finish()
    self.step, self.started = step, time.monotonic()
    try:
      self._waited('the save', lambda: checkpointing.save_state(self.manager, state, data_state))
    except Exception as error:
      raise self._failure(step, error) from None

  def close(self) -> None:
    if not self.failed:
      self.manager.close()


class Evaluator:
  """Validation loss, perplexity and accuracy, and BLEU on a sample, every process on the same batches."""

  def __init__(self, run: Run, log: MetricsLog):
    self.run, self.log = run, log
    self.batches, self.sources, self.encoded, self.references = None, None, None, None  # built at the first evaluation

  def _translate(self, params, should_stop):
    s, run = self.run.settings, self.run
    if self.sources is None:
      pairs = list(parallel_text.python_pairs(s.data, 'eval'))[:s.loop.num_eval_bleu_sentences]
      self.sources, self.references = [p[0] for p in pairs], [p[1] for p in pairs]
      self.encoded = translator.encode_sentences(run.processor, self.sources)
    if jax.process_count() > 1:  # every process decodes the same sentences with the whole model
      from jax.experimental import multihost_utils
      params = multihost_utils.process_allgather(params, tiled=True)
    d = s.decode
    model = Translator(params, s.model, run.processor, beam_size=d.beam_size, alpha=d.length_penalty_alpha,
                       max_extra_length=d.max_extra_length, batch_tokens=d.eval_tokens_per_batch, top_k=d.beam_top_k)
    return model.translate(self.sources, encoded=self.encoded, should_stop=should_stop)

  def __call__(self, step: int, params, stop) -> dict:
    """The metrics at `step`; {} if SIGTERM/SIGINT arrives meanwhile (the loop then saves and exits)."""
    s, run, should_stop = self.run.settings, self.run, lambda: stop.received is not None
    if self.batches is None:
      dp_size = partitioning.data_parallel_size(run.mesh)
      self.batches = token_table.eval_batches(s.data, run.vocab_path, 'eval', dp_size)
    results = evaluation.evaluate_loss(run.eval_step, params, self.batches, run.eval_to_global, should_stop)
    if results is not None and s.loop.num_eval_bleu_sentences > 0:
      hypotheses = self._translate(params, should_stop)
      if hypotheses is None:
        results = None
      else:
        results['bleu'], _ = evaluation.bleu(hypotheses, self.references, s.decode.bleu_tokenize)
        if run.is_chief:  # the sample's translations, to read beside the score
          folder = run.workdir / TRANSLATIONS_DIR
          storage.within(s.loop.storage_timeout_seconds, f'writing the translations of step {step} to {folder}',
                         lambda: folder.mkdir(parents=True, exist_ok=True) or (folder / f'eval_{step}.txt').write_text(
                             ''.join(h + '\n' for h in hypotheses)))
    if results is None:
      print(f'evaluation at step {step} abandoned: {stop.received} received', flush=True)
      return {}
    self.log.scalars(step, results, 'eval')
    bleu = f' bleu {results["bleu"]:.2f}' if 'bleu' in results else ''
    self.log.say(f'eval step {step}: loss {results["loss"]:.4f} perplexity {results["perplexity"]:.2f} '
                 f'accuracy {results["accuracy"]:.4f}{bleu}')
    return results


class Progress:
  """Per-interval training metrics, the progress line and its ETA (evaluations included)."""

  def __init__(self, run: Run, log: MetricsLog):
    self.run, self.log = run, log
    self.tick, self.tick_step, self.start = time.perf_counter(), run.start_step, time.perf_counter()
    self.eval_seconds = []  # how long each evaluation took

  def report(self, step: int, fetched: list, losses) -> dict:
    loop, now = self.run.settings.loop, time.perf_counter()
    elapsed = now - self.tick
    metrics = {'loss': _finite_mean(losses), 'nll': _finite_mean([m['nll'] for m in fetched]),
               'accuracy': _finite_mean([m['accuracy'] for m in fetched]),
               'grad_norm': _finite_mean([m['grad_norm'] for m in fetched]),
               'learning_rate': float(self.run.learning_rate(step - 1)),
               'tokens_per_second': float(sum(m['tokens'] for m in fetched)) / elapsed,
               'steps_per_second': (step - self.tick_step) / elapsed,
               'dropped_too_long': self.run.train_iter.batching.dropped}
    self.log.scalars(step, metrics, 'train')
    self.log.step_losses(step, losses)
    evaluations_left = loop.num_train_steps // loop.eval_every_steps - step // loop.eval_every_steps
    eta = ((loop.num_train_steps - step) / max(metrics['steps_per_second'], 1e-9)
           + evaluations_left * (np.mean(self.eval_seconds) if self.eval_seconds else 0.0))
    self.log.say(f'step {step}/{loop.num_train_steps} loss {metrics["loss"]:.4f} lr {metrics["learning_rate"]:.2e} '
                 f'{metrics["tokens_per_second"]:,.0f} tok/s elapsed {_format_eta(now - self.start)} '
                 f'ETA {_format_eta(eta)}')
    self.tick, self.tick_step = now, step
    return metrics

  def evaluated(self, seconds: float) -> None:
    self.eval_seconds.append(seconds)
    self.tick = time.perf_counter()


def train_and_evaluate(config, workdir: str, devices=None) -> dict:
  """Trains (or resumes) the run in `workdir` on `devices` (default: all); returns the last metrics."""
  run = set_up(config, workdir, devices)
  timeout = run.settings.loop.storage_timeout_seconds
  log, saver = MetricsLog(run.workdir, run.is_chief, timeout), Saver(run.manager, run.workdir, timeout)
  stop = _StopSignal(multi_process=jax.process_count() > 1)
  failure = None
  try:
    return _train(run, log, saver, stop)
  except BaseException as error:
    failure = error
    raise
  finally:  # each closing write within the storage timeout; after the storage failed, only the lock is tried
    gone_quiet = isinstance(failure, (storage.StorageError, CheckpointSaveFailed))
    closing = (() if gone_quiet else (('the last checkpoint', saver.close), ('the metrics', log.close)))
    for what, close in closing + ((('the workdir lock', run.lock.release),) if run.lock else ()):
      try:
        storage.within(timeout, f'closing {what} in {run.workdir}', close)
      except Exception:
        if failure is None:
          raise
    stop.restore()  # last: a signal while the run winds down must not interrupt its closing writes


def _train(run: Run, log: MetricsLog, saver: Saver, stop: '_StopSignal') -> dict:
  """The loop: a step, then the hooks due after it. Their order is the loop's contract:

  1. `saver.check()` after every step: an asynchronous save that failed stops the run at the next step.
  2. `stop.check(step)` after every step on every process: the step the processes agreed to stop at must not
     be skipped, or the others wait forever in the next collective.
  3. The pending losses go through the LossGuard before this step's checkpoint: a run whose loss is lost
     never overwrites a good checkpoint.
  4. No checkpoint at a step whose loss is not finite (its skipped update left the state as it was).
  5. Evaluation after the checkpoint: a signal during evaluation abandons the evaluation, not the save.
  6. On a signal, a checkpoint at this step (unless rule 3's was just written), then the loop ends.
  7. After the loop, a non-finite last stretch is an error naming the last good checkpoint; the last
     save is awaited before returning.
  """
  loop, state = run.settings.loop, run.state
  guard = LossGuard(loop.max_skipped_steps, loop.loss_spike_factor, loop.loss_spike_steps,
                    verbose=run.is_chief, checkpoints=checkpointing.available_steps(run.workdir))
  evaluate, progress = Evaluator(run, log), Progress(run, log)
  pending, last_metrics, eval_results, compiled_shapes, step = [], {}, {}, set(), run.start_step
  while step < loop.num_train_steps:
    batch = run.to_global(next(run.train_iter))
    shape = (batch['inputs'].shape, batch['targets'].shape)
    if shape not in compiled_shapes:  # a new batch shape: compiled (or read from the cache) now
      compiled_shapes.add(shape)
      log.say(f'compiling the train step for batch shape {len(compiled_shapes)} of '
              f'{len(run.train_iter.batching.used_shapes)}: {shape[0][0]} x ({shape[0][1]} + {shape[1][1]}) tokens')
    state, metrics = run.train_step(state, batch, run.dropout_rng)
    pending.append(metrics)
    step += 1
    saver.check()
    last = step == loop.num_train_steps
    stop_now = stop.check(step)  # every step: the processes' agreed stop step must not be skipped
    checkpoint_due = step % loop.checkpoint_every_steps == 0 or last or stop_now
    if step % loop.log_every_steps == 0 or checkpoint_due:
      fetched = jax.device_get(pending)
      losses = np.array([m['loss'] for m in fetched])
      for i, loss in enumerate(losses):  # before this step's checkpoint: a lost run never overwrites one
        guard.update(step - len(fetched) + i + 1, float(loss))
      last_metrics, pending = progress.report(step, fetched, losses), []
    if checkpoint_due and guard.nonfinite:  # skipped updates leave the state as it was; a broken one stays broken
      print(f'no checkpoint at step {step}: its loss is not finite', flush=True)
    elif checkpoint_due:
      saver.save(step, state, run.train_iter.state())
      guard.saved(step)
    if step % loop.eval_every_steps == 0 or last:
      eval_start = time.perf_counter()
      eval_results = evaluate(step, state.params, stop)
      progress.evaluated(time.perf_counter() - eval_start)
    if stop.received:
      if not checkpoint_due:  # the signal arrived after this step's checks
        saver.save(step, state, run.train_iter.state())
      print(f'{stop.received} received: checkpoint saved at step {step}; exiting', flush=True)
      break
  if guard.nonfinite:
    raise TrainingDiverged(f'the training loss was not finite from step {guard.nonfinite[0]} to the last step; '
                           f'{guard.last_good(guard.nonfinite[0])}')
  saver.finish()
  return {'step': step, 'train': last_metrics, 'eval': eval_results}
