"""The model in CTranslate2's format, for serving: python -m flax_transformer export --workdir=DIR --output=CT2DIR

Writes the parameters (averaged as translate.py would take them, or --step) through CTranslate2's own
model specification (`ctranslate2.specs.TransformerSpec`), with the vocabulary, so that

    translator = ctranslate2.Translator(CT2DIR)
    translator.translate_batch([pieces + ['</s>']], beam_size=4, length_penalty=0.6)

runs the same network: Post-LN or Pre-LN, embeddings scaled by √d_model, this model's sinusoidal table
(written out: CTranslate2's own puts sines and cosines in halves, ours interleaves them), the tied
pre-softmax projection, and the decoder starting from <pad> (id 0, our start symbol). Our search never
emits <pad>; the export gives its logit a -1e4 bias so CTranslate2 never does either (which leaves the
other tokens' probabilities as they were, up to the negligible mass the model put on <pad>).
CTranslate2's length penalty divides by length^α rather than GNMT's ((5 + length) / 6)^α, so beam
results can differ slightly; greedy search gives the same tokens. `--quantization=int8` (or int8_float32,
int16, float16, ...) stores weights in that type. Needs the `serve` extra: pip install '.[serve]'.
The program: python -m flax_transformer export (commands/export.py).
"""

import numpy as np

from flax_transformer import storage
from flax_transformer.attention import without_key_bias
from flax_transformer.errors import UserError

POSITION_ROWS = 1024  # the shortest position table exported
PAD_BIAS = -1e4  # keeps CTranslate2 from emitting <pad>, as our search never does
QUANTIZATIONS = ('float32', 'int8', 'int8_float32', 'int8_float16', 'int8_bfloat16', 'int16', 'float16', 'bfloat16')


def _linear(spec, weight, bias):
  """A CTranslate2 linear layer: weight [out, in] (ours are [in, out]), bias [out]."""
  spec.weight = np.array(np.asarray(weight, np.float32).T, order="C")
  spec.bias = np.array(bias, np.float32)


def _layer_norm(spec, norm, i):
  spec.gamma = np.array(norm['scale'][i], np.float32)
  spec.beta = np.array(norm['bias'][i], np.float32)


def _attention(spec, params, i, self_attention: bool, d_model: int):
  """Our [e, (3|2), h, d] kernels -> CTranslate2's fused [(3|2)·e, e] linear layers (q, k, v stacked)."""
  if self_attention:
    kernel = params['qkv_kernel'][i]  # [e, 3, h, d]
    bias = without_key_bias(np.asarray(params['qkv_bias'][i]), 'qkv')  # [3, h, d], as the model
    _linear(spec.linear[0], np.reshape(kernel, (d_model, 3 * d_model)), bias.reshape(-1))
  else:
    _linear(spec.linear[0], np.reshape(params['q_kernel'][i], (d_model, d_model)), params['q_bias'][i].reshape(-1))
    bias = without_key_bias(np.asarray(params['kv_bias'][i]), 'kv')  # [2, h, d]
    _linear(spec.linear[1], np.reshape(params['kv_kernel'][i], (d_model, 2 * d_model)), bias.reshape(-1))
  _linear(spec.linear[-1], np.reshape(params['out_kernel'][i], (d_model, d_model)), params['out_bias'][i])


