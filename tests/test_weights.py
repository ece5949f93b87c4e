"""A trained model's weights read for use: §6.1 checkpoint averaging (exactly the last k checkpoints, a damaged one
passed over, never renamed), the best checkpoints by a validation metric, and the weights' moving average."""

import os

import flax.linen as nn
import jax
import numpy as np

from flax_transformer import checkpointing, weights
from flax_transformer.model import Transformer


def test_averaging_checkpoints(tmp_path):
  a = {'w': np.arange(6, dtype=np.float32).reshape(2, 3), 'b': np.ones(3, np.float32)}
  b = {'w': np.full((2, 3), 4.0, np.float32), 'b': np.zeros(3, np.float32)}
  same = weights.average_params([a, a, a])
  np.testing.assert_array_equal(same['w'], a['w'])
  mean = weights.average_params([a, b])
  np.testing.assert_allclose(mean['w'], (a['w'] + b['w']) / 2)
  np.testing.assert_allclose(mean['b'], 0.5)
  weights.save_params(str(tmp_path / 'checkpoints'), 7, mean)
  restored = weights.restore_params(str(tmp_path), 7, mean)
  np.testing.assert_allclose(np.asarray(restored['w']), mean['w'])


def test_average_takes_exactly_the_last_k_checkpoints(small_model_config, tmp_path):
  """§6.1: the last k checkpoints, no more: saved weights 1×, 2×, 3×, 4× the same tree average to 3.5× with k=2."""
  model = Transformer(small_model_config)
  ids = np.ones((1, 3), np.int32)
  params = nn.meta.unbox(jax.jit(model.init)(jax.random.key(0), ids, ids)['params'])
  for i, step in enumerate((10, 20, 30, 40), 1):
    weights.save_params(str(tmp_path / 'checkpoints'), step, jax.tree_util.tree_map(lambda x: x * i, params))
  averaged, chosen = weights.chosen_params(str(tmp_path), small_model_config, 2)
  assert chosen == [30, 40]
  for a, b in zip(jax.tree_util.tree_leaves(averaged), jax.tree_util.tree_leaves(params)):
    np.testing.assert_allclose(np.asarray(a), 3.5 * np.asarray(b), rtol=1e-6)


def test_a_damaged_checkpoint_is_passed_over_for_the_one_before_and_left_as_it_is(small_model_config, tmp_path, capsys):
  model = Transformer(small_model_config)
  ids = np.ones((1, 3), np.int32)
  params = nn.meta.unbox(jax.jit(model.init)(jax.random.key(0), ids, ids)['params'])
  for i, step in enumerate((10, 20, 30), 1):
    weights.save_params(str(tmp_path / 'checkpoints'), step, jax.tree_util.tree_map(lambda x: x * i, params))
  folder = tmp_path / 'checkpoints' / '30' / 'params'
  largest = max((p for p in folder.rglob('*') if p.is_file() and p.parent.name == 'd'), key=os.path.getsize)
  damaged = largest.read_bytes()[:largest.stat().st_size // 2]
  largest.write_bytes(damaged)
  averaged, chosen = weights.chosen_params(str(tmp_path), small_model_config, 2)
  assert chosen == [10, 20]  # the last two that can be read
  for a, b in zip(jax.tree_util.tree_leaves(averaged), jax.tree_util.tree_leaves(params)):
    np.testing.assert_allclose(np.asarray(a), 1.5 * np.asarray(b), rtol=1e-6)
  warning = capsys.readouterr().err.strip().splitlines()
  assert len(warning) == 1 and warning[0].startswith(f'warning: checkpoint 30 in {tmp_path} is damaged (')
  assert warning[0].endswith('it is left as it is and passed over for the one before')
  assert largest.read_bytes() == damaged and checkpointing.available_steps(str(tmp_path)) == [10, 20, 30]
