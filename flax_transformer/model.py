"""The Transformer of *Attention Is All You Need* (§3, Figure 1): the network only, no losses.

`Transformer(config).apply({'params': p}, inputs, targets)` returns logits whose position t
predicts `targets[:, t]`: the model shifts the targets right itself, with id 0 (the padding id)
as the start symbol. Incremental decoding: `memory`, `init_cache` and `insert`, then `decode_step` (see engine.py).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import linen as nn

from flax_transformer import attention, layers, platforms
from flax_transformer.constants import PAD_ID
from flax_transformer.errors import ConfigError

_DTYPES = {'float32': jnp.float32, 'bfloat16': jnp.bfloat16}


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  """The architecture (§3, Table 3). Defaults are the paper's base model."""
  vocab_size: int = 37000
  d_model: int = 512
  num_heads: int = 8
  d_ff: int = 2048
  num_encoder_layers: int = 6
  num_decoder_layers: int = 6
  dropout_rate: float = 0.1  # §5.4 P_drop, on sub-layer outputs and embedding + position sums.
  attention_dropout_rate: float = 0.0  # The paper has none; tensor2tensor later added it.
  # 'hash' (fused counter-based masks) or 'random' (jax.random.bernoulli); a run config's 'auto' is made by settings.py.
  dropout_masks: str = dataclasses.field(default='hash', metadata={'before': 'auto'})
  # 'xla' or 'cudnn' (jax.nn.dot_product_attention), 'explicit' (layers.py); 'auto' as dropout_masks.
  attention: str = dataclasses.field(default='xla', metadata={'before': 'auto'})
  pre_norm: bool = False  # False: Post-LN, LayerNorm(x + Dropout(Sublayer(x))) as in §3.1.
  learned_positions: bool = False  # Table 3 row E.
  share_embeddings: bool = True  # §3.4: one matrix for source, target and pre-softmax.
  max_positions: int = 512  # Rows of the position table: longest source or output handled.
  dtype: str = 'float32'  # Compute dtype; parameters stay float32.
  layer_norm_epsilon: float = 1e-6
  # Layers per scan iteration: 1 compiles fastest; N (all) runs fastest on CPU.
  scan_unroll: int = dataclasses.field(default=1, metadata={'before': 1})

  def __post_init__(self):
    def fail(field, why):
      raise ConfigError(f'config.model.{field}={getattr(self, field)!r}: {why}')
    if self.vocab_size < 4:
      fail('vocab_size', 'needs at least 4 ids (pad, eos, unk and one more)')
    for field in ('d_model', 'num_heads', 'd_ff', 'max_positions', 'num_encoder_layers', 'num_decoder_layers', 'scan_unroll'):
      if not isinstance(getattr(self, field), int) or getattr(self, field) < 1:
        fail(field, 'must be a positive integer')
    if self.d_model % self.num_heads:
      fail('d_model', f'is not divisible by config.model.num_heads={self.num_heads}')
    if self.d_model % 2 and not self.learned_positions:
      fail('d_model', 'must be even for sinusoidal positions')
    for field in ('dropout_rate', 'attention_dropout_rate'):
      if not 0.0 <= getattr(self, field) < 1.0:
        fail(field, 'must be in [0, 1)')
    if self.dtype not in _DTYPES:
      fail('dtype', f'unknown value; use one of {sorted(_DTYPES)}')
    for field, choices in (('dropout_masks', platforms.DROPOUT_MASKS), ('attention', platforms.ATTENTION)):
      if getattr(self, field) not in choices:  # 'auto' is made by settings.model_settings for a platform
        fail(field, f"unknown value; use one of {', '.join(choices)}, or 'auto' in a run config")
    for field in ('pre_norm', 'learned_positions', 'share_embeddings'):
      if not isinstance(getattr(self, field), bool):
        fail(field, 'must be True or False')

  @property
  def compute_dtype(self):
    return _DTYPES[self.dtype]


