"""The loop's hooks: their order is a contract the loop enforces, and it matters where it is declared."""

import dataclasses
import itertools
import types

import numpy as np
import pytest

from configs import tiny
from flax_transformer import hooks, settings, train_loop


def test_the_loops_order_keeps_every_declared_rule_and_a_swap_that_breaks_one_is_refused():
  hooks.check_order(list(train_loop.ORDER))
  rules = [(i, j) for i, j in itertools.combinations(range(len(train_loop.ORDER)), 2)
           if train_loop.ORDER[i].name in train_loop.ORDER[j].after]
  assert len(rules) >= 7  # signals -> guard -> progress; guard -> evaluation -> early stopping -> checkpoint -> late stop
  for i, j in rules:
    swapped = list(train_loop.ORDER)
    swapped[i], swapped[j] = swapped[j], swapped[i]
    with pytest.raises(ValueError, match=f"hook '{train_loop.ORDER[j].name}' must come after"):
      hooks.check_order(swapped)


class _Saves:
  """A saver that records the steps it saved (the loop's Saver interface)."""

  def __init__(self):
    self.steps = []

  def check(self):
    pass

  def save(self, step, state, data_state, metrics=None):
    self.steps.append(step)

  def finish(self):
    pass

  def close(self):
    pass


@dataclasses.dataclass
class _Batches:
  """Training batches of one shape, forever (the loop's TrainBatches interface)."""
  batching: types.SimpleNamespace = dataclasses.field(
      default_factory=lambda: types.SimpleNamespace(used_shapes=[()], dropped=0))

  def __next__(self):
    return {'inputs': np.zeros((1, 1)), 'targets': np.zeros((1, 1))}

  def state(self):
    return {}


def _run(losses, checkpoint_every=3):
  """A stand-in Run whose train step returns `losses`, one a step (the state is the step count)."""
  config = tiny.get_config()
  config.num_train_steps, config.checkpoint_every_steps, config.log_every_steps = len(losses), checkpoint_every, 100
  config.max_skipped_steps = len(losses)
  training = settings.resolve(config, 'cpu').training
  step = lambda state, batch, rng: (state + 1, {'loss': np.float32(losses[state])})
  return types.SimpleNamespace(settings=types.SimpleNamespace(training=training), start_step=0, is_chief=False,
                               train_iter=_Batches(), to_global=lambda batch: batch, train_step=step,
                               dropout_rng=None), training


def test_the_guard_before_the_checkpoint_keeps_a_broken_state_out_of_the_checkpoints():
  """Losses 1, 1, NaN with a checkpoint due at step 3: in the loop's order the guard sees the NaN first and no
  checkpoint is written; with the two swapped (the order check bypassed) the broken state is saved."""
  for order, expected in (('guard first', []), ('checkpoint first', [3])):
    run, loop = _run([1.0, 1.0, float('nan')])
    saves = _Saves()
    guard = hooks.LossGuard(loop.max_skipped_steps, 0.0, 5, verbose=False)
    checkpoint = hooks.Checkpoint(run, saves, guard)
    ordered = [guard, checkpoint] if order == 'guard first' else [checkpoint, guard]
    with pytest.raises(hooks.TrainingDiverged, match='not finite from step 3 to the last step'):
      train_loop._train(run, 0, ordered)
    assert saves.steps == expected, order
