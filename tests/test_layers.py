"""Dropout masks and their scale."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax_transformer import layers


@pytest.mark.parametrize('method', ['hash', 'random'])
def test_dropout_masks_keep_the_right_fraction_independently(method):
  rate, shape = 0.3, (64, 50, 128)  # 409,600 elements
  mask_fn = jax.jit(lambda key: layers.dropout_keep_mask(key, rate, shape, method))
  key_a, key_b = jax.random.split(jax.random.key(0, impl='rbg'))
  a, b = np.asarray(mask_fn(key_a)).ravel(), np.asarray(mask_fn(key_b)).ravel()
  n, keep = a.size, 1.0 - rate
  sigma = math.sqrt(keep * rate / n)
  assert abs(a.mean() - keep) < 5 * sigma
  # Two draws agree only by chance: P(both kept) = keep², and a key gives the same mask again.
  assert abs((a & b).mean() - keep**2) < 5 * math.sqrt(keep**2 * (1 - keep**2) / n)
  np.testing.assert_array_equal(a, np.asarray(mask_fn(key_a)).ravel())
  # Neighbours along every axis are independent (a weak index hash would correlate them).
  grid = a.reshape(shape)
  for axis in range(3):
    first, second = np.moveaxis(grid, axis, 0)[:-1], np.moveaxis(grid, axis, 0)[1:]
    pairs = (first & second).mean()
    assert abs(pairs - keep**2) < 5 * math.sqrt(keep**2 * (1 - keep**2) / first.size), axis
  # Each of the 32 hash bits is fair: the threshold test sees uniform values.
  if method == 'hash':
    seed = jax.random.bits(key_a, (), jnp.uint32)
    index = jnp.arange(n, dtype=jnp.uint32)
    bits = np.asarray(layers._fmix32(layers._fmix32(index ^ seed) + seed))
    ones = np.unpackbits(bits.view(np.uint8)).reshape(n, 32).mean(0)
    assert np.all(np.abs(ones - 0.5) < 5 * math.sqrt(0.25 / n))


def test_dropout_scales_kept_values():
  x = jnp.ones((32, 40, 64))
  out = layers.Dropout(0.25).apply({}, x, False, rngs={'dropout': jax.random.key(1)})
  out = np.asarray(out)
  np.testing.assert_allclose(np.unique(out), [0.0, 1 / 0.75], rtol=1e-6)
  assert abs(out.mean() - 1.0) < 0.02
  np.testing.assert_array_equal(layers.Dropout(0.25).apply({}, x, True), x)
