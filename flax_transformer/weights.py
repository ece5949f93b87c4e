"""A trained model's weights, read for use (translation, export, averaging, fine-tuning): one checkpoint's
parameters or their moving average (config.ema_decay), onto any mesh; the mean of several (§6.1 checkpoint
averaging); the best by a validation metric (config.keep_best); and parameters-only checkpoints written.

`chosen_params` is what the Translator, the export and the averaged workdir read: the last K checkpoints, one
step, or the K best, each readable (a damaged one is passed over, with a line on stderr, for the next in line,
and left as it is: reading a run changes nothing in it).
"""

import json
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp

from flax_transformer import checkpointing, partitioning, storage
from flax_transformer.checkpointing import EMA, HIGHER_IS_BETTER, METRICS_ITEM
from flax_transformer.errors import UserError, WorkdirError
from flax_transformer.model import TransformerConfig

WEIGHTS = ('params', EMA)  # what a model can be read as: the trained weights, or their moving average


def restore_params(directory: str, step: int, abstract_params, shardings=None, weights: str = 'params'):
  """Parameters alone (no optimizer state is read) of checkpoint `step`, placed with `shardings`: the trained
  weights (`weights` 'params') or their moving average ('ema').

  `abstract_params`: a tree of arrays or ShapeDtypeStructs giving shapes; `shardings` defaults to
  replication over all local devices.
  """
  directory = checkpointing.checkpoints_folder(directory, or_itself=True)
  checkpointing.check_kind(directory / str(step), abstract_params, False, directory.parent)
  if weights == EMA and EMA not in (checkpointing.saved_items(directory / str(step)) or (EMA,)):
    raise checkpointing.CheckpointOfAnotherKind(
        f'checkpoint {step} in {directory.parent} holds no moving average of the weights (a run with '
        f'config.ema_decay=0, or an averaged model); use the trained weights (--weights=params)')
  if shardings is None:
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ('replica',))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    shardings = jax.tree_util.tree_map(lambda _: replicated, abstract_params)
  with ocp.CheckpointManager(directory) as manager:
    restored = manager.restore(step, args=ocp.args.Composite(
        **{weights: ocp.args.StandardRestore(checkpointing.abstract(abstract_params, shardings))}))
  return restored[weights]


class CheckpointUnreadable(UserError):
  """One checkpoint whose files are damaged (the workdir's other checkpoints may still be read)."""


def readable_params(directory: str, step: int, abstract_params, where: str, weights: str = 'params'):
  """restore_params; a damaged checkpoint is a CheckpointUnreadable naming the damage (and is left as it is:
  reading a run changes nothing in it); so is another model's (CheckpointOfAnotherKind). A read that fails for
  another reason (the storage, memory) is retried, then a CheckpointRestoreFailed."""
  params, outcome = checkpointing.read_retried(lambda: restore_params(directory, step, abstract_params,
                                                                      weights=weights))
  kind, _, why = outcome.partition(': ')
  if kind == 'damaged':
    raise CheckpointUnreadable(f'checkpoint {step} in {where} is damaged ({why})')
  if kind == 'failed':
    raise checkpointing.CheckpointRestoreFailed(
        f'checkpoint {step} in {where} could not be read ({why}) after {checkpointing.RESTORE_ATTEMPTS} attempts; '
        f'rerun once the storage (or memory) problem is fixed')
  return params


def average_params(params_list):
  """Element-wise mean of parameter trees (§6.1 checkpoint averaging), accumulated in float32."""
  total = jax.tree_util.tree_map(lambda x: np.asarray(x, np.float32), params_list[0])
  for params in params_list[1:]:
    total = jax.tree_util.tree_map(lambda a, b: a + np.asarray(b, np.float32), total, params)
  return jax.tree_util.tree_map(lambda x: x / len(params_list), total)


def save_params(directory: str, step: int, params, averaged_steps: list[int] | None = None) -> None:
  """Writes parameters as a one-item Orbax checkpoint at `directory/<step>` (e.g. an averaged model, whose
  `averaged_steps` go into the checkpoint's metadata)."""
  options = ocp.CheckpointManagerOptions(create=True)
  metadata = {'averaged_steps': list(averaged_steps)} if averaged_steps else None
  with ocp.CheckpointManager(storage.path(directory), options=options) as manager:
    manager.save(step, args=ocp.args.Composite(params=ocp.args.StandardSave(params)), custom_metadata=metadata)
    manager.wait_until_finished()


