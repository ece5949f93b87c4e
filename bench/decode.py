"""Decoding speed: our KV-cache beam search and greedy search vs a decoder that re-runs the whole prefix, and
vs the same weights exported to CTranslate2 (float32 and int8; skipped when ctranslate2 is not installed).

python bench/decode.py   (tiny shape: vocab 8192, d_model 256, 3+3 layers, 4 heads, d_ff 1024, random weights,
64 sources of 20 tokens, exactly 40 generated tokens per sentence, EOS disabled)
Prints a markdown table (with each decoder's model GFLOP/s as a fraction of the same run's 2048³ matmul, and the
sentences/s it would reach at that peak); the last line is one JSON object.
"""

import functools
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.train_step import matmul_peak  # noqa: E402
from configs import base  # noqa: E402
from flax_transformer import search, settings  # noqa: E402
from flax_transformer.constants import EOS_ID  # noqa: E402
from flax_transformer.model import Transformer, TransformerConfig  # noqa: E402

BATCH, SOURCE_LENGTH, OUTPUT_LENGTH = 64, 20, 40
CONFIG = TransformerConfig(vocab_size=8192, d_model=256, num_heads=4, d_ff=1024, num_encoder_layers=3,
                           num_decoder_layers=3, dropout_rate=0.1, max_positions=128)
TOP_K = settings.resolve(base.get_config()).decode.beam_top_k  # the beam's top-k as a run here would choose it


def no_eos(tokens_to_logits):
  def wrapped(ids, cache):
    logits, cache = tokens_to_logits(ids, cache)
    return logits.at[:, EOS_ID].set(-1e9), cache
  return wrapped


def cached(params, inputs, model, beam_size, output_length=OUTPUT_LENGTH):
  """Our decoder: KV cache, encoder keys/values once per sentence; exactly `output_length` tokens."""
  encoded = model.apply({'params': params}, inputs, method=model.encode)
  cache = model.apply({'params': params}, encoded, beam_size, output_length, method=model.init_cache)
  step = lambda ids, c: model.apply({'params': params}, ids, inputs, c, method=model.decode_step)
  lengths = jnp.full((inputs.shape[0],), output_length)
  if beam_size == 1:
    return search.greedy_search(no_eos(step), cache, inputs.shape[0], lengths, output_length)[0]
  return search.beam_search(no_eos(step), cache, inputs.shape[0], lengths, output_length, beam_size,
                            reorder_cache=type(model).reorder_cache, beam_top_k=TOP_K)[0]


def uncached(params, inputs, model, beam_size):
  """Baseline: every step re-runs the decoder over the whole (fixed-size) prefix; no cache."""
  encoded = model.apply({'params': params}, inputs, method=model.encode)
  encoded_n = jnp.repeat(encoded, beam_size, axis=0)
  inputs_n = jnp.repeat(inputs, beam_size, axis=0)

  def step(ids, c):
    prefix = jax.lax.dynamic_update_slice(c['prefix'], ids, (0, c['step']))  # [bn, L]: previous tokens so far
    logits = model.apply({'params': params}, encoded_n, inputs_n, jnp.roll(prefix, -1, axis=1),
                         method=model.decode)  # targets shifted back so decoder input == prefix
    return jnp.take(logits, c['step'], axis=1), {'prefix': prefix, 'step': c['step'] + 1}

  cache = {'prefix': jnp.zeros((inputs.shape[0] * beam_size, OUTPUT_LENGTH), jnp.int32), 'step': jnp.array(0)}
  lengths = jnp.full((inputs.shape[0],), OUTPUT_LENGTH)
  return search.beam_search(no_eos(step), cache, inputs.shape[0], lengths, OUTPUT_LENGTH, beam_size,
                            beam_top_k=TOP_K)[0]


def decode_flops(beam_size: int, c: TransformerConfig = CONFIG) -> float:
  """Model FLOPs of one cached decoding of BATCH sources: the products a KV-cache decoder cannot avoid.

  Encoder once per sentence, the cross-attention keys/values once per sentence, then per hypothesis and step:
  self-attention q/k/v/o and cross-attention q/o projections, the feed-forward, attention over the prefix
  and the source, and the output projection over the whole vocabulary.
  """
  d, f, v, s = c.d_model, c.d_ff, c.vocab_size, SOURCE_LENGTH
  encoder = BATCH * (s * c.num_encoder_layers * (4 * d * d + 2 * d * f) + c.num_encoder_layers * 2 * s * s * d)
  cross_keys_values = BATCH * s * c.num_decoder_layers * 2 * d * d
  per_step = [c.num_decoder_layers * (6 * d * d + 2 * d * f + 2 * d * (i + 1 + s)) + v * d
              for i in range(OUTPUT_LENGTH)]
  return 2.0 * (encoder + cross_keys_values + BATCH * beam_size * sum(per_step))


