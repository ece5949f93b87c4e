"""§6.1 checkpoint averaging: exactly the last k checkpoints, and a damaged one passed over, never renamed."""

import os

import flax.linen as nn
import jax
import numpy as np

from flax_transformer import average, checkpointing
from flax_transformer.model import Transformer


def test_average_takes_exactly_the_last_k_checkpoints(small_model_config, tmp_path):
  """§6.1: the last k checkpoints, no more: saved weights 1×, 2×, 3×, 4× the same tree average to 3.5× with k=2."""
  from flax_transformer import average
  model = Transformer(small_model_config)
  ids = np.ones((1, 3), np.int32)
  params = nn.meta.unbox(model.init(jax.random.key(0), ids, ids)['params'])
  for i, step in enumerate((10, 20, 30, 40), 1):
    checkpointing.save_params(str(tmp_path / 'checkpoints'), step, jax.tree_util.tree_map(lambda x: x * i, params))
  averaged, chosen = average.averaged_params(str(tmp_path), 2, small_model_config)
  assert chosen == [30, 40]
  for a, b in zip(jax.tree_util.tree_leaves(averaged), jax.tree_util.tree_leaves(params)):
    np.testing.assert_allclose(np.asarray(a), 3.5 * np.asarray(b), rtol=1e-6)


def test_a_damaged_checkpoint_is_passed_over_for_the_one_before_and_left_as_it_is(small_model_config, tmp_path, capsys):
  model = Transformer(small_model_config)
  ids = np.ones((1, 3), np.int32)
  params = nn.meta.unbox(model.init(jax.random.key(0), ids, ids)['params'])
  for i, step in enumerate((10, 20, 30), 1):
    checkpointing.save_params(str(tmp_path / 'checkpoints'), step, jax.tree_util.tree_map(lambda x: x * i, params))
  folder = tmp_path / 'checkpoints' / '30' / 'params'
  largest = max((p for p in folder.rglob('*') if p.is_file() and p.parent.name == 'd'), key=os.path.getsize)
  damaged = largest.read_bytes()[:largest.stat().st_size // 2]
  largest.write_bytes(damaged)
  averaged, chosen = average.averaged_params(str(tmp_path), 2, small_model_config)
  assert chosen == [10, 20]  # the last two that can be read
  for a, b in zip(jax.tree_util.tree_leaves(averaged), jax.tree_util.tree_leaves(params)):
    np.testing.assert_allclose(np.asarray(a), 1.5 * np.asarray(b), rtol=1e-6)
  warning = capsys.readouterr().err.strip().splitlines()
  assert len(warning) == 1 and warning[0].startswith(f'warning: checkpoint 30 in {tmp_path} is damaged (')
  assert warning[0].endswith('it is left as it is and passed over for the one before')
  assert largest.read_bytes() == damaged and checkpointing.available_steps(str(tmp_path)) == [10, 20, 30]