class SublayerConnection(nn.Module):
  """§5.4 residual dropout around a sub-layer, with Post-LN (paper) or Pre-LN placement."""
  config: TransformerConfig

  def setup(self):
    self.norm = layers.LayerNorm(self.config.layer_norm_epsilon)
    self.dropout = layers.Dropout(self.config.dropout_rate, self.config.dropout_masks)

  def __call__(self, x, sublayer, deterministic):
    """x [b, l, e]; sublayer: [b, l, e] -> [b, l, e]."""
    if self.config.pre_norm:
      return x + self.dropout(sublayer(self.norm(x)), deterministic=deterministic)
    return self.norm(x + self.dropout(sublayer(x), deterministic=deterministic))


class EncoderLayer(nn.Module):
  """§3.1 encoder layer: self-attention, then the feed-forward network."""
  config: TransformerConfig

  def setup(self):
    c = self.config
    self.self_attention = attention.MultiHeadAttention(c.num_heads, c.d_model, True, c.attention_dropout_rate,
                                                    c.compute_dtype, c.dropout_masks, c.attention)
    self.feed_forward = layers.PositionwiseFeedForward(c.d_model, c.d_ff, c.compute_dtype)
    self.attention_sublayer = SublayerConnection(c)
    self.feed_forward_sublayer = SublayerConnection(c)

  def __call__(self, x, lengths, deterministic):
    """x [b, l, e], lengths [b] (real tokens per row) -> ([b, l, e], None): the (carry, output) pair nn.scan expects."""
    x = self.attention_sublayer(x, lambda y: self.self_attention(y, lengths, deterministic=deterministic),
                                deterministic)
    return self.feed_forward_sublayer(x, self.feed_forward, deterministic), None


class DecoderLayer(nn.Module):
  """§3.1 decoder layer: masked self-attention, encoder-decoder attention, feed-forward network."""
  config: TransformerConfig

  def setup(self):
    c = self.config
    self.self_attention = attention.MultiHeadAttention(c.num_heads, c.d_model, True, c.attention_dropout_rate,
                                                    c.compute_dtype, c.dropout_masks, c.attention)
    self.cross_attention = attention.MultiHeadAttention(c.num_heads, c.d_model, False, c.attention_dropout_rate,
                                                     c.compute_dtype, c.dropout_masks, c.attention)
    self.feed_forward = layers.PositionwiseFeedForward(c.d_model, c.d_ff, c.compute_dtype)
    self.self_attention_sublayer = SublayerConnection(c)
    self.cross_attention_sublayer = SublayerConnection(c)
    self.feed_forward_sublayer = SublayerConnection(c)

  def __call__(self, y, memory, memory_lengths, deterministic):
    """y [b, t, e], memory [b, s, e], memory_lengths [b] (real source tokens) -> ([b, t, e], None)."""
    y = self.self_attention_sublayer(
        y, lambda z: self.self_attention(z, None, causal=True, deterministic=deterministic), deterministic)
    y = self.cross_attention_sublayer(
        y, lambda z: self.cross_attention(z, memory_lengths, memory, deterministic=deterministic), deterministic)
    return self.feed_forward_sublayer(y, self.feed_forward, deterministic), None

  def memory(self, memory):
    """memory [b, s, e] -> this layer's encoder-decoder attention cache (Transformer.memory)."""
    return self.cross_attention.memory(memory)

  def init_cache(self, cross, beam_size, max_output_length):
    """This layer's cache of slots holding `cross` (its memory) (layout: Transformer.init_cache)."""
    slots = cross['key'].shape[0]
    return {'self': self.self_attention.init_cache(slots, max_output_length, beam_size=beam_size), 'cross': cross}

  def decode_step(self, y, cache, steps, ancestry, memory_bias):
    """y [S·n, 1, e], steps [S], ancestry [S, n, L] (attention.ancestry_bias), memory_bias [S, 1, 1, s] ->
    ([S·n, 1, e], updated cache)."""
    new_cache = {}

    def self_attention(z):
      out, new_cache['self'] = self.self_attention.decode_step(z, cache['self'], steps, ancestry)
      return out

    def cross_attention(z):
      out, new_cache['cross'] = self.cross_attention.decode_step(z, cache['cross'], steps, memory_bias)
      return out

    y = self.self_attention_sublayer(y, self_attention, True)
    y = self.cross_attention_sublayer(y, cross_attention, True)
    return self.feed_forward_sublayer(y, self.feed_forward, True), new_cache


