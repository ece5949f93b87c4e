"""Set-up of a training run: the config read once (settings.py), the cluster, the checks, the workdir's lock,
the mesh, the vocabulary, the train state (resumed from the newest good checkpoint), the data and the jitted
steps. `set_up` returns the Run (what was built, which never changes) and the starting train state, which the
loop carries from then on (the train step donates it).
"""

import dataclasses
import functools
from collections.abc import Callable

import jax
import numpy as np
import orbax.checkpoint as ocp
import sentencepiece as spm
from etils import epath

from flax_transformer import (checkpointing, cluster, finetuning, input_pipeline, optim, parallel_text, partitioning,
                              platforms, run_lock, settings, steps, storage, tensorflow_setup, tokenizer, train_state,
                              workdirs)
from flax_transformer.errors import WorkdirError
from flax_transformer.model import TransformerConfig
from flax_transformer.settings import Settings

VOCABULARY_TIMEOUT_SECONDS = 4 * 3600  # How long other processes wait for process 0 to train the vocabulary.


def data_seed(seed: int, start_step: int) -> int:
  """The data stream's seed: the run's, or for a stream restarted at `start_step` one derived from both
  (so a restart does not replay the first steps' batches)."""
  if start_step == 0:
    return seed
  return int(np.random.SeedSequence([seed, start_step]).generate_state(1)[0] % 2 ** 31)


@dataclasses.dataclass(frozen=True)
class Run:
  """What set-up built, for the loop and its hooks to read: one training run on one mesh. It never changes
  (the train state is the loop's: the step donates its buffers)."""
  settings: Settings
  workdir: epath.Path  # a local directory or a storage URL
  is_chief: bool
  mesh: jax.sharding.Mesh
  processor: spm.SentencePieceProcessor
  vocab_path: str
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


def _vocabulary(data: parallel_text.DataSettings, workdir: str, is_chief: bool):
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
  dp = partitioning.data_parallel_size(mesh)
  lines = [
      f'platform: {s.platform} ({devices[0].device_kind}), {devices.size} devices '
      f'({jax.local_device_count()} on this process); process {jax.process_index()} of {jax.process_count()}',
      f'cluster: {cluster_kind}',
      f'mesh: {" x ".join(f"{name}={size}" for name, size in mesh.shape.items())}',
      f'model: {num_params:,} parameters (float32), compute dtype {s.model.dtype}, attention '
      f'{s.model.attention}, dropout masks {s.model.dropout_masks}, '
      f'{"fused" if s.training.fused_output_loss else "optax"} output loss, beam top-k {s.decode.beam_top_k}',
      f'batch: {s.data.tokens_per_batch:,} tokens per side per step globally, {s.data.tokens_per_batch // dp:,} '
      f'per data-parallel device, {s.data.gradient_accumulation_steps} micro-batch(es); '
      f'{num_batch_shapes} batch shapes to compile',
  ]
  loop, chosen = s.training, []
  if s.optimizer.ema_decay:
    chosen.append(f'moving average of the weights (decay {s.optimizer.ema_decay:g}), evaluated beside them')
  if loop.keep_best:
    chosen.append(f'the {loop.keep_best} best checkpoints by validation {loop.best_metric} kept')
  if loop.early_stopping_evaluations:
    chosen.append(f'early stopping after {loop.early_stopping_evaluations} evaluations without improvement')
  if chosen:
    lines.append('selection: ' + '; '.join(chosen))
  return '\n'.join(lines)


def set_up(config, workdir: str, devices=None) -> tuple[Run, train_state.TrainState]:
  """The run config read once (settings.py), the cluster, checks, the workdir's lock, mesh, vocabulary,
  train state (resumed if the workdir has a checkpoint), data and jitted steps: (the Run, the starting state)."""
  platforms.enable_compilation_cache()
  tensorflow_setup.import_quietly()
  settings.check(config)  # every field, before any process starts
  cluster_kind = cluster.start(settings.cluster_settings(config)).kind  # before JAX's backend is touched
  cluster.watch_peers(settings.cluster_settings(config))
  cluster.check_same('config', settings.comparable(config))  # the processes run one config
  s = settings.resolve(config, checked=True)  # the 'auto' choices, for the platform JAX now runs on
  platforms.check(s.training.platform)
  is_chief, workdir = jax.process_index() == 0, storage.path(workdir)
  storage.check_reachable(workdir, '--workdir')
  for split in ('train', 'eval'):  # what the run reads, before anything is written or compiled
    parallel_text.check_split(s.data, split)
  origin = finetuning.source(s.training.init_from, s.model, s.data.vocab_path)
  workdirs.check_inputs(workdir, s.data, origin.workdir if origin else '')
  workdirs.check(workdir, s)
  mesh = partitioning.create_mesh(s.training.mesh_shape, devices)
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
    return _build(settings.to_json(config), s, workdir, mesh, shard, is_chief, lock, cluster_kind, origin)
  except BaseException:
    if lock is not None:
      lock.release()
    raise


def _build(config_json: str, s: Settings, workdir, mesh, shard, is_chief, lock, cluster_kind, origin):
  """set_up's part after the workdir is locked; `origin`: the run to fine-tune from (finetuning.source)."""
  if origin and is_chief:
    finetuning.copy_vocabulary(origin, s.data.vocab_path, workdir)
  processor, vocab_path = _vocabulary(s.data, workdir, is_chief)
  if is_chief:  # once the data and vocabulary are known to work: a failed start leaves no config behind
    workdirs.write_config(workdir, config_json)
  init_rng, dropout_rng = jax.random.split(jax.random.key(s.training.seed, impl=s.training.dropout_rng_impl))
  state, state_shardings = train_state.create_train_state(s.model, s.optimizer, mesh, init_rng)
  manager = checkpointing.create_manager(workdir, s.training.keep_checkpoints, keep_best=s.training.keep_best,
                                         best_metric=s.training.best_metric)
  state, data_state = _resume(s.training.restore_data_state, workdir, state, state_shardings, manager)
  start_step = int(jax.device_get(state.step))
  if origin and start_step == 0:  # a fine-tuning run's first start: the source's parameters, a fresh optimizer
    state = finetuning.initial_params(origin, state, state_shardings)
    print(f'parameters from {origin.workdir} step {origin.step}; optimizer and schedule start at step 0', flush=True)
  train_iter = input_pipeline.process_train_batches(s.data, vocab_path, workdir, shard.blocks, shard.data_parallel,
                                                    data_seed(s.training.seed, start_step), data_state)
  if is_chief:
    num_params = sum(x.size for x in jax.tree_util.tree_leaves(state.params))
    print(banner(s, mesh, num_params, len(train_iter.batching.used_shapes), cluster_kind), flush=True)
  train, evaluate = steps.for_run(s)
  train_step = partitioning.jit_train_step(train, mesh, state_shardings)
  eval_step = partitioning.jit_eval_step(evaluate, mesh, state_shardings.params)
  run = Run(settings=s, workdir=workdir, is_chief=is_chief, mesh=mesh, processor=processor, vocab_path=vocab_path,
            state_shardings=state_shardings, manager=manager, start_step=start_step, train_iter=train_iter,
            train_step=train_step, eval_step=eval_step, learning_rate=optim.learning_rate(s.optimizer, s.model.d_model),
            dropout_rng=dropout_rng, data_shard=shard, lock=lock)
  return run, state