def ctranslate2_runs(params, inputs, directory):
  """CTranslate2 translators of the same weights (flax_transformer.export), timed on the same sources with
  exactly OUTPUT_LENGTH tokens (EOS is allowed only at the limit), one thread per core: name -> function."""
  try:
    import ctranslate2
  except ImportError:
    return {}
  from flax_transformer import export
  pieces = ['<pad>', '</s>', '<unk>'] + [f'w{i}' for i in range(3, CONFIG.vocab_size)]
  sources = [[pieces[i] for i in row] for row in np.asarray(inputs)]
  runs = {}
  for quantization in ('float32', 'int8'):
    spec = export.model_spec(jax.device_get(params), CONFIG, pieces)
    spec.validate()
    spec.optimize(quantization=None if quantization == 'float32' else quantization)
    path = os.path.join(directory, quantization)
    os.makedirs(path)
    spec.save(path)
    translator = ctranslate2.Translator(path, device='cpu', compute_type='default', inter_threads=1,
                                        intra_threads=os.cpu_count())
    for beam in (4, 1):
      runs[f'{"beam 4" if beam == 4 else "greedy"}, CTranslate2 {ctranslate2.__version__} {quantization}'] = (
          functools.partial(translator.translate_batch, sources, beam_size=beam, max_batch_size=BATCH,
                            min_decoding_length=OUTPUT_LENGTH, max_decoding_length=OUTPUT_LENGTH), beam)
  return runs


def time_it(fn, *args, repeats=5):
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def main():
  model = Transformer(CONFIG)
  rng = np.random.default_rng(0)
  inputs = jnp.asarray(rng.integers(3, CONFIG.vocab_size, (BATCH, SOURCE_LENGTH)), jnp.int32)
  params = nn.meta.unbox(model.init(jax.random.key(0), inputs[:1], inputs[:1])['params'])
  runs = {
      'beam 4, KV cache (ours)': jax.jit(functools.partial(cached, model=model, beam_size=4)),
      'greedy, KV cache (ours)': jax.jit(functools.partial(cached, model=model, beam_size=1)),
      'beam 4, no cache (re-run prefix)': jax.jit(functools.partial(uncached, model=model, beam_size=4)),
  }
  tokens = np.asarray(runs['beam 4, KV cache (ours)'](params, inputs))
  assert (tokens > 0).sum(1).min() == OUTPUT_LENGTH, 'every sentence must produce exactly 40 tokens'
  same = np.mean(np.all(tokens == np.asarray(runs['beam 4, no cache (re-run prefix)'](params, inputs)), axis=1))
  seconds = {name: time_it(fn, params, inputs, repeats=3 if 'no cache' in name else 5) for name, fn in runs.items()}
  beams = {name: 1 if 'greedy' in name else 4 for name in runs}
  import tempfile
  with tempfile.TemporaryDirectory() as directory:
    for name, (fn, beam) in ctranslate2_runs(params, inputs, directory).items():
      seconds[name], beams[name] = time_it(fn), beam
  peak = matmul_peak(jax, jnp)
  print(f'matmul peak {peak:.0f} GFLOP/s (2048³ float32 jit, this run); model FLOPs per {BATCH} sentences: '
        f'{decode_flops(4) / 1e9:.1f} G at beam 4, {decode_flops(1) / 1e9:.1f} G greedy\n')
  print('| decoder | sentences/s | µs per generated token | model GFLOP/s | fraction of matmul peak | '
        'sentences/s at the peak |\n|---|---|---|---|---|---|')
  for name, s in seconds.items():
    gflops = decode_flops(beams[name]) / s / 1e9
    print(f'| {name} | {BATCH / s:,.1f} | {s / (BATCH * OUTPUT_LENGTH) * 1e6:,.1f} | {gflops:.0f} | '
          f'{gflops / peak:.2f} | {BATCH * peak * 1e9 / decode_flops(beams[name]):,.0f} |')
  beam, greedy, nocache = (BATCH / seconds[k] for k in runs)
  print(f'| cache speed-up at beam 4 | {beam / nocache:.1f}× | | | | |')
  for name in seconds:
    if 'CTranslate2' in name and 'float32' in name:
      ours = beam if name.startswith('beam') else greedy
      print(f'| ours / {name} | {ours / (BATCH / seconds[name]):.2f}× | | | | |')
  print(f'\nbeam 4 with and without the cache give the same output for {same:.0%} of the sentences')
  print(json.dumps({'beam4_sentences_per_second': round(beam, 1), 'greedy_sentences_per_second': round(greedy, 1),
                    'nocache_beam4_sentences_per_second': round(nocache, 1), 'matmul_gflops': round(peak, 1)}))


if __name__ == '__main__':
  main()
