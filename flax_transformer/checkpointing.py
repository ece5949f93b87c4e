"""Orbax checkpoints: save/restore the train state, restore parameters alone onto any mesh (averaging is weights.py's).

Layout of a workdir:
  checkpoints/<step>/   Orbax items, committed together (written to a temporary name, then renamed: a crash
                        never leaves a half-written checkpoint):
    params, opt_state   the train state
    ema                 the weights' moving average (config.ema_decay > 0)
    data                data/process_<i>.json: process i's data-iterator state at that step (exact resume)
    metrics             the validation metrics the best checkpoints are kept by (config.keep_best > 0)
  config.json, sentencepiece.model   the run's configuration and vocabulary (workdirs.py)
"""

import dataclasses
import json
import os
import re
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp

from flax_transformer import cluster, storage
from flax_transformer.errors import UserError

CHECKPOINT_DIR = 'checkpoints'
EMA = 'ema'  # the item holding the weights' moving average (config.ema_decay > 0)
METRICS_ITEM = 'metrics'  # where Orbax keeps a checkpoint's metrics: <step>/metrics/metrics
HIGHER_IS_BETTER = ('bleu',)  # validation metrics where a higher value is better (loss: lower)


def checkpoints_folder(directory: str, or_itself: bool = False):
  """The checkpoints/ folder of the workdir `directory`; with `or_itself` (programs that read checkpoints)
  `directory` may be that folder itself. Absolute: Orbax takes no other."""
  directory = storage.path(directory)
  return directory if or_itself and directory.name == CHECKPOINT_DIR else directory / CHECKPOINT_DIR


def create_manager(workdir: str, keep: int, asynchronous: bool = True, keep_best: int = 0,
                   best_metric: str = 'bleu') -> ocp.CheckpointManager:
  """The run's checkpoints: the newest `keep`, and with `keep_best` > 0 also the `keep_best` best by the
  validation metric `best_metric` ('bleu': higher is better; 'loss': lower) given to each save (Orbax's own
  preservation policies; the metrics are stored with each checkpoint, so a resumed run keeps its best)."""
  retention = {'max_to_keep': keep}
  if keep_best:
    higher = best_metric in HIGHER_IS_BETTER
    rank = lambda metrics: metrics[best_metric]
    retention = {'best_fn': rank, 'best_mode': 'max' if higher else 'min',
                 'preservation_policy': ocp.checkpoint_managers.AnyPreservationPolicy([
                     ocp.checkpoint_managers.LatestN(keep),
                     ocp.checkpoint_managers.BestN(get_metric_fn=rank, reverse=not higher, n=keep_best,
                                                   keep_checkpoints_without_metrics=False)])}
    _quiet_unranked_saves()
  options = ocp.CheckpointManagerOptions(
      create=True, enable_async_checkpointing=asynchronous, **retention,
      # The step's folder is made before save() returns, so a folder that cannot be made fails that call at
      # once (made in the background, it fails in a thread the run then waits 300 s for).
      async_options=ocp.AsyncOptions(create_directories_asynchronously=False))
  return ocp.CheckpointManager(checkpoints_folder(workdir), options=options)


def _quiet_unranked_saves() -> None:
  """Orbax warns at every save without metrics once checkpoints are ranked; between evaluations that is the rule."""
  import logging
  logger = logging.getLogger('absl')
  if not any(getattr(f, 'unranked', False) for f in logger.filters):
    quiet = logging.Filter()
    quiet.filter, quiet.unranked = lambda record: 'did not provide metrics' not in record.getMessage(), True
    logger.addFilter(quiet)


class DataStateMismatch(UserError):
  """A checkpoint's data-iterator state that does not fit this run's processes."""


class DataStateHandler(ocp.CheckpointHandler):
  """Orbax handler of the `data` item: each process writes its own `process_<i>.json` (the global stream's
  state, the same on every process) and reads its own, or process 0's when the run had fewer processes."""

  def save(self, directory, args: 'DataStateSave'):
    state = {**args.state, 'process_count': jax.process_count()}
    (directory / f'process_{jax.process_index()}.json').write_text(json.dumps(state))

  def restore(self, directory, args: 'DataStateRestore' = None) -> dict:
    own = directory / f'process_{jax.process_index()}.json'
    state = json.loads((own if own.exists() else directory / 'process_0.json').read_text())
    if 'shard' in state and state.get('process_count', 1) != jax.process_count():
      raise DataStateMismatch(f'checkpoint {directory.parent.name} holds the per-process data state of '
                              f'{state.get("process_count")} processes of an earlier version, but this run has '
                              f'{jax.process_count()}; rerun with --config.restore_data_state=false to restart '
                              f'the data stream')
    state.pop('process_count', None)
    return state


