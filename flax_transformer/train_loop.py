"""`train_and_evaluate(config, workdir)`: the loop only orchestrates batches, the pure step and hooks.

Hooks: progress line and TensorBoard every `log_every_steps`, validation loss/perplexity/accuracy and
BLEU on a validation sample every `eval_every_steps`, an Orbax checkpoint (with each process's
data-iterator state) every `checkpoint_every_steps`, on the last step and on SIGTERM/SIGINT. A NaN/Inf
loss stops the run before the next checkpoint is written, so the last good one stays untouched.
"""

import collections
import functools
import json
import os
import signal
import time

import jax
import numpy as np
import tensorflow as tf

from flax_transformer import (checkpointing, evaluation, input_pipeline, optim, partitioning, platforms, steps,
                              tokenizer)
from flax_transformer.errors import ConfigError, UserError
from flax_transformer.model import TransformerConfig

METRICS_FILENAME = 'train_metrics.jsonl'
TRANSLATIONS_DIR = 'translations'  # translations/eval_<step>.txt: the BLEU sample's translations
VOCABULARY_TIMEOUT_SECONDS = 4 * 3600  # How long other processes wait for process 0 to train the vocabulary.


class TrainingDiverged(UserError):
  """The loss became NaN or Inf."""


class CheckpointSaveFailed(UserError):
  """A checkpoint could not be written (disk full, permissions...)."""


def maybe_initialize_distributed(config) -> None:
  """jax.distributed for multi-process runs: explicit config values, else detected from the environment."""
  if jax.distributed.is_initialized():  # (asking jax.process_count() here would start the backend too early)
    return
  address = config.get('coordinator_address', '')
  if address:
    jax.config.update('jax_cpu_collectives_implementation', 'gloo')  # CPU-only clusters and tests
    jax.distributed.initialize(coordinator_address=address, num_processes=config.num_processes,
                               process_id=config.process_id)
  elif any(k in os.environ for k in ('SLURM_NTASKS', 'TPU_WORKER_HOSTNAMES', 'MEGASCALE_COORDINATOR_ADDRESS')):
    if int(os.environ.get('SLURM_NTASKS', '1')) > 1 or 'TPU_WORKER_HOSTNAMES' in os.environ:
      jax.distributed.initialize()


def check_config(config) -> None:
  for field in ('num_train_steps', 'checkpoint_every_steps', 'eval_every_steps', 'log_every_steps',
                'keep_checkpoints', 'gradient_accumulation_steps', 'tokens_per_batch'):
    value = config[field]
    if not isinstance(value, int) or value < 1:
      raise ConfigError(f'config.{field}={value!r}: must be a positive integer')
  if not isinstance(config.cooldown_steps, int) or not 0 <= config.cooldown_steps <= config.num_train_steps:
    raise ConfigError(f'config.cooldown_steps={config.cooldown_steps!r}: must be an integer from 0 (no cooldown) '
                      f'to config.num_train_steps={config.num_train_steps}')
  if config.get('lr_decay', 'inverse_sqrt') not in optim.LR_DECAYS:
    raise ConfigError(f'config.lr_decay={config.lr_decay!r}: must be one of {", ".join(optim.LR_DECAYS)}')
  if config.keep_checkpoints < config.average_last:
    raise ConfigError(f'config.keep_checkpoints={config.keep_checkpoints} is below config.average_last='
                      f'{config.average_last}; keep at least as many checkpoints as are averaged')


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
    if self.multi_process:
      os.kill(os.getpid(), signal.SIGTERM)  # to the preemption service, which tells every process
    else:
      self.received = signal.Signals(signum).name

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

  def __init__(self, max_skipped: int, factor: float, patience: int, window: int = 200, verbose: bool = True):
    self.max_skipped, self.factor, self.patience, self.verbose = max_skipped, factor, patience, verbose
    self.history = collections.deque(maxlen=window)
    self.nonfinite, self.high = [], []  # steps of the current runs of non-finite and of too-high losses
    self.checkpoints = []

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


