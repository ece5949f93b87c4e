"""train_state.py: the train state made directly in its sharded layout, the weights' moving average starting at
the initial weights, and the abstract state (for ahead-of-time compilation) matching the real one leaf by leaf."""

import dataclasses

import jax
import numpy as np

from configs import tiny
from flax_transformer import partitioning, settings, train_state


def test_the_state_is_born_sharded_and_its_abstract_twin_has_its_shapes_and_shardings():
  s = settings.resolve(tiny.get_config(), 'cpu')
  optimizer = dataclasses.replace(s.optimizer, ema_decay=0.999)
  mesh = partitioning.create_mesh((2, 2, 2))
  state, shardings = train_state.create_train_state(s.model, optimizer, mesh, jax.random.key(0))
  abstract, abstract_shardings = train_state.abstract_train_state(s.model, optimizer, mesh)
  paths, leaves = zip(*jax.tree_util.tree_flatten_with_path(state)[0])
  twin_paths, twins = zip(*jax.tree_util.tree_flatten_with_path(abstract)[0])
  assert paths == twin_paths  # the same leaves (apply_fn and tx are static: equal in use, not by identity)
  for leaf, twin, sharding in zip(leaves, twins, jax.tree_util.tree_leaves(shardings)):
    assert (leaf.shape, leaf.dtype) == (twin.shape, twin.dtype) and leaf.sharding == twin.sharding == sharding
  assert jax.tree_util.tree_leaves(shardings) == jax.tree_util.tree_leaves(abstract_shardings)
  embedding = state.params['shared_embedding']['embedding']  # [vocab, d_model]: split over fsdp and model
  assert len({str(shard.index) for shard in embedding.addressable_shards}) == 4
  assert int(state.step) == 0
  for average, weights in zip(jax.tree_util.tree_leaves(state.ema_params), jax.tree_util.tree_leaves(state.params)):
    np.testing.assert_array_equal(average, weights)  # the average starts at the initial weights
  without, _ = train_state.create_train_state(s.model, dataclasses.replace(optimizer, ema_decay=0.0), mesh,
                                              jax.random.key(0))
  assert without.ema_params is None
  for a, b in zip(jax.tree_util.tree_leaves(without.params), jax.tree_util.tree_leaves(state.params)):
    np.testing.assert_array_equal(a, b)  # the same key, the same weights, whatever else the state holds
