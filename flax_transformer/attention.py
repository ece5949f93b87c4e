"""§3.2 attention, in one place: the core (softmax(QKᵀ/√d + bias) V, written out), the same through
`jax.nn.dot_product_attention`, the masks, Multi-Head Attention, and the decoding caches it reads: the encoder's
keys and values per sentence and the flat self-attention cache of the decoding engine's slots.

Letters in einsums: b batch (or slots), q query length, k key length, h heads, d head size, e d_model,
n beams per sentence, s source length.
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from flax_transformer.constants import ATTENTION_MASK_VALUE
from flax_transformer.layers import Dtype, dropout_keep_mask, float32_accumulating_einsum, projection_init, zeros

def key_lengths(key_ids: jax.Array) -> jax.Array:
  """Right-padded key_ids [b, k] (0 = padding, only after the sentence) -> real keys per row [b] int32.

  At least 1, so an all-padding row (batch filler) attends to its first key instead of to nothing: no
  kernel sees an empty row, and its output is discarded anyway (its targets carry no weight).
  """
  return jnp.maximum(jnp.sum(key_ids > 0, axis=-1), 1).astype(jnp.int32)


def attention_bias(query_length: int, key_length: int, lengths: jax.Array | None, causal: bool) -> jax.Array:
  """The additive bias [b or 1, 1, q, k] of `key_lengths` (None: every key visible) and a causal mask (§3.2.3)."""
  bias = jnp.zeros((1, 1, query_length, key_length), jnp.float32)  # [1, 1, q, k]
  if lengths is not None:
    visible = jnp.arange(key_length)[None, :] < lengths[:, None]  # [b, k]
    bias = bias + jnp.where(visible, 0.0, ATTENTION_MASK_VALUE)[:, None, None, :]  # [b, 1, 1, k]
  if causal:
    allowed = jnp.tril(jnp.ones((query_length, key_length), dtype=bool))  # [q, k]
    bias = bias + jnp.where(allowed, 0.0, ATTENTION_MASK_VALUE)[None, None]
  return bias


def ancestry_bias(ancestry: jax.Array, step: jax.Array, first_step: jax.Array | int = 0) -> jax.Array:
  """The additive bias [b, 1, n, C·n] of the flat self-attention cache (CACHED_SELF) at `step` (each row's, [b]),
  over the C steps of `ancestry` from `first_step` on: hypothesis j sees slot s·n + i (what hypothesis i wrote
  at step s) iff s ≤ step and its ancestor at step s was i.

  ancestry [b, n, C] int32: ancestry[:, j, s - first_step] is the beam index of hypothesis j's ancestor at step s
  (its own index at `step`). The beam search reorders this table, never the cache (Lingvo's flat beam search).
  """
  batch, n, length = ancestry.shape
  steps = first_step + jnp.arange(length)  # [C]
  visible = (ancestry[..., None] == jnp.arange(n)) & (steps[:, None] <= jnp.reshape(step, (-1, 1, 1, 1)))  # [b, n, C, n]
  return jnp.where(visible, 0.0, ATTENTION_MASK_VALUE).astype(jnp.float32).reshape(batch, 1, n, length * n)


# Slots (steps × hypotheses) of the flat self-attention cache that one pass of flat_cache_attention reads: a
# step reads only the chunks written so far (the output ends long before the input + 50 steps the cache is
# sized for). 8 steps of a beam of 4, 32 of greedy search: as few passes as a step's few columns allow.
CACHE_CHUNK_COLUMNS = 32


def chunk_steps(beam_size: int) -> int:
  """The steps of one chunk of the flat cache of `beam_size` hypotheses a sentence."""
  return max(1, CACHE_CHUNK_COLUMNS // beam_size)


def cache_steps(max_output_length: int, beam_size: int) -> int:
  """The steps a flat self-attention cache holds for `max_output_length`: whole chunks."""
  return -(-max_output_length // chunk_steps(beam_size)) * chunk_steps(beam_size)


def flat_cache_attention(query, key, value, ancestry, step):
  """Self-attention of one decoding step over the flat cache (CACHED_SELF) held in chunks (chunked_cache),
  reading only the chunks written so far: softmax over the visible slots (ancestry_bias), accumulated chunk by
  chunk as running maxima and sums (online softmax), in a loop of step // C + 1 trips; each chunk's two products
  are the core's (attention_logits, attention_context), as in training.

  query [b, n, h, d]; key [L/C, b, h, d, C·n]; value [L/C, b, h, C·n, d]; ancestry [b, n, L] int32; step [b]
  -> context [b, h, n, d] float32. The loop reads the chunks of the furthest row; the first chunk holds a
  visible slot for every hypothesis (step 0), so the running maxima are finite from it on.
  """
  batch, n, heads, d = query.shape
  chunk_steps = key.shape[-1] // n

  def chunk(c, carry):
    running_max, running_sum, context = carry  # [b, h, n], [b, h, n], [b, h, n, d]
    keys = jax.lax.dynamic_index_in_dim(key, c, keepdims=False)  # [b, h, d, C·n]: one contiguous block
    values = jax.lax.dynamic_index_in_dim(value, c, keepdims=False)  # [b, h, C·n, d]
    lineage = jax.lax.dynamic_slice_in_dim(ancestry, c * chunk_steps, chunk_steps, axis=2)  # [b, n, C]
    logits = attention_logits(query, keys, CACHED_SELF) + ancestry_bias(lineage, step, c * chunk_steps)  # [b, h, n, C·n]
    new_max = jnp.maximum(running_max, jnp.max(logits, axis=-1))  # [b, h, n]
    weights = jnp.exp(logits - new_max[..., None])  # [b, h, n, C·n]
    rescale = jnp.exp(running_max - new_max)  # [b, h, n]: 0 on the first chunk
    context = context * rescale[..., None] + attention_context(weights, values, CACHED_SELF)
    return new_max, running_sum * rescale + jnp.sum(weights, axis=-1), context

  start = (jnp.full((batch, heads, n), -jnp.inf, jnp.float32), jnp.zeros((batch, heads, n), jnp.float32),
           jnp.zeros((batch, heads, n, d), jnp.float32))
  _, total, context = jax.lax.fori_loop(0, jnp.max(step) // chunk_steps + 1, chunk, start)
  return context / total[..., None]  # [b, h, n, d]


def chunked_cache(key: jax.Array, value: jax.Array, n: int):
  """A flat cache key [b, h, d, L·n], value [b, h, L·n, d] as the chunks flat_cache_attention reads: key
  [L/C, b, h, d, C·n], value [L/C, b, h, C·n, d] (C = chunk_steps(n); L a multiple of it)."""
  batch, heads, d, slots = key.shape
  width = chunk_steps(n) * n
  return (key.reshape(batch, heads, d, slots // width, width).transpose(3, 0, 1, 2, 4),
          value.reshape(batch, heads, slots // width, width, d).transpose(2, 0, 1, 3, 4))


def whole_cache(key: jax.Array, value: jax.Array):
  """chunked_cache's inverse: key [b, h, d, L·n], value [b, h, L·n, d]."""
  chunks, batch, heads, d, width = key.shape
  return (key.transpose(1, 2, 3, 0, 4).reshape(batch, heads, d, chunks * width),
          value.transpose(1, 2, 0, 3, 4).reshape(batch, heads, chunks * width, d))


# The attention core's two products (logits, weighted sum) in each layout it runs in; letters as above.
FULL_SEQUENCE = ('bqhd,bkhd->bhqk', 'bhqk,bkhd->bqhd')  # query [b, q, h, d]; key, value [b, k, h, d]
# Decoding: the n hypotheses of a sentence are its queries, one each, over keys [b, h, d, k] and values
# [b, h, k, d] laid out so each step's products need no transpose. Against the encoder's keys (shared by a
# sentence's beams, never copied) and against the flat self-attention cache: per sentence, every key a
# hypothesis wrote, at slot step·n + beam, written once and never moved (ancestry_bias picks each hypothesis's
# own). The sum is written [b, h, n, d] (batch axes first): XLA:CPU's batched product is far slower writing
# [b, n, h, d].
CACHED_SELF = CACHED_CROSS = ('bnhd,bhds->bhns', 'bhns,bhsd->bhnd')  # query [b, n, h, d]


def scaled_dot_product_attention(query, key, value, bias, dropout_rate=0.0, dropout_rng=None, dropout_masks='hash',
                                 layout=FULL_SEQUENCE):
  """§3.2.1: softmax(QKᵀ/√d + bias) V, written out once for training, scoring and both decoding caches: the
  reference for `library_attention`, and the path that returns the weights (attention pictures, alignments)
  and applies attention dropout (which the library does not).

  Logits accumulate in float32 whatever the inputs' dtype; softmax runs in float32.
  Args:
    query, key, value: as `layout` names them (FULL_SEQUENCE: [b, q, h, d], [b, k, h, d], [b, k, h, d]);
    bias: broadcastable to the logits (FULL_SEQUENCE: [b, h, q, k]).
  Returns:
    (context, weights float32), shaped as `layout`'s two outputs.
  """
  weights = jax.nn.softmax(attention_logits(query, key, layout) + bias, axis=-1)  # [b, h, q, k]
  if dropout_rate > 0.0 and dropout_rng is not None:
    keep = dropout_keep_mask(dropout_rng, dropout_rate, weights.shape, dropout_masks)
    weights = jnp.where(keep, weights / (1.0 - dropout_rate), 0.0)
  return attention_context(weights, value, layout), weights  # [b, q, h, d], [b, h, q, k]


def attention_logits(query, key, layout=FULL_SEQUENCE):
  """The core's first product, QKᵀ/√d in `layout` ([b, h, q, k] for FULL_SEQUENCE), accumulated and returned in
  float32 whatever the inputs' dtype."""
  scale = 1.0 / np.sqrt(query.shape[-1])
  return float32_accumulating_einsum(layout[0], query, key, query.dtype) * scale


def attention_context(weights, value, layout=FULL_SEQUENCE):
  """The core's second product: the values weighted by `weights` (in the values' dtype), shaped as `layout`."""
  return jnp.einsum(layout[1], weights.astype(value.dtype), value)


def library_attention(query, key, value, lengths, causal: bool, attention: str = 'xla'):
  """The same attention through `jax.nn.dot_product_attention`: XLA's fused graph, or cuDNN's fused kernel
  (flash attention) on GPUs in bf16. Padding is given as per-row key counts (`key_lengths`), the form
  cuDNN takes without materialising a mask; `causal` hides future positions.

  Args:
    query: [b, q, h, d]; key, value: [b, k, h, d]; lengths: [b] int32 or None (every key visible).
  Returns:
    context [b, q, h, d].
  """
  return jax.nn.dot_product_attention(query, key, value, is_causal=causal, key_value_seq_lengths=lengths,
                                      implementation=attention)


def without_key_bias(bias, parts: str):
  """bias [len(parts), h, d] of the stacked projections named by `parts` ('qkv' or 'kv'), the key's part held
  at zero: a key bias adds the same q·b to every logit of a query, which softmax cancels; its gradient is
  pure round-off, which Adam would inflate into full-size random steps."""
  keep = np.array([part != 'k' for part in parts], np.float32)
  return bias * keep[:, None, None]


class MultiHeadAttention(nn.Module):
  """§3.2.2 Multi-Head Attention, self- ([e, 3, h, d] qkv kernel) or encoder-decoder (q [e, h, d], kv [e, 2, h, d]),
  with a decoding cache: the keys/values of the steps so far, or the encoder's, projected once per sentence."""
  num_heads: int
  d_model: int
  self_attention: bool
  attention_dropout_rate: float = 0.0
  dtype: Dtype = jnp.float32
  dropout_masks: str = 'hash'  # See dropout_keep_mask.
  attention: str = 'xla'  # One of platforms.ATTENTION: jax.nn.dot_product_attention's, or 'explicit'.

  def setup(self):
    h, d, e = self.num_heads, self.d_model // self.num_heads, self.d_model
    def param(name, shape, axes, init):
      return self.param(name, nn.with_logical_partitioning(init, axes), shape, jnp.float32)
    def projection(parts):  # kernel [e, (len(parts),) h, d], bias [(len(parts),) h, d]; one part is not stacked
      stack, axes, batch = ((len(parts),), ('qkv',), (1,)) if len(parts) > 1 else ((), (), ())
      return (param(f'{parts}_kernel', (e, *stack, h, d), ('embed', *axes, 'heads', 'kv'), projection_init(batch)),
              param(f'{parts}_bias', (*stack, h, d), (*axes, 'heads', 'kv'), zeros))
    self.projections = {parts: projection(parts) for parts in (['qkv'] if self.self_attention else ['q', 'kv'])}
    self.out_kernel = param('out_kernel', (h, d, e), ('heads', 'kv', 'embed'),
                            nn.initializers.variance_scaling(1.0, 'fan_avg', 'uniform', in_axis=(0, 1), out_axis=2))
    self.out_bias = param('out_bias', (e,), ('embed',), zeros)

  def _project(self, x, parts: str):
    """x [..., e] -> the projections named by `parts`, each [..., h, d] (a tuple when more than one)."""
    kernel, bias = self.projections[parts]
    if len(parts) == 1:
      return jnp.einsum('...e,ehd->...hd', x.astype(self.dtype), kernel.astype(self.dtype)) + bias.astype(self.dtype)
    bias = without_key_bias(bias, parts)
    stacked = jnp.einsum('...e,ejhd->...jhd', x.astype(self.dtype), kernel.astype(self.dtype)) + bias.astype(self.dtype)
    return tuple(stacked[..., j, :, :] for j in range(len(parts)))  # each [..., h, d]

  def _output(self, context):  # [..., h, d] -> [..., e]
    return jnp.einsum('...hd,hde->...e', context, self.out_kernel.astype(self.dtype)) + self.out_bias.astype(self.dtype)

  def __call__(self, x, lengths, memory=None, causal=False, deterministic=True):
    """x [b, q, e], lengths [b] real keys per row (`key_lengths`; None: all), memory [b, k, e] (encoder-decoder)
    -> [b, q, e]. Through the library unless attention dropout (the library has none) or the weights
    (mutable=['intermediates']: pictures, alignments) need the written-out core."""
    query, key, value = (self._project(x, 'qkv') if self.self_attention
                         else (self._project(x, 'q'), *self._project(memory, 'kv')))  # [b, q|k, h, d]
    query = nn.with_logical_constraint(query, ('batch', 'length', 'heads', 'kv'))
    rate = 0.0 if deterministic else self.attention_dropout_rate
    if self.attention != 'explicit' and rate == 0.0 and not self.is_mutable_collection('intermediates'):
      return self._output(library_attention(query, key, value, lengths, causal, self.attention))
    bias = attention_bias(query.shape[1], key.shape[1], lengths, causal)  # [b or 1, 1, q, k]
    rng = self.make_rng('dropout') if rate > 0.0 else None
    context, weights = scaled_dot_product_attention(query, key, value, bias, rate, rng, self.dropout_masks)
    self.sow('intermediates', 'attention_weights', weights)  # [b, h, q, k]
    return self._output(context)

  def memory(self, memory: jax.Array) -> dict:
    """Encoder-decoder attention's cache of one sentence per row (CACHED_CROSS): memory [b, s, e] projected
    once, keys [b, h, d, s], values [b, h, s, d]."""
    key, value = self._project(memory, 'kv')  # each [b, s, h, d]
    return {'key': jnp.transpose(key, (0, 2, 3, 1)), 'value': jnp.transpose(value, (0, 2, 1, 3))}

  def init_cache(self, slots: int, max_output_length: int, beam_size: int = 1) -> dict:
    """Self-attention's cache of `slots` sentences (CACHED_SELF): zeros for max_output_length steps (rounded up
    to whole chunks, cache_steps) of `beam_size` hypotheses each, in chunks of C steps (chunked_cache: keys
    [L/C, S, h, d, C·n], values [L/C, S, h, C·n, d])."""
    h, d = self.num_heads, self.d_model // self.num_heads
    steps = chunk_steps(beam_size)
    chunks, width = cache_steps(max_output_length, beam_size) // steps, steps * beam_size
    return {'key': jnp.zeros((chunks, slots, h, d, width), self.dtype),
            'value': jnp.zeros((chunks, slots, h, width, d), self.dtype)}

  def decode_step(self, x, cache, steps, context):
    """x [S·n, 1, e] (n hypotheses a slot), each slot at its own position `steps` [S] -> ([S·n, 1, e], cache).
    `context`: for self-attention the ancestry table [S, n, L] (ancestry_bias; this step's keys and
    values are written in place first, each slot's at its slots step·n … step·n + n - 1, and read through
    flat_cache_attention); for encoder-decoder attention the padding_bias [S, 1, 1, s]. The written-out core:
    one query per hypothesis leaves a fused kernel no tile to save. With mutable=['intermediates'] the weights
    are sown, [Sn, h, 1, k] (self-attention: per step, over the whole cache in one softmax)."""
    h, d = self.num_heads, self.d_model // self.num_heads
    if not self.self_attention:
      slots = cache['key'].shape[0]
      query = self._project(x[:, 0], 'q').reshape(slots, -1, h, d)  # [S, n, h, d]
      context, weights = scaled_dot_product_attention(query, cache['key'], cache['value'], context,
                                                      layout=CACHED_CROSS)  # [S, h, n, d], [S, h, n, s]
      self.sow('intermediates', 'attention_weights',
               jnp.swapaxes(weights, 1, 2).reshape(-1, h, 1, weights.shape[-1]))  # [Sn, h, 1, s]
      return self._output(jnp.swapaxes(context, 1, 2).reshape(x.shape[0], 1, h, d)), cache  # [Sn, 1, e]
    slots = cache['key'].shape[1]
    query, key, value = (y.reshape(slots, -1, h, d) for y in self._project(x[:, 0], 'qkv'))  # each [S, n, h, d]
    n, ancestry = query.shape[1], context
    per_chunk = chunk_steps(n)
    chunk, columns = steps // per_chunk, steps[:, None] % per_chunk * n + jnp.arange(n)  # [S], [S, n]
    rows = jnp.arange(slots)[:, None]  # [S, 1]: each slot writes its own step's n columns
    cache = {'key': cache['key'].at[chunk[:, None], rows, :, :, columns].set(key),  # [L/C, S, h, d, C·n]
             'value': cache['value'].at[chunk[:, None], rows, :, columns, :].set(value)}  # [L/C, S, h, C·n, d]
    if self.is_mutable_collection('intermediates'):
      attended, weights = scaled_dot_product_attention(query, *whole_cache(cache['key'], cache['value']),
                                                       ancestry_bias(ancestry, steps), layout=CACHED_SELF)
      weights = weights.reshape(*weights.shape[:3], -1, n).sum(-1)  # [S, h, n, L]: one visible slot a step
      self.sow('intermediates', 'attention_weights', jnp.swapaxes(weights, 1, 2).reshape(-1, h, 1, weights.shape[-1]))
    else:
      attended = flat_cache_attention(query, cache['key'], cache['value'], ancestry, steps).astype(query.dtype)
    return self._output(jnp.swapaxes(attended, 1, 2).reshape(x.shape[0], 1, h, d)), cache  # [Sn, 1, e]