# --- Which checkpoints ------------------------------------------------------------------------

def checkpoint_metrics(directory) -> dict[int, dict]:
  """{step: its validation metrics} of the finished checkpoints under `directory` (a workdir or its
  checkpoints/ folder) saved with metrics (a run with config.keep_best > 0)."""
  folder, found = checkpointing.checkpoints_folder(directory, or_itself=True), {}
  for step in checkpointing.available_steps(directory):
    try:
      found[step] = json.loads((folder / str(step) / METRICS_ITEM / METRICS_ITEM).read_text())
    except (FileNotFoundError, ValueError, UnicodeDecodeError):
      continue
  return found


def ranked_steps(directory, metric: str, where: str) -> list[int]:
  """The checkpoints of `directory` ranked by validation `metric`, best first (ties: the newer first)."""
  ranked = {step: m[metric] for step, m in checkpoint_metrics(directory).items() if metric in m}
  if not ranked:
    raise WorkdirError(f'{where} holds no checkpoint ranked by validation {metric}; train with '
                       f'--config.keep_best=K (and --config.best_metric={metric}) to keep the best ones')
  higher = metric in HIGHER_IS_BETTER
  return sorted(ranked, key=lambda step: (ranked[step] if higher else -ranked[step], step), reverse=True)


def _candidates(directory, where: str, count: int, step: int | None, best: bool, metric: str) -> list[int]:
  """The steps to read, in the order of preference: `step` alone, the ranked ones (`best`), or the newest."""
  steps = checkpointing.available_steps(directory)
  if not steps:
    raise WorkdirError(f'{where} holds no checkpoint; point it at a run train.py has saved checkpoints in, or '
                       f'train first')
  if step is not None:
    if step not in steps:
      raise WorkdirError(f'no checkpoint at step {step} in {where}; available: {steps}')
    return [step]
  candidates = ranked_steps(directory, metric, where) if best else steps[::-1]
  what = f'{count} best checkpoints by validation {metric}' if best else f'last {count} checkpoints'
  if count < 1 or count > len(candidates):
    raise WorkdirError(f'cannot average the {what}: {where} keeps {len(candidates)} (steps {sorted(candidates)}); '
                       f'use a number from 1 to {len(candidates)}')
  return candidates


def chosen_params(directory, model_config: TransformerConfig, count: int = 1, *, step: int | None = None,
                  best: bool = False, metric: str = 'bleu', weights: str = 'params', where: str | None = None):
  """(the mean parameters of the chosen checkpoints of `directory` (a workdir or a checkpoints/ folder) as numpy
  arrays, the steps averaged, in order): checkpoint `step` alone; or the `count` best by validation `metric`
  (`best`); or the last `count`. `weights`: 'params' (the trained weights) or 'ema' (their moving average).
  A damaged checkpoint is passed over, with a line on stderr, for the next in line (never for another
  `step`); `where` names `directory` in messages (default: itself)."""
  import flax.linen as nn
  if weights not in WEIGHTS:
    raise UserError(f'weights={weights!r}: use one of {", ".join(WEIGHTS)}')
  where, count = where or str(directory), 1 if step is not None else count
  abstract = nn.meta.unbox(partitioning.abstract_params(model_config))
  candidates, trees = _candidates(directory, where, count, step, best, metric), {}
  for candidate in candidates:
    try:
      trees[candidate] = jax.device_get(readable_params(directory, candidate, abstract, where, weights))
    except CheckpointUnreadable as error:
      if step is not None:
        raise
      instead = 'the next best' if best else 'the one before'
      print(f'warning: {error}; it is left as it is and passed over for {instead}', file=sys.stderr, flush=True)
    if len(trees) == count:
      chosen = sorted(trees)
      params = [trees[s] for s in chosen]
      return (params[0] if len(params) == 1 else average_params(params)), chosen
  raise WorkdirError(f'{where} holds {len(trees)} readable checkpoint(s) of the {count} asked for (the others are '
                     f'damaged); average fewer')