def train_and_evaluate(config, workdir: str, devices=None) -> dict:
  """Trains (or resumes) the run in `workdir` on `devices` (default: all); returns the last metrics."""
  enable_compilation_cache()
  platforms.import_tensorflow_quietly()
  maybe_initialize_distributed(config)
  platforms.check(config.platform)
  check_config(config)
  model_config = TransformerConfig.from_config(config)
  fused_output_loss = platforms.fused_output_loss(config.output_loss)
  is_chief = jax.process_index() == 0
  workdir = os.path.abspath(workdir)
  checkpointing.check_workdir(workdir, config)
  mesh = partitioning.create_mesh(config.mesh_shape, devices)
  partitioning.check_model_fits_mesh(model_config, mesh)
  dp_size = partitioning.data_parallel_size(mesh)

  # Vocabulary: trained once by process 0 into the workdir, then read by everyone.
  if is_chief:
    _, vocab_path = tokenizer.train_or_load(config, workdir, lambda: input_pipeline.python_pairs(config))
  if jax.process_count() > 1:  # a coordination-service barrier: a device collective on CPU gives up after 30 s
    from orbax.checkpoint import multihost
    multihost.get_barrier_sync_fn()(key='vocabulary', timeout_ms=VOCABULARY_TIMEOUT_SECONDS * 1000)
  processor, vocab_path = tokenizer.train_or_load(config, workdir, None)
  if is_chief:
    checkpointing.write_config(workdir, config)

  rng = jax.random.key(config.seed, impl=config.dropout_rng_impl)
  init_rng, dropout_rng = jax.random.split(rng)
  state, state_shardings = partitioning.create_train_state(config, model_config, mesh, init_rng)
  manager = checkpointing.create_manager(workdir, config.keep_checkpoints)

  state, data_state, start_step = checkpointing.restore_latest(manager, state, state_shardings,
                                                               config.restore_data_state)
  if start_step is not None:
    if data_state is None:
      print(f'the data stream restarts at step {start_step} with a seed derived from it', flush=True)
    print(f'resumed from step {start_step} in {workdir}', flush=True)
  start_step = int(jax.device_get(state.step))
  shard = partitioning.data_shard(mesh)
  train_iter = input_pipeline.process_train_batches(config, vocab_path, shard, dp_size,
                                                    data_seed(config.seed, start_step), data_state)

  if is_chief:
    num_params = sum(x.size for x in jax.tree_util.tree_leaves(state.params))
    print(platforms.banner(config, model_config, mesh, num_params, len(train_iter.plan.used_shapes),
                           fused_output_loss), flush=True)
  _, schedule = optim.create_optimizer(config, model_config.d_model)
  train_step = partitioning.jit_train_step(
      functools.partial(steps.train_step, model_config=model_config, label_smoothing=config.label_smoothing,
                        gradient_accumulation_steps=config.gradient_accumulation_steps,
                        fused_output_loss=fused_output_loss), mesh, state_shardings)
  eval_step = partitioning.jit_eval_step(
      functools.partial(steps.eval_step, model_config=model_config, label_smoothing=config.label_smoothing),
      mesh, state_shardings.params)
  batch_sharding = partitioning.batch_sharding(mesh)

  def to_global(batch):  # this process's rows of a training batch -> the global batch
    return {k: jax.make_array_from_process_local_data(batch_sharding, v, (v.shape[0] * shard[1], *v.shape[1:]))
            for k, v in batch.items()}

  def eval_to_global(batch):  # every process holds the whole evaluation batch
    return {k: jax.make_array_from_callback(v.shape, batch_sharding, lambda index, v=v: v[index])
            for k, v in batch.items()}

  writer = tf.summary.create_file_writer(os.path.join(workdir, 'tensorboard')) if is_chief else None
  metrics_file = open(os.path.join(workdir, METRICS_FILENAME), 'a') if is_chief else None

  def log_scalars(step, scalars, prefix):
    if not is_chief:
      return
    with writer.as_default(step=step):
      for name, value in scalars.items():
        tf.summary.scalar(f'{prefix}/{name}', value)
    writer.flush()
    metrics_file.write(json.dumps({'step': step, 'split': prefix, **scalars}) + '\n')
    metrics_file.flush()

  saving = {'step': None, 'failed': False}  # the asynchronous save in flight, and whether one failed

  def save_failed(step, error):
    saving['failed'] = True  # Orbax's threads may wait forever now: the run exits without closing them
    return CheckpointSaveFailed(f'saving the checkpoint at step {step} in {workdir} failed '
                                f'({type(error).__name__}: {str(error).splitlines()[0][:200]}); the run stopped '
                                f'and earlier checkpoints are intact')

  def check_saves():
    """Reports a failed asynchronous save at the first step after it failed, naming its step."""
    if saving['step'] is not None:
      try:
        manager.check_for_errors()
      except Exception as error:  # disk full, permission denied...
        raise save_failed(saving['step'], error) from None

  def save(step):
    try:
      manager.wait_until_finished()
    except Exception as error:
      raise save_failed(saving['step'], error) from None
    try:
      checkpointing.save_state(manager, state, train_iter.state())
    except Exception as error:
      raise save_failed(step, error) from None
    saving['step'] = step

  eval_sources, eval_references, eval_dataset = None, None, None

  def evaluate(step):
    """Validation metrics at `step`; {} if SIGTERM/SIGINT arrives meanwhile (the loop then saves and exits)."""
    nonlocal eval_sources, eval_references, eval_dataset
    stopping = lambda: stop.received is not None
    if eval_dataset is None:  # tokenised and batched once, the same batches on every process
      eval_dataset = input_pipeline.eval_batches(config, vocab_path, 'eval', dp_size)
    results = evaluation.evaluate_loss(eval_step, state.params, eval_dataset, eval_to_global,
                                       should_stop=stopping)
    if results is not None and config.num_eval_bleu_sentences > 0:
      if eval_sources is None:
        pairs = list(input_pipeline.python_pairs(config, 'eval'))[:config.num_eval_bleu_sentences]
        eval_sources, eval_references = [p[0] for p in pairs], [p[1] for p in pairs]
      params = state.params
      if jax.process_count() > 1:  # every process decodes the same sentences with the whole model
        from jax.experimental import multihost_utils
        params = multihost_utils.process_allgather(params, tiled=True)
      hypotheses = evaluation.translate_sentences(params, model_config, processor, eval_sources,
                                                  beam_size=config.beam_size, alpha=config.length_penalty_alpha,
                                                  max_extra_length=config.max_extra_length,
                                                  batch_tokens=config.eval_tokens_per_batch,
                                                  should_stop=stopping, top_k=config.beam_top_k)
      if hypotheses is None:
        results = None
      else:
        results['bleu'], _ = evaluation.bleu(hypotheses, eval_references, config.get('bleu_tokenize', '13a'))
        if is_chief:  # the sample's translations, to read beside the score
          tf.io.gfile.makedirs(os.path.join(workdir, TRANSLATIONS_DIR))
          with tf.io.gfile.GFile(os.path.join(workdir, TRANSLATIONS_DIR, f'eval_{step}.txt'), 'w') as f:
            f.write(''.join(h + '\n' for h in hypotheses))
    if results is None:
      print(f'evaluation at step {step} abandoned: {stop.received} received', flush=True)
      return {}
    log_scalars(step, results, 'eval')
    if is_chief:
      bleu = f' bleu {results["bleu"]:.2f}' if 'bleu' in results else ''
      print(f'eval step {step}: loss {results["loss"]:.4f} perplexity {results["perplexity"]:.2f} '
            f'accuracy {results["accuracy"]:.4f}{bleu}', flush=True)
    return results

  stop = _StopSignal(multi_process=jax.process_count() > 1)
  guard = LossGuard(config.max_skipped_steps, config.loss_spike_factor, config.loss_spike_steps, verbose=is_chief)
  guard.checkpoints = checkpointing.available_steps(workdir)
  pending, last_metrics, eval_results = [], {}, {}
  compiled_shapes, eval_seconds = set(), []  # batch shapes seen; how long each evaluation took (for the ETA)
  tick, tick_step, run_start = time.perf_counter(), start_step, time.perf_counter()
  step = start_step
  try:
    while step < config.num_train_steps:
      batch = to_global(next(train_iter))
      shape = (batch['inputs'].shape, batch['targets'].shape)
      if shape not in compiled_shapes:  # a new batch shape: compiled (or read from the cache) now
        compiled_shapes.add(shape)
        if is_chief:
          print(f'compiling the train step for batch shape {len(compiled_shapes)} of '
                f'{len(train_iter.plan.used_shapes)}: {shape[0][0]} x ({shape[0][1]} + {shape[1][1]}) tokens',
                flush=True)
      state, metrics = train_step(state, batch, dropout_rng)
      pending.append(metrics)
      step += 1
      check_saves()
      last = step == config.num_train_steps
      stop_now = stop.check(step)  # every step: the processes' agreed stop step must not be skipped
      checkpoint_due = step % config.checkpoint_every_steps == 0 or last or stop_now
      if step % config.log_every_steps == 0 or checkpoint_due:
        fetched = jax.device_get(pending)
        losses = np.array([m['loss'] for m in fetched])
        for i, loss in enumerate(losses):  # before this step's checkpoint: a lost run never overwrites one
          guard.update(step - len(fetched) + i + 1, float(loss))
        now = time.perf_counter()
        tokens = float(sum(m['tokens'] for m in fetched))
        elapsed = now - tick
        last_metrics = {'loss': _finite_mean(losses), 'nll': _finite_mean([m['nll'] for m in fetched]),
                        'accuracy': _finite_mean([m['accuracy'] for m in fetched]),
                        'grad_norm': _finite_mean([m['grad_norm'] for m in fetched]),
                        'learning_rate': float(schedule(step - 1)), 'tokens_per_second': tokens / elapsed,
                        'steps_per_second': (step - tick_step) / elapsed,
                        'dropped_too_long': train_iter.plan.dropped}
        log_scalars(step, last_metrics, 'train')
        if is_chief:  # every step's loss, exactly (json floats round-trip), for resume checks and plots
          metrics_file.write(json.dumps({'step': step, 'split': 'train_steps',
                                         'losses': [float(x) for x in losses]}) + '\n')
        if is_chief:
          evaluations_left = config.num_train_steps // config.eval_every_steps - step // config.eval_every_steps
          eta = ((config.num_train_steps - step) / max(last_metrics['steps_per_second'], 1e-9)
                 + evaluations_left * (np.mean(eval_seconds) if eval_seconds else 0.0))
          print(f'step {step}/{config.num_train_steps} loss {last_metrics["loss"]:.4f} '
                f'lr {last_metrics["learning_rate"]:.2e} {last_metrics["tokens_per_second"]:,.0f} tok/s '
                f'elapsed {_format_eta(now - run_start)} ETA {_format_eta(eta)}', flush=True)
        pending, tick, tick_step = [], now, step
      if checkpoint_due and guard.nonfinite:  # skipped updates leave the state as it was; a broken one stays broken
        print(f'no checkpoint at step {step}: its loss is not finite', flush=True)
      elif checkpoint_due:
        save(step)
        guard.saved(step)
      if step % config.eval_every_steps == 0 or last:
        eval_start = time.perf_counter()
        eval_results = evaluate(step)
        tick = time.perf_counter()
        eval_seconds.append(tick - eval_start)
      if stop.received:
        if not checkpoint_due:  # the signal arrived after this step's checks
          save(step)
        print(f'{stop.received} received: checkpoint saved at step {step}; exiting', flush=True)
        break
    if guard.nonfinite:
      raise TrainingDiverged(f'the training loss was not finite from step {guard.nonfinite[0]} to the last step; '
                             f'{guard.last_good(guard.nonfinite[0])}')
    try:
      manager.wait_until_finished()
    except Exception as error:
      raise save_failed(saving['step'], error) from None
  finally:
    stop.restore()
    if not saving['failed']:
      manager.close()
    if metrics_file:
      metrics_file.close()
  return {'step': step, 'train': last_metrics, 'eval': eval_results}