def _scanned(layer, model_config, in_axes, length):
  """`layer` run `length` times by nn.scan over parameters stacked on a leading 'layers' axis.

  XLA compiles one layer body instead of N copies (compile time grows superlinearly with N on CPU).
  """
  return nn.scan(layer, variable_axes={'params': 0, 'intermediates': 0}, split_rngs={'params': True, 'dropout': True},
                 in_axes=in_axes, length=length, metadata_params={nn.PARTITION_NAME: 'layers'},
                 unroll=model_config.scan_unroll)


def _layer_slice(index, variables):
  """Layer `index`'s slice of stacked variables (leaves [N, ...] -> [...])."""
  return jax.tree_util.tree_map(lambda x: x[index], nn.meta.unbox(variables))


class DecoderStack(nn.Module):
  """The N decoder layers, over one set of parameters stacked on a leading 'layers' axis.

  Teacher forcing runs them as one nn.scan. Incremental decoding runs them one after another, layer i
  reading its slice of the same parameters: inside the decoding loop a scan would copy every layer's
  cache in and out at each step. Both views share this module's scope, so the parameters live at
  'decoder/...' either way and everything sown lands in the model's collections.
  """
  config: TransformerConfig

  def setup(self):
    c = self.config
    self.stack = _scanned(DecoderLayer, c, (nn.broadcast,) * 3, c.num_decoder_layers)(c)
    self.layers = [nn.map_variables(DecoderLayer, 'params', trans_in_fn=functools.partial(_layer_slice, i),
                                    methods=['memory', 'init_cache', 'decode_step'])(c)
                   for i in range(c.num_decoder_layers)]
    for view in (self.stack, *self.layers):
      nn.share_scope(self, view)

  def __call__(self, y, memory, memory_lengths, deterministic):
    """Teacher-forced: y [b, t, e], memory [b, s, e], memory_lengths [b] -> [b, t, e]."""
    return self.stack(y, memory, memory_lengths, deterministic)[0]

  def memory(self, memory):
    """memory [b, s, e] -> each layer's encoder-decoder attention cache."""
    return tuple(layer.memory(memory) for layer in self.layers)

  def init_cache(self, crosses, beam_size, max_output_length):
    """Each layer's memory (from `memory`) -> one cache per layer (layout: Transformer.init_cache)."""
    return tuple(layer.init_cache(cross, beam_size, max_output_length) for layer, cross in zip(self.layers, crosses))

  def decode_step(self, y, caches, steps, ancestry, memory_bias):
    """y [S·n, 1, e], caches from init_cache, steps [S] -> ([S·n, 1, e], updated caches)."""
    new_caches = []
    for layer, cache in zip(self.layers, caches):
      y, cache = layer.decode_step(y, cache, steps, ancestry, memory_bias)
      new_caches.append(cache)
    return y, tuple(new_caches)


