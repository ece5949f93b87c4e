"""The boxes of the paper's Figure 1 (§3.3-§3.5, §5.4) other than attention (attention.py), as Flax Linen
modules: embeddings and the pre-softmax projection, positions, dropout, the feed-forward network, LayerNorm.

Every parameter carries logical axis names (`partitioning.py` maps them to the
device mesh); every tensor-building line says its shape. Letters in einsums:
b batch, l length, e d_model, f d_ff, v vocabulary.
"""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn


Dtype = Any


def float32_accumulating_einsum(spec: str, x: jax.Array, y: jax.Array, dtype: Dtype) -> jax.Array:
  """einsum of x and y in `dtype` with float32 accumulation and a float32 result.

  In bf16 the algorithm is stated (bf16 inputs, f32 accumulation), so autodiff's transposed products, whose
  cotangent is float32, also round their inputs to bf16 instead of running as float32 products.
  """
  algorithm = jax.lax.DotAlgorithmPreset.BF16_BF16_F32 if jnp.dtype(dtype) == jnp.bfloat16 else None
  return jnp.einsum(spec, x.astype(dtype), y.astype(dtype), precision=algorithm, preferred_element_type=jnp.float32)


# Initialisers of the reference implementations (tensor2tensor, fairseq, torch).
xavier_uniform = nn.initializers.xavier_uniform()
zeros = nn.initializers.zeros_init()
ones = nn.initializers.ones_init()


def projection_init(batch_axes: tuple[int, ...] = ()):
  """Xavier-uniform over a [e, ..., h, d] kernel, each stacked projection on its own (fan in e, fan out h*d)."""
  ndim_out_start = 1 + len(batch_axes)
  return nn.initializers.variance_scaling(
      1.0, 'fan_avg', 'uniform', in_axis=0,
      out_axis=(ndim_out_start, ndim_out_start + 1), batch_axis=batch_axes)


def sinusoidal_positions(max_positions: int, d_model: int) -> np.ndarray:
  """§3.5: PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(same). Returns [max_positions, d_model]."""
  position = np.arange(max_positions)[:, None]  # [max_positions, 1]
  div_term = np.power(10000.0, np.arange(0, d_model, 2) / d_model)  # [d_model/2]
  table = np.zeros((max_positions, d_model), dtype=np.float32)  # [max_positions, d_model]
  table[:, 0::2] = np.sin(position / div_term)
  table[:, 1::2] = np.cos(position / div_term)
  return table


class Embeddings(nn.Module):
  """§3.4: a [vocab, d_model] matrix, looked up and multiplied by √d_model; `attend` is the pre-softmax projection."""
  vocab_size: int
  d_model: int
  dtype: Dtype = jnp.float32

  def setup(self):
    self.embedding = self.param(
        'embedding',
        nn.with_logical_partitioning(nn.initializers.normal(self.d_model**-0.5), ('vocab', 'embed')),
        (self.vocab_size, self.d_model), jnp.float32)

  def __call__(self, ids: jax.Array) -> jax.Array:
    """ids [b, l] int32 -> [b, l, e], scaled by √d_model."""
    embedded = jnp.take(self.embedding, ids, axis=0)  # [b, l, e]
    return embedded * jnp.sqrt(self.d_model)  # float32: the residual stream stays float32 (see LayerNorm)

  def attend(self, x: jax.Array) -> jax.Array:
    """x [b, l, e] -> logits [b, l, v] with the same (transposed) matrix: the product runs in the compute
    dtype, accumulated and returned in float32 (bf16 logits, 3 significant digits, would blur the small
    differences the loss is made of)."""
    return float32_accumulating_einsum('ble,ve->blv', x, self.embedding, self.dtype)  # [b, l, v]


class OutputProjection(nn.Module):
  """The pre-softmax linear map when embeddings are not shared (no bias, as in the paper)."""
  vocab_size: int
  d_model: int
  dtype: Dtype = jnp.float32

  def setup(self):
    self.kernel = self.param('kernel', nn.with_logical_partitioning(xavier_uniform, ('embed', 'vocab')),
                             (self.d_model, self.vocab_size), jnp.float32)

  def __call__(self, x: jax.Array) -> jax.Array:
    return float32_accumulating_einsum('ble,ev->blv', x, self.kernel, self.dtype)  # [b, l, v] float32, as attend


class PositionalEncoding(nn.Module):
  """§3.5: adds sinusoidal (default) or learned (Table 3 row E) positions to [b, l, e] embeddings."""
  max_positions: int
  d_model: int
  learned: bool = False

  @nn.compact
  def __call__(self, x: jax.Array, offset: jax.Array | int = 0) -> jax.Array:
    """x [b, l, e]; `offset` is the first position, or [b] each row's (the decode steps, one token at a time)."""
    length = x.shape[1]
    if self.learned:
      table = self.param('position_embedding',
                         nn.with_logical_partitioning(nn.initializers.normal(self.d_model**-0.5), (None, 'embed')),
                         (self.max_positions, self.d_model), jnp.float32)
    else:
      table = jnp.asarray(sinusoidal_positions(self.max_positions, self.d_model))  # [max_positions, e]
    if jnp.ndim(offset):  # one token a row, each at its own position
      return x + jnp.take(table, jnp.minimum(offset, self.max_positions - 1), axis=0)[:, None].astype(x.dtype)
    positions = jax.lax.dynamic_slice_in_dim(table, offset, length, axis=0)  # [l, e]
    return x + positions[None].astype(x.dtype)  # [b, l, e]


