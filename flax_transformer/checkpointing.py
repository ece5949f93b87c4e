"""Orbax checkpoints: save/restore the train state, restore parameters alone onto any mesh, average.

Layout of a workdir:
  checkpoints/<step>/{params,opt_state,data}   Orbax items, committed together (written to a temporary
                                                name, then renamed: a crash never leaves a half-written
                                                checkpoint); data/process_<i>.json is process i's
                                                data-iterator state at that step (exact resume)
  config.json, sentencepiece.model             the run's configuration and vocabulary
"""

import dataclasses
import json

import jax
import numpy as np
import orbax.checkpoint as ocp

from flax_transformer import storage
from flax_transformer.errors import UserError, WorkdirError

CHECKPOINT_DIR = 'checkpoints'
CONFIG_FILENAME = 'config.json'
# config.model fields a resumed run may change: regularisation and how the same network is computed.
COMPUTE_CHOICES = ('dropout_rate', 'attention_dropout_rate', 'dropout_masks', 'attention', 'dtype', 'scan_unroll')


def checkpoint_dir(workdir: str):
  return storage.path(workdir) / CHECKPOINT_DIR


def create_manager(workdir: str, keep: int, asynchronous: bool = True) -> ocp.CheckpointManager:
  options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                         enable_async_checkpointing=asynchronous)
  return ocp.CheckpointManager(checkpoint_dir(workdir), options=options)


class DataStateMismatch(UserError):
  """A checkpoint's data-iterator state that does not fit this run's processes."""


class DataStateHandler(ocp.CheckpointHandler):
  """Orbax handler of the `data` item: each process writes and reads its own `process_<i>.json`."""

  def save(self, directory, args: 'DataStateSave'):
    state = {**args.state, 'process_count': jax.process_count()}
    (directory / f'process_{jax.process_index()}.json').write_text(json.dumps(state))

  def restore(self, directory, args: 'DataStateRestore' = None) -> dict:
    count = len(list(directory.glob('process_*.json')))
    if count != jax.process_count():
      raise DataStateMismatch(f'checkpoint {directory.parent.name} holds the data-iterator state of {count} '
                              f'processes but this run has {jax.process_count()}; rerun with '
                              f'--config.restore_data_state=false to restart the data stream')
    return json.loads((directory / f'process_{jax.process_index()}.json').read_text())


@ocp.args.register_with_handler(DataStateHandler, for_save=True)
@dataclasses.dataclass
class DataStateSave(ocp.args.CheckpointArgs):
  state: dict


@ocp.args.register_with_handler(DataStateHandler, for_restore=True)
@dataclasses.dataclass
class DataStateRestore(ocp.args.CheckpointArgs):
  pass


def save_state(manager: ocp.CheckpointManager, state, data_state: dict | None = None) -> None:
  """Starts an (asynchronous) save of parameters, optimizer state and this process's data state at
  `state.step`; they commit as one checkpoint."""
  step = int(jax.device_get(state.step))
  items = {'params': ocp.args.StandardSave(state.params), 'opt_state': ocp.args.StandardSave(state.opt_state)}
  if data_state is not None:
    items['data'] = DataStateSave(data_state)
  manager.save(step, args=ocp.args.Composite(**items))


def restore_data_state(manager: ocp.CheckpointManager, step: int) -> dict | None:
  """This process's data-iterator state saved with checkpoint `step`, or None if it has none."""
  if not (storage.path(manager.directory) / str(step) / 'data').is_dir():
    return None
  return manager.restore(step, args=ocp.args.Composite(data=DataStateRestore()))['data']


def _abstract(tree, shardings):
  return jax.tree_util.tree_map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def restore_state(manager: ocp.CheckpointManager, step: int, state, state_shardings):
  """The train state at `step`, laid out like `state` (which is only used for shapes and shardings)."""
  restored = manager.restore(step, args=ocp.args.Composite(
      params=ocp.args.StandardRestore(_abstract(state.params, state_shardings.params)),
      opt_state=ocp.args.StandardRestore(_abstract(state.opt_state, state_shardings.opt_state))))
  return state.replace(step=jax.device_put(np.asarray(step, np.int32), state_shardings.step),
                       params=restored['params'], opt_state=restored['opt_state'])


class CheckpointDamaged(UserError):
  """The latest checkpoint cannot be restored and cannot be set aside automatically."""


def restore_latest(manager: ocp.CheckpointManager, state, state_shardings, with_data_state: bool = True):
  """(state, data state or None, step) of the newest checkpoint that restores; (state, None, None) if none.

  A checkpoint that fails to restore (a truncated array file, a missing item, a damaged data state) is
  reported in one line and moved aside to `checkpoints/<step>.corrupt`, never deleted; the next older one
  is tried. With several processes the damaged one is named instead (they could disagree on it).
  """
  while (step := manager.latest_step()) is not None:
    try:
      restored = restore_state(manager, step, state, state_shardings)
      data_state = restore_data_state(manager, step) if with_data_state else None
      return restored, data_state, step
    except UserError:
      raise
    except Exception as error:  # whatever a damaged file raises: ValueError, KeyError, IndexError, OSError...
      path = storage.path(manager.directory) / str(step)
      reason = f'{type(error).__name__}: {(str(error).splitlines() or [""])[0][:160]}'
      if jax.process_count() > 1:
        raise CheckpointDamaged(f'checkpoint {path} cannot be restored ({reason}); move it aside (mv {path} '
                                f'{path}.corrupt) and rerun to resume from the one before') from None
      path.rename(f'{path}.corrupt')
      print(f'checkpoint {step} cannot be restored ({reason}); moved to {path}.corrupt, trying the one before',
            flush=True)
      manager.reload()
  return state, None, None


