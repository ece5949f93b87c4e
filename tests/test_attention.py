"""Attention: JAX's library call against the written-out core, and the decoding engine's flat self-attention
cache against attention over each hypothesis's explicitly gathered prefix."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax_transformer import attention


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
  lengths = None if causal else attention.key_lengths(key_ids)
  library = attention.library_attention(query, key, value, lengths, causal)
  bias = attention.attention_bias(q, key.shape[1], lengths, causal)
  written, weights = attention.scaled_dot_product_attention(query, key, value, bias)
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
  length, steps = 2 * attention.chunk_steps(n), np.array([attention.chunk_steps(n) + 3, 2], np.int32)
  layer = attention.MultiHeadAttention(h, h * d, True)
  x = jnp.asarray(np_rng.normal(size=(b * n, 1, h * d)), jnp.float32)
  params = jax.jit(layer.init)(jax.random.key(0), x, None)
  params = jax.tree_util.tree_map(lambda p: jnp.asarray(np_rng.normal(size=p.shape), jnp.float32), params)
  key, value = attention.chunked_cache(jnp.asarray(np_rng.normal(size=(b, h, d, length * n)), jnp.float32),
                                    jnp.asarray(np_rng.normal(size=(b, h, length * n, d)), jnp.float32), n)
  ancestry = np_rng.integers(0, n, size=(b, n, length)).astype(np.int32)
  ancestry[np.arange(b), :, steps] = np.arange(n)  # each hypothesis's own slot at its sentence's step
  out, written = layer.apply(params, x, {'key': key, 'value': value}, steps, jnp.asarray(ancestry),
                                 method=attention.MultiHeadAttention.decode_step)
  query, key, value = layer.apply(params, x[:, 0], 'qkv', method=attention.MultiHeadAttention._project)
  written_keys, written_values = (np.asarray(y) for y in attention.whole_cache(written['key'], written['value']))
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
      expected = layer.apply(params, jnp.asarray(context), method=attention.MultiHeadAttention._output)
      np.testing.assert_allclose(np.asarray(out[row, 0]), np.asarray(expected), rtol=1e-5, atol=1e-5)