@ocp.args.register_with_handler(DataStateHandler, for_save=True)
@dataclasses.dataclass
class DataStateSave(ocp.args.CheckpointArgs):
  state: dict


@ocp.args.register_with_handler(DataStateHandler, for_restore=True)
@dataclasses.dataclass
class DataStateRestore(ocp.args.CheckpointArgs):
  pass


def save_state(manager: ocp.CheckpointManager, state, data_state: dict | None = None,
               metrics: dict | None = None) -> None:
  """Starts an (asynchronous) save of parameters, optimizer state, the weights' moving average (if the state
  has one) and this process's data state at `state.step`; they commit as one checkpoint. `metrics`: the
  validation metrics a best-checkpoint policy ranks it by (create_manager)."""
  step = int(jax.device_get(state.step))
  items = {'params': ocp.args.StandardSave(state.params), 'opt_state': ocp.args.StandardSave(state.opt_state)}
  if state.ema_params is not None:
    items[EMA] = ocp.args.StandardSave(state.ema_params)
  if data_state is not None:
    items['data'] = DataStateSave(data_state)
  manager.save(step, args=ocp.args.Composite(**items), metrics=metrics)


def restore_data_state(manager: ocp.CheckpointManager, step: int) -> dict | None:
  """This process's data-iterator state saved with checkpoint `step`, or None if it has none. Read without
  Orbax (whose restore ends in a barrier): each process reads its own file, and a damaged one is met by that
  process alone."""
  directory = storage.path(manager.directory) / str(step) / 'data'
  if not directory.is_dir():
    return None
  return DataStateHandler().restore(directory)


def _restore(manager: ocp.CheckpointManager, step: int, args):
  """manager.restore, except that a process whose read fails still joins the barrier that ends Orbax's
  restore, where the other processes wait for it; then the processes can agree on what happened."""
  try:
    return manager.restore(step, args=args)
  except Exception:
    if jax.process_count() > 1:
      from orbax.checkpoint._src.multihost import multihost
      multihost.sync_global_processes(multihost.unique_barrier_key('Checkpointer:restore'))
    raise


def abstract(tree, shardings):
  """`tree`'s shapes and dtypes as ShapeDtypeStructs carrying `shardings`: what Orbax restores into."""
  return jax.tree_util.tree_map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def restore_state(manager: ocp.CheckpointManager, step: int, state, state_shardings):
  """The train state at `step`, laid out like `state` (which is only used for shapes and shardings). A state
  with a moving average of the weights takes the checkpoint's, or, from a checkpoint saved without one (the run
  turned config.ema_decay on), starts it at the restored parameters."""
  items = {'params': ocp.args.StandardRestore(abstract(state.params, state_shardings.params)),
           'opt_state': ocp.args.StandardRestore(abstract(state.opt_state, state_shardings.opt_state))}
  with_ema = state.ema_params is not None and EMA in (saved_items(storage.path(manager.directory) / str(step)) or ())
  if with_ema:
    items[EMA] = ocp.args.StandardRestore(abstract(state.ema_params, state_shardings.ema_params))
  restored = _restore(manager, step, ocp.args.Composite(**items))
  ema = restored[EMA] if with_ema else None
  if state.ema_params is not None and ema is None:
    print(f'checkpoint {step} holds no moving average of the weights; it starts from the restored parameters',
          flush=True)
    ema = jax.tree_util.tree_map(jax.numpy.copy, restored['params'])
  return state.replace(step=jax.device_put(np.asarray(step, np.int32), state_shardings.step),
                       params=restored['params'], opt_state=restored['opt_state'], ema_params=ema)


class CheckpointDamaged(UserError):
  """No checkpoint of the workdir can be restored."""


class CheckpointOfAnotherKind(UserError):
  """A whole checkpoint that is not what the caller needs: parameters only, or another model's."""


class CheckpointRestoreFailed(UserError):
  """A checkpoint could not be read for a reason other than damage (storage unreachable, out of memory)."""


# What damaged files raise: missing or truncated files, undecodable data. Anything else (a storage error, out of
# memory) says nothing about the checkpoint and must not move it aside.
_DAMAGE_TYPES = (FileNotFoundError, KeyError, EOFError, json.JSONDecodeError, UnicodeDecodeError)
_DAMAGE_WORDS = re.compile(r'DATA_LOSS|NOT_FOUND|[Nn]ot found|No such file|[Tt]runcat|[Cc]orrupt|[Uu]nexpected end|'
                           r'end of (file|data|stream)|[Cc]hecksum|[Ii]nvalid|[Ff]ailed to decode|[Ee]rror decoding|'
                           r'[Mm]alformed|does not exist|[Mm]issing')