def model_spec(params, model_config, pieces: list[str]):
  """A ctranslate2 TransformerSpec holding `params` (numpy, our tree) and the vocabulary `pieces`."""
  from ctranslate2.specs import transformer_spec
  from flax_transformer import layers
  c = model_config
  if c.learned_positions:
    raise UserError('learned positions (config.model.learned_positions) are not exported; CTranslate2 '
                    'takes sinusoidal tables only')
  spec = transformer_spec.TransformerSpec.from_config((c.num_encoder_layers, c.num_decoder_layers), c.num_heads,
                                                      pre_norm=c.pre_norm)
  spec.config.layer_norm_epsilon = c.layer_norm_epsilon
  spec.config.add_source_eos = True  # our sources end with </s>
  spec.config.decoder_start_token = pieces[0]  # <pad>: the start symbol the model was trained with
  spec.config.bos_token = pieces[0]
  spec.config.eos_token = pieces[1]
  spec.config.unk_token = pieces[2]
  if c.share_embeddings:
    source_table = target_table = params['shared_embedding']['embedding']  # [v, e]
    output = np.array(source_table, np.float32)  # [v, e]: CTranslate2's [out, in]
  else:
    source_table, target_table = params['source_embedding']['embedding'], params['target_embedding']['embedding']
    output = np.array(np.asarray(params['output_projection']['kernel'], np.float32).T, order='C')
  # [rows, e]: at least CTranslate2's default output length of 256 (the sinusoids extend past max_positions as they are)
  positions = layers.sinusoidal_positions(max(c.max_positions, POSITION_ROWS), c.d_model)
  for stack_spec, table in ((spec.encoder, source_table), (spec.decoder, target_table)):
    embeddings = stack_spec.embeddings[0] if isinstance(stack_spec.embeddings, list) else stack_spec.embeddings
    embeddings.weight = np.array(table, np.float32)
    stack_spec.scale_embeddings = True
    stack_spec.position_encodings.encodings = positions
  pad_bias = np.zeros(c.vocab_size, np.float32)
  pad_bias[0] = PAD_BIAS
  spec.decoder.projection.weight = output
  spec.decoder.projection.bias = pad_bias
  if c.pre_norm:
    _layer_norm(spec.encoder.layer_norm, {k: v[None] for k, v in params['encoder_norm'].items()}, 0)
    _layer_norm(spec.decoder.layer_norm, {k: v[None] for k, v in params['decoder_norm'].items()}, 0)
  encoder, decoder = params['encoder'], params['decoder']
  for i, layer in enumerate(spec.encoder.layer):
    _attention(layer.self_attention, encoder['self_attention'], i, True, c.d_model)
    _layer_norm(layer.self_attention.layer_norm, encoder['attention_sublayer']['norm'], i)
    _feed_forward(layer.ffn, encoder, i)
  for i, layer in enumerate(spec.decoder.layer):
    _attention(layer.self_attention, decoder['self_attention'], i, True, c.d_model)
    _layer_norm(layer.self_attention.layer_norm, decoder['self_attention_sublayer']['norm'], i)
    _attention(layer.attention, decoder['cross_attention'], i, False, c.d_model)
    _layer_norm(layer.attention.layer_norm, decoder['cross_attention_sublayer']['norm'], i)
    _feed_forward(layer.ffn, decoder, i)
  spec.register_source_vocabulary(pieces)
  spec.register_target_vocabulary(pieces)
  return spec


def _feed_forward(spec, stack, i):
  _linear(spec.linear_0, stack['feed_forward']['wi_kernel'][i], stack['feed_forward']['wi_bias'][i])
  _linear(spec.linear_1, stack['feed_forward']['wo_kernel'][i], stack['feed_forward']['wo_bias'][i])
  _layer_norm(spec.layer_norm, stack['feed_forward_sublayer']['norm'], i)


def export(workdir: str, output: str, quantization: str = 'float32', step: int | None = None,
           average_last: int | None = None, overwrite: bool = False, checkpoint: str = 'last',
           weights: str = 'params') -> list[int]:
  """Writes the model of `workdir` to the CTranslate2 folder `output` (its weights chosen as Translator.from_workdir
  chooses them); returns the checkpoint steps used.

  `output` may not be, hold or sit inside the workdir; it is written beside and swapped in when complete
  (storage.staged_directory): never half-written, and a previous `output` is replaced only then.
  """
  try:
    import ctranslate2  # noqa: F401
  except ImportError:
    raise UserError('exporting needs CTranslate2; pip install ".[serve]" (or ctranslate2==4.8.5)') from None
  if quantization not in QUANTIZATIONS:
    raise UserError(f'--quantization={quantization} is not one CTranslate2 offers; use one of '
                    f'{", ".join(QUANTIZATIONS)}')
  if storage.is_url(output):
    raise UserError(f'--output={output}: CTranslate2 writes to a local folder; export there, then copy it')
  storage.check_output(f'--output={output}', output, {'the workdir': workdir})
  storage.check_replaceable('--output', output, overwrite)
  from flax_transformer.translator import Translator
  translator = Translator.from_workdir(workdir, step, average_last, checkpoint=checkpoint, weights=weights)
  import jax
  params = jax.device_get(translator.params)  # nested dicts of numpy arrays
  pieces = [translator.processor.id_to_piece(i) for i in range(translator.processor.get_piece_size())]
  spec = model_spec(params, translator.model_config, pieces)
  spec.validate()
  spec.optimize(quantization=None if quantization == 'float32' else quantization)
  with storage.staged_directory(output) as staging:
    spec.save(str(staging))
  return list(translator.checkpoints)


if __name__ == '__main__':  # the program is python -m flax_transformer export
  from flax_transformer.__main__ import moved
  moved('export', 'export')
