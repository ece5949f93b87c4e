"""The boxes of Figure 1 one by one: dropout masks and their scale, the attention core against JAX's own."""

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


@pytest.mark.parametrize('causal', [False, True])
@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
def test_library_attention_equals_written_out_attention(np_rng, causal, dtype):
  """jax.nn.dot_product_attention with key lengths and a causal flag == softmax(QKᵀ/√d + bias) V written out."""
  b, q, k, h, d = 3, 5, 7, 2, 8
  query, key, value = (jnp.asarray(np_rng.normal(size=(b, length, h, d)), dtype) for length in (q, k, k))
  if causal:
    key = key[:, :q]
    value = value[:, :q]
  key_ids = np.zeros((b, key.shape[1]), np.int32)
  for row, n in enumerate([key.shape[1], 3, 0]):  # full, padded, all padding (batch filler)
    key_ids[row, :n] = 5
  lengths = None if causal else layers.key_lengths(key_ids)
  library = layers.library_attention(query, key, value, lengths, causal)
  bias = layers.attention_bias(q, key.shape[1], lengths, causal)
  written, weights = layers.scaled_dot_product_attention(query, key, value, bias)
  tolerance = 1e-6 if dtype == jnp.float32 else 1e-2
  np.testing.assert_allclose(np.asarray(library, np.float32), np.asarray(written, np.float32),
                             atol=tolerance, rtol=tolerance)
  if not causal:  # the padding really is hidden: weights on padded keys are 0
    assert float(jnp.max(weights[1, :, :, 3:])) == 0.0


def test_attention_through_an_ancestry_equals_attention_over_the_explicitly_gathered_prefix(np_rng):
  """The flat self-attention cache: keys and values written at slot s·n + i by hypothesis i at step s, read by
  hypothesis j through a random ancestry (chunk by chunk, two chunks here), equal softmax attention over j's own
  prefix gathered slot by slot; each sentence at its own step."""
  b, n, h, d = 2, 3, 2, 4
  length, steps = 2 * layers.CACHE_CHUNK_STEPS, np.array([layers.CACHE_CHUNK_STEPS + 3, 2], np.int32)
  attention = layers.MultiHeadAttention(h, h * d, True)
  x = jnp.asarray(np_rng.normal(size=(b * n, 1, h * d)), jnp.float32)
  params = jax.jit(attention.init)(jax.random.key(0), x, None)
  params = jax.tree_util.tree_map(lambda p: jnp.asarray(np_rng.normal(size=p.shape), jnp.float32), params)
  key, value = layers.chunked_cache(jnp.asarray(np_rng.normal(size=(b, h, d, length * n)), jnp.float32),
                                    jnp.asarray(np_rng.normal(size=(b, h, length * n, d)), jnp.float32), n)
  ancestry = np_rng.integers(0, n, size=(b, n, length)).astype(np.int32)
  ancestry[np.arange(b), :, steps] = np.arange(n)  # each hypothesis's own slot at its sentence's step
  out, written = attention.apply(params, x, {'key': key, 'value': value}, steps, jnp.asarray(ancestry),
                                 method=layers.MultiHeadAttention.decode_step)
  query, key, value = attention.apply(params, x[:, 0], 'qkv', method=layers.MultiHeadAttention._project)
  written_keys, written_values = (np.asarray(y) for y in layers.whole_cache(written['key'], written['value']))
  for sentence in range(b):
    for j in range(n):
      row = sentence * n + j
      slots = [s * n + ancestry[sentence, j, s] for s in range(steps[sentence] + 1)]
      keys = written_keys[sentence][:, :, slots]  # [h, d, step + 1]
      values = written_values[sentence][:, slots]  # [h, step + 1, d]
      np.testing.assert_array_equal(keys[:, :, -1], np.asarray(key[row]))  # this step's key, written in place
      logits = np.einsum('hd,hdk->hk', np.asarray(query[row]), keys) / np.sqrt(d)
      weights = np.exp(logits - logits.max(-1, keepdims=True))
      context = np.einsum('hk,hkd->hd', weights / weights.sum(-1, keepdims=True), values)  # [h, d]
      expected = attention.apply(params, jnp.asarray(context), method=layers.MultiHeadAttention._output)
      np.testing.assert_allclose(np.asarray(out[row, 0]), np.asarray(expected), rtol=1e-5, atol=1e-5)