RESTORE_ATTEMPTS = 3


def is_damage(error: BaseException) -> bool:
  """Whether `error` (or an error it was raised from) says the checkpoint's files are damaged."""
  while error is not None:
    if isinstance(error, _DAMAGE_TYPES) or (not isinstance(error, (MemoryError, ConnectionError, TimeoutError))
                                            and _DAMAGE_WORDS.search(str(error))):
      return True
    error = error.__cause__ or error.__context__
  return False


_STATUS = re.compile(r'^[A-Z][A-Z_]{3,}: ')  # TensorStore's and absl's status codes: DATA_LOSS: ..., NOT_FOUND: ...


def reason(error: BaseException) -> str:
  """One line of what went wrong: the innermost error that states a status (TensorStore's own words, not the
  wrappers around them), else `error` itself."""
  chain = [error]
  while chain[-1].__cause__ or chain[-1].__context__:
    chain.append(chain[-1].__cause__ or chain[-1].__context__)
  stated = next((e for e in reversed(chain) if _STATUS.match(str(e))), None)
  if stated is not None:
    return (str(stated).splitlines() or [''])[0][:200]
  return f'{type(error).__name__}: {(str(error).splitlines() or [""])[0][:160]}'


def _set_aside(path) -> str:
  """Renames a damaged checkpoint to <step>.corrupt (or .corrupt.2, ... if that name is taken); returns it."""
  target, n = storage.path(f'{path}.corrupt'), 1
  while target.exists():
    n += 1
    target = storage.path(f'{path}.corrupt.{n}')
  storage.move(path, target)
  return os.fspath(target)


def saved_items(step_directory) -> list[str] | None:
  """The items a finished checkpoint was saved with (its Orbax metadata); None if that cannot be read (restoring
  it then tells whether it is damaged)."""
  try:
    return sorted(json.loads((storage.path(step_directory) / '_CHECKPOINT_METADATA').read_text())['item_handlers'])
  except Exception:  # a missing or damaged metadata file: the restore that follows says what it is
    return None


