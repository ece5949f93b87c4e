"""The network against torch.nn.Transformer with the same weights, and its structural invariants."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import linen as nn

from configs import base, big
from flax_transformer import settings
from flax_transformer import layers, partitioning
from flax_transformer.model import Transformer, TransformerConfig
from tests.conftest import random_batch


def _t(x):
  return torch.tensor(np.asarray(x), dtype=torch.float32)


def _copy_norm(torch_norm, params):
  torch_norm.weight.data = _t(params['scale'])
  torch_norm.bias.data = _t(params['bias'])


def _copy_self_attention(torch_attn, p, d):
  torch_attn.in_proj_weight.data = _t(np.asarray(p['qkv_kernel']).reshape(d, 3 * d).T)
  torch_attn.in_proj_bias.data = _t(np.asarray(p['qkv_bias']).reshape(3 * d))
  torch_attn.out_proj.weight.data = _t(np.asarray(p['out_kernel']).reshape(d, d).T)
  torch_attn.out_proj.bias.data = _t(p['out_bias'])


def _copy_cross_attention(torch_attn, p, d):
  q = np.asarray(p['q_kernel']).reshape(d, d).T
  kv = np.asarray(p['kv_kernel']).reshape(d, 2 * d).T
  torch_attn.in_proj_weight.data = _t(np.concatenate([q, kv], axis=0))
  torch_attn.in_proj_bias.data = _t(np.concatenate([np.asarray(p['q_bias']).reshape(d),
                                                    np.asarray(p['kv_bias']).reshape(2 * d)]))
  torch_attn.out_proj.weight.data = _t(np.asarray(p['out_kernel']).reshape(d, d).T)
  torch_attn.out_proj.bias.data = _t(p['out_bias'])


def _copy_ffn(torch_layer, p):
  torch_layer.linear1.weight.data = _t(np.asarray(p['wi_kernel']).T)
  torch_layer.linear1.bias.data = _t(p['wi_bias'])
  torch_layer.linear2.weight.data = _t(np.asarray(p['wo_kernel']).T)
  torch_layer.linear2.bias.data = _t(p['wo_bias'])


def torch_reference_logits(config: TransformerConfig, params, inputs, targets):
  """The same network built from torch.nn.Transformer, written independently of model.py."""
  d = config.d_model
  reference = torch.nn.Transformer(d_model=d, nhead=config.num_heads, num_encoder_layers=config.num_encoder_layers,
                                   num_decoder_layers=config.num_decoder_layers, dim_feedforward=config.d_ff,
                                   dropout=0.0, activation='relu', batch_first=True, norm_first=config.pre_norm,
                                   layer_norm_eps=config.layer_norm_epsilon)
  layer_params = lambda stack, i: jax.tree_util.tree_map(lambda x: np.asarray(x)[i], params[stack])  # scanned
  for i, layer in enumerate(reference.encoder.layers):
    p = layer_params('encoder', i)
    _copy_self_attention(layer.self_attn, p['self_attention'], d)
    _copy_ffn(layer, p['feed_forward'])
    _copy_norm(layer.norm1, p['attention_sublayer']['norm'])
    _copy_norm(layer.norm2, p['feed_forward_sublayer']['norm'])
  for i, layer in enumerate(reference.decoder.layers):
    p = layer_params('decoder', i)
    _copy_self_attention(layer.self_attn, p['self_attention'], d)
    _copy_cross_attention(layer.multihead_attn, p['cross_attention'], d)
    _copy_ffn(layer, p['feed_forward'])
    _copy_norm(layer.norm1, p['self_attention_sublayer']['norm'])
    _copy_norm(layer.norm2, p['cross_attention_sublayer']['norm'])
    _copy_norm(layer.norm3, p['feed_forward_sublayer']['norm'])
  if config.pre_norm:
    _copy_norm(reference.encoder.norm, params['encoder_norm'])
    _copy_norm(reference.decoder.norm, params['decoder_norm'])
  else:  # torch always adds a final stack norm; the paper's Post-LN has none.
    reference.encoder.norm = torch.nn.Identity()
    reference.decoder.norm = torch.nn.Identity()
  reference.eval()

  embedding = _t(params['shared_embedding']['embedding'])
  max_len = max(inputs.shape[1], targets.shape[1])
  position = torch.arange(max_len, dtype=torch.float64)[:, None]
  inv_freq = torch.exp(-math.log(10000.0) * torch.arange(0, d, 2, dtype=torch.float64) / d)
  table = torch.zeros(max_len, d, dtype=torch.float64)
  table[:, 0::2] = torch.sin(position * inv_freq)
  table[:, 1::2] = torch.cos(position * inv_freq)
  table = table.float()

  src = torch.tensor(np.asarray(inputs), dtype=torch.long)
  tgt = torch.tensor(np.asarray(targets), dtype=torch.long)
  tgt_in = torch.cat([torch.zeros_like(tgt[:, :1]), tgt[:, :-1]], dim=1)  # shift right, id 0 starts
  embed = lambda ids: embedding[ids] * math.sqrt(d) + table[:ids.shape[1]]
  with torch.no_grad():
    out = reference(embed(src), embed(tgt_in), src_key_padding_mask=src == 0, memory_key_padding_mask=src == 0,
                    tgt_mask=torch.nn.Transformer.generate_square_subsequent_mask(tgt.shape[1]), tgt_is_causal=True)
    return (out @ embedding.T).numpy()


@pytest.mark.parametrize('pre_norm', [False, True], ids=['post_ln', 'pre_ln'])
def test_logits_match_torch_transformer(small_model_config, np_rng, pre_norm):
  config = TransformerConfig(**{**small_model_config.__dict__, 'pre_norm': pre_norm})
  batch = random_batch(np_rng, 4, 9, 7, config.vocab_size)
  model = Transformer(config)
  params = nn.meta.unbox(jax.jit(model.init)(jax.random.key(1), batch['inputs'], batch['targets'])['params'])
  # At initialisation every bias is 0 and every LayerNorm is (1, 0); random values make their wiring count.
  leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
  params = jax.tree_util.tree_unflatten(treedef, [
      (value + np_rng.normal(0, 0.3, value.shape).astype(np.float32)
       if jax.tree_util.keystr(path).split("'")[-2].endswith(('bias', 'scale')) else value) for path, value in leaves])
  ours = np.asarray(jax.jit(model.apply)({'params': params}, batch['inputs'], batch['targets']))
  reference = torch_reference_logits(config, params, batch['inputs'], batch['targets'])
  real = batch['targets'] != 0
  error = np.abs(ours - reference)[real].max() / np.abs(reference[real]).max()
  print(f'max relative error vs torch ({"pre" if pre_norm else "post"}-LN): {error:.2e}')
  assert error <= 1e-4


def _count(config) -> int:
  tree = partitioning.abstract_params(settings.model_settings(config))
  return sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(nn.meta.unbox(tree)))


def test_parameter_counts_match_paper():
  base_count, big_count = _count(base.get_config()), _count(big.get_config())
  print(f'parameters with a 37,000-token vocabulary: base {base_count:,}, big {big_count:,}')
  assert abs(base_count / 65e6 - 1) <= 0.04
  assert abs(big_count / 213e6 - 1) <= 0.04


def test_decoder_is_causal(small_model_config, np_rng):
  batch = random_batch(np_rng, 2, 6, 8, small_model_config.vocab_size)
  model = Transformer(small_model_config)
  variables = jax.jit(model.init)(jax.random.key(0), batch['inputs'], batch['targets'])
  apply = jax.jit(model.apply)
  before = apply(variables, batch['inputs'], batch['targets'])
  t = 4
  changed = batch['targets'].copy()
  changed[:, t] = (changed[:, t] + 7) % small_model_config.vocab_size + 2
  after = apply(variables, batch['inputs'], changed)
  # Logits at position p depend on targets < p only (the model shifts right).
  np.testing.assert_array_equal(np.asarray(before[:, :t + 1]), np.asarray(after[:, :t + 1]))
  assert np.abs(np.asarray(before[:, t + 1:]) - np.asarray(after[:, t + 1:])).max() > 1e-4


def test_source_padding_is_ignored(small_model_config, np_rng):
  batch = random_batch(np_rng, 3, 6, 5, small_model_config.vocab_size)
  model = Transformer(small_model_config)
  variables = jax.jit(model.init)(jax.random.key(0), batch['inputs'], batch['targets'])
  apply = jax.jit(model.apply)
  logits = apply(variables, batch['inputs'], batch['targets'])
  padded = np.pad(batch['inputs'], ((0, 0), (0, 5)))
  logits_padded = apply(variables, padded, batch['targets'])
  np.testing.assert_allclose(np.asarray(logits), np.asarray(logits_padded), atol=1e-5, rtol=1e-5)


def test_unshared_embeddings_and_learned_positions_build(small_model_config, np_rng):
  config = TransformerConfig(**{**small_model_config.__dict__, 'share_embeddings': False, 'learned_positions': True})
  batch = random_batch(np_rng, 2, 5, 4, config.vocab_size)
  variables = jax.jit(Transformer(config).init)(jax.random.key(0), batch['inputs'], batch['targets'])
  names = set(variables['params'])
  assert {'source_embedding', 'target_embedding', 'output_projection'} <= names
  assert 'shared_embedding' not in names
  assert Transformer(config).apply(variables, batch['inputs'], batch['targets']).shape == (2, 4, config.vocab_size)


def test_initialisation_follows_reference_implementations(small_model_config):
  params = nn.meta.unbox(jax.jit(Transformer(small_model_config).init)(
      jax.random.key(0), jnp.ones((1, 1), jnp.int32), jnp.ones((1, 1), jnp.int32))['params'])
  d = small_model_config.d_model
  embedding = np.asarray(params['shared_embedding']['embedding'])
  assert abs(embedding.std() - d**-0.5) < 0.2 * d**-0.5  # N(0, d^-0.5)
  qkv = np.asarray(params['encoder']['self_attention']['qkv_kernel'][0])
  limit = math.sqrt(6.0 / (d + d))  # Xavier-uniform of each d×d projection
  assert np.abs(qkv).max() <= limit and np.abs(qkv).max() > 0.9 * limit
  assert not np.asarray(params['encoder']['self_attention']['qkv_bias']).any()
  assert qkv.shape == (d, 3, 4, d // 4)  # each layer's slice of the stacked [layers, ...] kernel


@pytest.mark.parametrize('field,value,message', [
    ('num_heads', 5, 'config.model.d_model=32: is not divisible by config.model.num_heads=5'),
    ('vocab_size', 3, 'config.model.vocab_size=3'),
    ('dtype', 'float16x', "config.model.dtype='float16x': unknown value"),
    ('pre_norm', 'yes', "config.model.pre_norm='yes'"),
    ('dropout_masks', 'philox', "config.model.dropout_masks='philox': unknown value"),
    ('attention', 'flash', "config.model.attention='flash': unknown value"),
])
def test_bad_configuration_is_a_one_line_error(small_model_config, field, value, message):
  with pytest.raises(ValueError) as error:
    TransformerConfig(**{**small_model_config.__dict__, field: value})
  assert message in str(error.value) and '\n' not in str(error.value)


def test_unknown_config_field_is_named():
  config = base.get_config()
  config.model.hidden_size = 3
  with pytest.raises(ValueError, match='config.model.hidden_size: unknown field'):
    settings.model_settings(config)


def test_dropout_sits_where_the_paper_puts_it(small_model_config, monkeypatch):
  """§5.4: dropout on each sub-layer's output before the residual add, and on the embedding + position sums
  of both stacks; none elsewhere (attention dropout is off by default)."""
  config = dataclasses.replace(small_model_config, dropout_rate=0.1)
  calls = []
  original = layers.Dropout.__call__

  def record(self, x, deterministic):
    calls.append(('/'.join(self.path), deterministic))
    return original(self, x, deterministic)

  model = Transformer(config)
  ids = np.ones((2, 5), np.int32)
  params = jax.jit(model.init)(jax.random.key(0), ids, ids)['params']
  monkeypatch.setattr(layers.Dropout, '__call__', record)
  model.apply({'params': params}, ids, ids, deterministic=False, rngs={'dropout': jax.random.key(1)})
  # The layer stacks are scanned: each layer's modules are traced once per layer.
  encoder = ['encoder/attention_sublayer/dropout', 'encoder/feed_forward_sublayer/dropout']
  decoder = ['decoder/self_attention_sublayer/dropout', 'decoder/cross_attention_sublayer/dropout',
             'decoder/feed_forward_sublayer/dropout']
  expected = (['embedding_dropout'] + encoder * config.num_encoder_layers
              + ['embedding_dropout'] + decoder * config.num_decoder_layers)
  assert [name for name, _ in calls] == expected
  assert not any(deterministic for _, deterministic in calls)


def test_model_with_library_attention_equals_written_out(small_model_config, np_rng):
  batch = random_batch(np_rng, 4, 9, 7, small_model_config.vocab_size)
  outputs = {}
  for attention in ('xla', 'explicit'):
    config = dataclasses.replace(small_model_config, attention=attention)
    model = Transformer(config)
    params = jax.jit(model.init)(jax.random.key(0), batch['inputs'], batch['targets'])['params']
    outputs[attention] = model.apply({'params': params}, batch['inputs'], batch['targets'])
  np.testing.assert_allclose(outputs['xla'], outputs['explicit'], atol=2e-5, rtol=2e-5)