class Transformer(nn.Module):
  """Figure 1: encoder and decoder stacks with shared embeddings and a tied pre-softmax projection."""
  config: TransformerConfig

  def setup(self):
    c = self.config
    dtype = c.compute_dtype
    if c.share_embeddings:
      self.source_embedding = layers.Embeddings(c.vocab_size, c.d_model, dtype, name='shared_embedding')
      self.target_embedding = self.source_embedding
    else:
      self.source_embedding = layers.Embeddings(c.vocab_size, c.d_model, dtype)
      self.target_embedding = layers.Embeddings(c.vocab_size, c.d_model, dtype)
      self.output_projection = layers.OutputProjection(c.vocab_size, c.d_model, dtype)
    self.source_positions = layers.PositionalEncoding(c.max_positions, c.d_model, c.learned_positions)
    self.target_positions = (self.source_positions if not c.learned_positions
                             else layers.PositionalEncoding(c.max_positions, c.d_model, True))
    self.embedding_dropout = layers.Dropout(c.dropout_rate, c.dropout_masks)
    self.encoder = _scanned(EncoderLayer, c, (nn.broadcast, nn.broadcast), c.num_encoder_layers)(c, name='encoder')
    self.decoder = DecoderStack(c)
    if c.pre_norm:  # Pre-LN needs a final normalisation of each stack's output.
      self.encoder_norm = layers.LayerNorm(c.layer_norm_epsilon)
      self.decoder_norm = layers.LayerNorm(c.layer_norm_epsilon)

  def _embed(self, ids, embedding, positions, deterministic, offset=0):
    x = positions(embedding(ids), offset)  # [b, l, e]
    x = self.embedding_dropout(x, deterministic=deterministic)
    return nn.with_logical_constraint(x, ('batch', 'length', 'embed'))

  def _features(self, y):
    """Decoder stack output [b, t, e] -> what the pre-softmax projection sees (Pre-LN: normalised)."""
    return self.decoder_norm(y) if self.config.pre_norm else y

  def _logits(self, y):
    """Decoder stack output [b, t, e] -> logits [b, t, v]."""
    y = self._features(y)
    if self.config.share_embeddings:
      logits = self.target_embedding.attend(y)
    else:
      logits = self.output_projection(y)
    return nn.with_logical_constraint(logits, ('batch', 'length', 'vocab'))

  def output_weight(self) -> jax.Array:
    """The pre-softmax projection as a [v, e] matrix: logits = features @ output_weight()ᵀ."""
    if self.config.share_embeddings:
      return self.target_embedding.embedding
    return self.output_projection.kernel.T

  def features(self, inputs: jax.Array, targets: jax.Array, deterministic: bool = True) -> jax.Array:
    """Like __call__ but stops before the pre-softmax projection: [b, t, e] (for a fused loss)."""
    return self._features(self._decoder_stack(self.encode(inputs, deterministic), inputs, targets, deterministic))

  def encode(self, inputs: jax.Array, deterministic: bool = True) -> jax.Array:
    """inputs [b, s] int32 (0 = padding) -> encoder output [b, s, e]."""
    x = self._embed(inputs, self.source_embedding, self.source_positions, deterministic)
    x, _ = self.encoder(x, attention.key_lengths(inputs), deterministic)
    if self.config.pre_norm:
      x = self.encoder_norm(x)
    return x

  def _decoder_stack(self, encoded, inputs, targets, deterministic):
    """Teacher-forced decoder stack: encoded [b, s, e], inputs [b, s], targets [b, t] -> [b, t, e]."""
    decoder_inputs = jnp.pad(targets, ((0, 0), (1, 0)), constant_values=PAD_ID)[:, :-1]  # [b, t] shifted right
    y = self._embed(decoder_inputs, self.target_embedding, self.target_positions, deterministic)
    return self.decoder(y, encoded, attention.key_lengths(inputs), deterministic)

  def decode(self, encoded: jax.Array, inputs: jax.Array, targets: jax.Array, deterministic: bool = True) -> jax.Array:
    """Teacher-forced decoder: encoded [b, s, e], inputs [b, s], targets [b, t] -> logits [b, t, v]."""
    return self._logits(self._decoder_stack(encoded, inputs, targets, deterministic))

  def __call__(self, inputs: jax.Array, targets: jax.Array, deterministic: bool = True) -> jax.Array:
    """inputs [b, s], targets [b, t] int32 (0 = padding) -> logits [b, t, v]; position t predicts targets[:, t]."""
    return self.decode(self.encode(inputs, deterministic), inputs, targets, deterministic)

  # --- Incremental decoding ------------------------------------------------------------

  def memory(self, inputs: jax.Array) -> dict:
    """What a decoding slot keeps of its sentence: inputs [b, s] int32 (0 = padding) encoded and projected to
    each decoder layer's encoder-decoder keys and values, once per sentence: {'lengths': [b] real source tokens
    (attention.key_lengths), 'layers': one {'key' [b, h, d, s], 'value' [b, h, s, d]} per decoder layer}."""
    return {'lengths': attention.key_lengths(inputs), 'layers': self.decoder.memory(self.encode(inputs))}

  def init_cache(self, memory: dict, beam_size: int, max_output_length: int) -> dict:
    """The decoding cache of S slots, each one sentence (of `memory`, [S, ...]) decoded with `beam_size`
    hypotheses for up to `max_output_length` steps, each slot at its own step.

    L is max_output_length rounded up to whole chunks of the self-attention's reads (attention.cache_steps).
    Returns {'lengths': [S], 'ancestry': [S, n, L] int32 (attention.ancestry_bias), 'layers': one dict per decoder
    layer, each {'self': {'key' [L/C, S, h, d, C·n], 'value' [L/C, S, h, C·n, d]}, 'cross': {'key' [S, h, d, s],
    'value' [S, h, s, d]}}}. The self-attention cache is flat: each hypothesis writes its keys and values at
    step t into slot t·n + its beam index, in place, and they never move; a reordered beam changes only the
    ancestry table, through which each hypothesis reads its own prefix. It is held in chunks of C steps
    (attention.chunked_cache), the chunk index outermost, so a step reads the chunks written so far as contiguous
    blocks. Keys with d before positions, so each step's products are matrix products without transposes;
    separate per-layer buffers (not one stacked array) let each step update them in place. A slot's entries of
    steps after its own are never read (ancestry_bias), so a new sentence needs only its memory (`insert`).
    """
    slots = memory['lengths'].shape[0]
    return {'lengths': memory['lengths'],
            'ancestry': jnp.zeros((slots, beam_size, attention.cache_steps(max_output_length, beam_size)), jnp.int32),
            'layers': self.decoder.init_cache(memory['layers'], beam_size, max_output_length)}

  @staticmethod
  def insert(cache: dict, memory: dict, rows: jax.Array) -> dict:
    """The cache with slots `rows` [P] holding the sentences of `memory` ([P, ...], from `memory`, of sources
    up to the cache's length: the rest is padding, hidden by the lengths); a row index of S (a padding row) is
    left out."""
    def put(tree, new):
      def padded(x, y):  # y's source axis (the one that differs) padded with zeros to x's; rows as they are
        return jnp.pad(y, [(0, 0)] + [(0, a - b) for a, b in zip(x.shape[1:], y.shape[1:])])
      return jax.tree_util.tree_map(lambda x, y: x.at[rows].set(padded(x, y), mode='drop'), tree, new)
    return {**cache, 'lengths': put(cache['lengths'], memory['lengths']),
            'layers': tuple({**layer, 'cross': put(layer['cross'], cross)}
                            for layer, cross in zip(cache['layers'], memory['layers']))}

  @staticmethod
  def reorder_cache(cache: dict, rows: jax.Array) -> dict:
    """Beam reordering: hypothesis j continues the hypothesis of row rows[j] ([S·n] int32, rows of its own
    slot): it takes that hypothesis's ancestry (which slots it reads); no key or value is copied."""
    slots, n, length = cache['ancestry'].shape
    ancestry = cache['ancestry'].reshape(slots * n, length)[rows].reshape(slots, n, length)
    return {**cache, 'ancestry': ancestry}

  def decode_step(self, ids: jax.Array, cache: dict, steps: jax.Array) -> tuple[jax.Array, dict]:
    """ids [S·n, 1] (each hypothesis's previous token), steps [S] (each slot's position) -> (logits [S·n, v],
    cache)."""
    slots, n, length = cache['ancestry'].shape
    steps = jnp.minimum(jnp.broadcast_to(steps, (slots,)), length - 1)  # a done slot stays within its cache
    ancestry = cache['ancestry'].at[jnp.arange(slots), :, steps].set(jnp.arange(n, dtype=jnp.int32))  # own slot now
    source_length = cache['layers'][0]['cross']['key'].shape[-1]
    memory_bias = attention.attention_bias(1, source_length, cache['lengths'], causal=False)  # [S, 1, 1, s]
    y = self._embed(ids, self.target_embedding, self.target_positions, True, jnp.repeat(steps, n))  # [Sn, 1, e]
    y, layer_caches = self.decoder.decode_step(y, cache['layers'], steps, ancestry, memory_bias)
    return self._logits(y)[:, 0], {**cache, 'ancestry': ancestry, 'layers': layer_caches}