def _shapes(tree) -> dict[str, tuple]:
  return {'/'.join(str(getattr(k, 'key', k)) for k in path): tuple(leaf.shape)
          for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def other_model(step_directory, abstract_params) -> str | None:
  """How the parameters saved at `step_directory` differ from `abstract_params` (the first parameter whose shape
  differs, both shapes), or None: the same shapes, or metadata that cannot be read (restoring then tells)."""
  try:
    saved = _shapes(ocp.StandardCheckpointHandler().metadata(storage.path(step_directory) / 'params'))
  except Exception:
    return None
  expected = _shapes(abstract_params)
  for name in sorted(set(saved) | set(expected)):
    if saved.get(name) != expected.get(name):
      shape = lambda s: 'absent' if s is None else f'of shape {s}'
      return f'parameter {name} {shape(saved.get(name))} where this model has it {shape(expected.get(name))}'
  return None


def check_kind(step_directory, abstract_params, training_state: bool, workdir) -> None:
  """Refuses, in one line, a whole checkpoint that is not of the kind asked for: `training_state` needs an
  optimizer state beside the parameters (an averaged workdir holds parameters only), and the parameters must
  be of this model. Such a checkpoint is not damaged and is left where it is."""
  items, step = saved_items(step_directory), storage.path(step_directory).name
  if training_state and items is not None and 'params' in items and 'opt_state' not in items:
    raise CheckpointOfAnotherKind(
        f'checkpoint {step} in {workdir} holds parameters only (an averaged model), not a training state; '
        f'translate with it, or train from it in a new workdir with --config.init_from={workdir}')
  difference = other_model(step_directory, abstract_params)
  if difference:
    raise CheckpointOfAnotherKind(f'checkpoint {step} in {workdir} holds another model ({difference}); it is left '
                                  f'as it is: use the config it was trained with, or a new --workdir')


def read_retried(read) -> tuple:
  """(read(), '') or (None, outcome): 'damaged: why' at once for a damaged file, 'failed: why' once RESTORE_ATTEMPTS
  tries (1 s, 2 s, ... apart) have failed otherwise. A UserError is raised as it is."""
  for attempt in range(RESTORE_ATTEMPTS):
    try:
      return read(), ''
    except UserError:
      raise
    except Exception as error:  # whatever a damaged file raises: ValueError, KeyError, IndexError, OSError...
      outcome = ('damaged: ' if is_damage(error) else 'failed: ') + reason(error)
      if outcome.startswith('damaged') or attempt == RESTORE_ATTEMPTS - 1:
        return None, outcome
      time.sleep(2 ** attempt)


def _attempt_restore(manager, step: int, state, state_shardings, with_data_state: bool):
  """(outcome, state, data state) of restoring `step` on this process: outcome '' (restored), 'damaged: why'
  (at once) or 'failed: why' (after RESTORE_ATTEMPTS tries)."""
  restored, outcome = read_retried(lambda: (restore_state(manager, step, state, state_shardings),
                                            restore_data_state(manager, step) if with_data_state else None))
  return (outcome, None, None) if outcome else ('', *restored)


def restore_latest(manager: ocp.CheckpointManager, state, state_shardings, with_data_state: bool = True):
  """(state, data state or None, step) of the newest checkpoint that restores; (state, None, None) if none.

  Every process reads the checkpoint, and the processes agree on the outcome (cluster.agree) before going on:
  a checkpoint that is damaged on any process (a truncated array file, a missing item, a damaged data state)
  is reported in one line on stderr and moved aside to `checkpoints/<step>.corrupt` by process 0, never
  deleted, and every process tries the next older one. Other errors are retried, then stop every process
  with nothing renamed; so does a workdir whose every checkpoint is damaged. The restored step is compared
  across processes.
  """
  set_aside = []
  while True:
    step = manager.latest_step()
    steps = cluster.agree(f'restore/latest/{len(set_aside)}', value=str(step))
    if len(set(steps)) > 1:
      raise CheckpointRestoreFailed(f'the processes see different newest checkpoints in {manager.directory} '
                                    f'({", ".join(f"process {p}: {s}" for p, s in enumerate(steps))}); the workdir '
                                    f'must be one storage location every process reads (e.g. gs://...)')
    if step is None:
      break
    path = storage.path(manager.directory) / str(step)
    try:
      check_kind(path, state.params, True, storage.path(manager.directory).parent)
      kind_error = None
    except CheckpointOfAnotherKind as error:
      kind_error = error
    cluster.agree(f'restore/{step}/{len(set_aside)}/kind', kind_error)
    outcome, restored, data_state = _attempt_restore(manager, step, state, state_shardings, with_data_state)
    outcomes = cluster.agree(f'restore/{step}/{len(set_aside)}', value=outcome)
    failed = [(p, o) for p, o in enumerate(outcomes) if o.startswith('failed')]
    if failed:
      where = f' on process {failed[0][0]}' if len(outcomes) > 1 else ''
      raise CheckpointRestoreFailed(f'checkpoint {path} could not be read{where} ({failed[0][1][8:]}) after '
                                    f'{RESTORE_ATTEMPTS} attempts; it is not damaged as far as that error says, so '
                                    f'nothing was renamed; rerun once the storage (or memory) problem is fixed')
    damaged = [(p, o) for p, o in enumerate(outcomes) if o]
    if not damaged:
      return restored, data_state, step
    where = f' on process {damaged[0][0]}' if len(outcomes) > 1 else ''
    if jax.process_index() == 0:
      moved = _set_aside(path)
      print(f'checkpoint {step} cannot be restored{where} ({damaged[0][1][9:]}); moved to {moved}, trying the one '
            f'before', file=sys.stderr, flush=True)
    cluster.agree(f'restore/{step}/{len(set_aside)}/moved')  # every process waits for the rename
    set_aside.append(step)
    manager.reload()
  if set_aside:
    raise CheckpointDamaged(f'every checkpoint in {manager.directory} is damaged (steps {set_aside} were moved aside '
                            f'as <step>.corrupt); the run stopped rather than train again from step 0; to start '
                            f'over, use a new --workdir')
  return state, None, None


def remove_partial(workdir, step: int) -> bool:
  """Removes what a failed save of `step` left (Orbax's temporary folder); whether there was any."""
  folder, removed = checkpoints_folder(workdir), False
  for partial in folder.glob(f'{step}.orbax-checkpoint-tmp*'):
    partial.rmtree() if partial.is_dir() else partial.unlink()
    removed = True
  return removed


def available_steps(directory: str) -> list[int]:
  """Steps of the finished checkpoints under `directory` (a workdir or its checkpoints/ folder)."""
  directory = checkpoints_folder(directory, or_itself=True)
  if not directory.is_dir():
    return []
  return sorted(ocp.utils.checkpoint_steps(directory))