def _checkpoints_folder(directory: str):
  """The checkpoints/ folder of `directory` (a workdir or that folder), absolute (Orbax takes no other)."""
  directory = storage.path(directory)
  return directory if directory.name == CHECKPOINT_DIR else directory / CHECKPOINT_DIR


def available_steps(directory: str) -> list[int]:
  """Steps of the finished checkpoints under `directory` (a workdir or its checkpoints/ folder)."""
  directory = _checkpoints_folder(directory)
  if not directory.is_dir():
    return []
  return sorted(ocp.utils.checkpoint_steps(directory))


def restore_params(directory: str, step: int, abstract_params, shardings=None):
  """Parameters alone (no optimizer state is read) of checkpoint `step`, placed with `shardings`.

  `abstract_params`: a tree of arrays or ShapeDtypeStructs giving shapes; `shardings` defaults to
  replication over all local devices.
  """
  directory = _checkpoints_folder(directory)
  if shardings is None:
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ('replica',))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    shardings = jax.tree_util.tree_map(lambda _: replicated, abstract_params)
  with ocp.CheckpointManager(directory) as manager:
    restored = manager.restore(step, args=ocp.args.Composite(
        params=ocp.args.StandardRestore(_abstract(abstract_params, shardings))))
  return restored['params']


def average_params(params_list):
  """Element-wise mean of parameter trees (§6.1 checkpoint averaging), accumulated in float32."""
  total = jax.tree_util.tree_map(lambda x: np.asarray(x, np.float32), params_list[0])
  for params in params_list[1:]:
    total = jax.tree_util.tree_map(lambda a, b: a + np.asarray(b, np.float32), total, params)
  return jax.tree_util.tree_map(lambda x: x / len(params_list), total)


def save_params(directory: str, step: int, params) -> None:
  """Writes parameters as a one-item Orbax checkpoint at `directory/<step>` (e.g. an averaged model)."""
  options = ocp.CheckpointManagerOptions(create=True)
  with ocp.CheckpointManager(storage.path(directory), options=options) as manager:
    manager.save(step, args=ocp.args.Composite(params=ocp.args.StandardSave(params)))
    manager.wait_until_finished()


# --- Run configuration -------------------------------------------------------

def check_workdir(workdir: str, config) -> None:
  """Refuses a workdir that cannot be written or that holds a run of a different model or vocabulary."""
  try:  # one probe per process: the processes of a multi-host run check the same (shared) workdir at once
    storage.check_writable(workdir, 'workdir', 'choose another --workdir')
  except storage.StorageError as error:
    raise WorkdirError(str(error)) from None
  path = storage.path(workdir) / CONFIG_FILENAME
  if not path.exists():
    return
  saved = _read_json(path)
  current = json.loads(config.to_json())
  for key in sorted(set(saved.get('model', {})) | set(current['model'])):
    if saved.get('model', {}).get(key) != current['model'].get(key) and key not in COMPUTE_CHOICES:
      raise WorkdirError(f'workdir {workdir} holds a run with model.{key}={saved["model"].get(key)!r} but this config '
                         f'has {current["model"].get(key)!r}; use a new --workdir (the existing run is left untouched)')
  for key in ('vocab_path', 'vocab_type', 'source_lang', 'target_lang'):
    if saved.get(key) != current.get(key):
      raise WorkdirError(f'workdir {workdir} holds a run with {key}={saved.get(key)!r} but this config has '
                         f'{current.get(key)!r}; use a new --workdir (the existing run is left untouched)')


def write_config(workdir: str, config) -> None:
  storage.write_atomic(storage.path(workdir) / CONFIG_FILENAME, config.to_json_best_effort(indent=2))


def read_config(workdir: str):
  """The ConfigDict a run saved in its workdir."""
  import ml_collections
  path = storage.path(workdir) / CONFIG_FILENAME
  if not path.exists():
    raise WorkdirError(f'{workdir} has no {CONFIG_FILENAME}; point --workdir at a directory written by train.py')
  return ml_collections.ConfigDict(_read_json(path))


def _read_json(path) -> dict:
  try:
    return json.loads(path.read_text())
  except json.JSONDecodeError as error:
    raise WorkdirError(f'{path} is damaged ({error.msg} at line {error.lineno}); restore it from a copy, or '
                       f'rewrite it with the run\'s config (train.py writes it at start-up)') from None