def _fmix32(x: jax.Array) -> jax.Array:
  """MurmurHash3's 32-bit finaliser: a bijection on uint32 whose output bits each depend on every input bit."""
  x = x ^ (x >> 16)
  x = x * jnp.uint32(0x85EBCA6B)
  x = x ^ (x >> 13)
  x = x * jnp.uint32(0xC2B2AE35)
  return x ^ (x >> 16)


def dropout_keep_mask(rng: jax.Array, rate: float, shape: tuple[int, ...], dropout_masks: str = 'hash') -> jax.Array:
  """Boolean [shape] mask that keeps each element with probability 1 - rate.

  dropout_masks 'random': jax.random.bernoulli (the key's own generator: rbg/threefry bits per element).
  dropout_masks 'hash': one 32-bit seed is drawn from `rng`; element i keeps iff fmix32(fmix32(i ^ seed) + seed)
  >= rate·2³². This is a counter-based generator in the style of Philox/Threefry but with 2 cheap rounds:
  it is an elementwise function of the index, so XLA fuses it into the op that applies the mask (no
  [shape] array of random bits is materialised), and under SPMD each device hashes its own global
  indices, so sharded masks equal single-device masks. Its speed: docs/performance.md (tools/ablation.py).
  """
  if dropout_masks == 'random':
    return jax.random.bernoulli(rng, 1.0 - rate, shape)
  if dropout_masks != 'hash':
    raise ValueError(f'unknown dropout_masks {dropout_masks!r}')
  seed = jax.random.bits(rng, (), jnp.uint32)
  index = jnp.zeros(shape, jnp.uint32)
  stride = 1
  for axis in reversed(range(len(shape))):  # Row-major flat index of every element.
    index = index + jax.lax.broadcasted_iota(jnp.uint32, shape, axis) * jnp.uint32(stride % 2**32)
    stride *= shape[axis]
  bits = _fmix32(_fmix32(index ^ seed) + seed)
  threshold = min(int(round(rate * 2**32)), 2**32 - 1)
  return bits >= jnp.uint32(threshold)


class Dropout(nn.Module):
  """Inverted dropout (§5.4) drawing its mask with `dropout_keep_mask` from the 'dropout' rng stream."""
  rate: float
  dropout_masks: str = 'hash'  # See dropout_keep_mask.

  @nn.compact
  def __call__(self, x: jax.Array, deterministic: bool) -> jax.Array:
    if deterministic or self.rate == 0.0:
      return x
    keep = dropout_keep_mask(self.make_rng('dropout'), self.rate, x.shape, self.dropout_masks)
    return jnp.where(keep, x / jnp.asarray(1.0 - self.rate, x.dtype), jnp.zeros((), x.dtype))


class PositionwiseFeedForward(nn.Module):
  """§3.3: FFN(x) = max(0, xW1 + b1)W2 + b2."""
  d_model: int
  d_ff: int
  dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    """x [b, l, e] -> [b, l, e]."""
    w1 = self.param('wi_kernel', nn.with_logical_partitioning(xavier_uniform, ('embed', 'mlp')),
                    (self.d_model, self.d_ff), jnp.float32)
    b1 = self.param('wi_bias', nn.with_logical_partitioning(zeros, ('mlp',)), (self.d_ff,), jnp.float32)
    w2 = self.param('wo_kernel', nn.with_logical_partitioning(xavier_uniform, ('mlp', 'embed')),
                    (self.d_ff, self.d_model), jnp.float32)
    b2 = self.param('wo_bias', nn.with_logical_partitioning(zeros, ('embed',)), (self.d_model,), jnp.float32)
    hidden = jax.nn.relu(jnp.einsum('ble,ef->blf', x.astype(self.dtype), w1.astype(self.dtype))
                         + b1.astype(self.dtype))  # [b, l, f]
    hidden = nn.with_logical_constraint(hidden, ('batch', 'length', 'mlp'))
    return jnp.einsum('blf,fe->ble', hidden, w2.astype(self.dtype)) + b2.astype(self.dtype)  # [b, l, e]


class LayerNorm(nn.Module):
  """Layer normalisation (Ba et al., 2016) over d_model, in float32.

  With dtype=bfloat16 only the matrix products run in bf16 (each projection casts its input); the
  residual stream, normalisation, softmax and loss stay float32, as automatic mixed precision does.
  """
  epsilon: float = 1e-6

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    d = x.shape[-1]
    scale = self.param('scale', nn.with_logical_partitioning(ones, ('norm',)), (d,), jnp.float32)
    bias = self.param('bias', nn.with_logical_partitioning(zeros, ('norm',)), (d,), jnp.float32)
    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    var = jnp.square(x32 - mean).mean(-1, keepdims=True)
    return (x32 - mean) * jax.lax.rsqrt(var + self.epsilon) * scale + bias
