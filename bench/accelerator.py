"""Accelerator benchmark (run by bench/gpu.sh on a GPU): the paper's base and big train steps in float32 and
bfloat16, as a fraction of the same run's bf16 matmul peak, beside what the capacity plan
(flax_transformer/plan.py, compiled on CPU) predicts for the same step; and beam-4 decoding.

python bench/accelerator.py [--shapes base,big] [--dtypes float32,bfloat16] [--tokens 16384] [--steps 10]
python bench/accelerator.py --smoke   (tiny shapes and sizes: checks the script itself on a CPU in a minute)

Train steps: configs/base.py and configs/big.py (configs/tiny.py with --smoke) with batches of `--tokens` target
tokens (and as many source tokens) in sentences of 64 tokens, all real, dropout 0.1, Adam, label smoothing 0.1;
median of `--steps` steps after two warm-up steps. Model FLOPs: plan.analytic_flops. The plan's columns: its
step time at 40% of the measured bf16 peak, and its per-device memory (parameters + Adam + XLA:CPU's
temporaries) beside this device's compiler's. Decoding: beam 4, 128 random sources of 32 tokens, exactly 64 generated tokens each (EOS
disabled), random weights; and the decoding engine (engine.py) at beam 4 on 2,048 sources of newstest-like
lengths, each output as long as its source, at 64 and 512 slots. Prints markdown tables; the last line is one
JSON object.
"""

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SHAPES = {  # Table 3 of the paper (configs/base.py, configs/big.py); 'smoke' is configs/tiny.py.
    'base': dict(vocab=37000, d_model=512, layers=6, heads=8, d_ff=2048),
    'big': dict(vocab=37000, d_model=1024, layers=6, heads=16, d_ff=4096),
    'smoke': dict(vocab=64, d_model=16, layers=2, heads=2, d_ff=32),
}
CONFIGS = {'base': 'configs/base.py', 'big': 'configs/big.py', 'smoke': 'configs/tiny.py'}
PLANNED_MFU = 0.4
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SENTENCE_LENGTH = 64


def peak_memory_gb(jax) -> float | None:
  stats = jax.local_devices()[0].memory_stats() or {}
  return stats['peak_bytes_in_use'] / 2**30 if 'peak_bytes_in_use' in stats else None


def planned(name: str, dtype: str, tokens: int, peak_tflops: float) -> dict:
  """The capacity plan of the measured step (same config, batch and one device), compiled on the CPU."""
  command = [sys.executable, '-m', 'flax_transformer', 'plan', f'--config={CONFIGS[name]}', '--devices=1',
             '--mesh=(1,1,1)', f'--config.model.dtype={dtype}', f'--config.max_train_length={SENTENCE_LENGTH}',
             f'--config.tokens_per_batch={tokens}', f'--peak_tflops={peak_tflops}', f'--mfu={PLANNED_MFU}']
  result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, 'JAX_PLATFORMS': 'cpu', 'PYTHONPATH': ROOT})
  if result.returncode:
    raise RuntimeError(f'plan failed: {result.stderr[-500:]}')
  return json.loads(result.stdout.strip().splitlines()[-1])


def time_train_step(shape: dict, dtype: str, tokens: int, steps: int) -> tuple[float, int]:
  """(median seconds per train step, the device compiler's bytes for arguments + temporaries)."""
  import numpy as np
  from train_step import build_ours  # bench/train_step.py
  rng = np.random.default_rng(0)
  batch = {k: rng.integers(3, shape['vocab'], (tokens // SENTENCE_LENGTH, SENTENCE_LENGTH)).astype(np.int32)
           for k in ('inputs', 'targets')}
  run, _ = build_ours(shape, batch, dtype, max_positions=2 * SENTENCE_LENGTH)
  times = []
  for i in range(steps + 2):
    start = time.perf_counter()
    run()
    if i >= 2:
      times.append(time.perf_counter() - start)
  memory = run.memory_analysis()
  return statistics.median(times), int(memory.argument_size_in_bytes + memory.temp_size_in_bytes)


def time_beam_search(jax, shape: dict, dtype: str, batch: int, source_length: int, output_length: int) -> float:
  """Median seconds to decode `batch` sentences with beam 4, exactly `output_length` tokens each."""
  import flax.linen as nn
  import numpy as np
  from decode import cached  # bench/decode.py
  from configs import base
  from flax_transformer import settings
  from flax_transformer.model import Transformer
  run_config = base.get_config()
  m = run_config.model
  m.vocab_size, m.d_model, m.num_heads, m.d_ff = shape['vocab'], shape['d_model'], shape['heads'], shape['d_ff']
  m.num_encoder_layers = m.num_decoder_layers = shape['layers']
  m.max_positions, m.dtype = 256, dtype
  config = settings.model_settings(run_config)  # attention and dropout masks as a run on this platform chooses
  model = Transformer(config)
  inputs = np.random.default_rng(0).integers(3, shape['vocab'], (batch, source_length)).astype(np.int32)
  params = nn.meta.unbox(model.init(jax.random.key(0), inputs[:1], inputs[:1])['params'])
  run = jax.jit(functools.partial(cached, model=model, beam_size=4, output_length=output_length))
  jax.block_until_ready(run(params, inputs))
  times = []
  for _ in range(3):
    start = time.perf_counter()
    jax.block_until_ready(run(params, inputs))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def newstest_lengths(count: int, rng) -> list[int]:
  """Source lengths in subword tokens shaped as newstest2014's (EN, a 32k joint BPE): mean ~30, a long right
  tail, 2 to 120."""
  return [int(x) for x in np.clip(np.round(rng.lognormal(3.25, 0.55, count)), 2, 120)]


def time_engine(jax, shape: dict, dtype: str, sentences: int, slots: int) -> tuple[float, int]:
  """Seconds (median of 3) for the decoding engine to translate `sentences` random sources of newstest-like
  lengths with beam 4 through `slots` slots, each output as long as its source (max_extra_length 0; random
  weights all but never choose EOS), and the target tokens generated."""
  import flax.linen as nn
  from configs import base
  from flax_transformer import engine, search, settings
  from flax_transformer.model import Transformer
  run_config = base.get_config()
  m = run_config.model
  m.vocab_size, m.d_model, m.num_heads, m.d_ff = shape['vocab'], shape['d_model'], shape['heads'], shape['d_ff']
  m.num_encoder_layers = m.num_decoder_layers = shape['layers']
  m.max_positions, m.dtype = 256, dtype
  resolved = settings.resolve(run_config)
  model = Transformer(resolved.model)
  rng = np.random.default_rng(0)
  encoded = [list(rng.integers(3, shape['vocab'], length)) for length in newstest_lengths(sentences, rng)]
  probe = np.ones((1, 8), np.int32)
  params = nn.meta.unbox(jax.jit(model.init)(jax.random.key(0), probe, probe)['params'])
  strategy = search.BeamSearch(4, 0.6, resolved.decode.beam_top_k)
  mesh = engine.decoding_mesh()  # every local accelerator, as translate.py
  if mesh:  # the whole model on each device, as the Translator places it
    params = jax.device_put(params, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
  decoder = engine.Engine(model, params, strategy, slots=slots, max_extra_length=0, max_positions=256, mesh=mesh)
  results = decoder.run(encoded)
  times = []
  for _ in range(3):
    start = time.perf_counter()
    decoder.run(encoded)
    times.append(time.perf_counter() - start)
  return statistics.median(times), sum(int((tokens > 0).sum()) for (tokens, _), *_ in results)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument('--shapes', default='base,big')
  parser.add_argument('--dtypes', default='float32,bfloat16')
  parser.add_argument('--tokens', type=int, default=16384, help='target tokens per train batch')
  parser.add_argument('--steps', type=int, default=10)
  parser.add_argument('--smoke', action='store_true', help='tiny shapes and sizes, to check the script on a CPU')
  args = parser.parse_args()
  import jax
  import jax.numpy as jnp
  from train_step import matmul_peak  # bench/train_step.py
  from flax_transformer import plan
  shapes = ['smoke'] if args.smoke else args.shapes.split(',')
  dtypes = args.dtypes.split(',')
  tokens = 1024 if args.smoke else args.tokens
  matmul_size = 512 if args.smoke else 8192
  device = jax.devices()[0]
  peaks = {dtype: matmul_peak(jax, jnp, getattr(jnp, dtype), matmul_size) for dtype in ('float32', 'bfloat16')}
  print(f'device: {device.device_kind} ({device.platform}); jax {jax.__version__}; matmul peak '
        f'{peaks["float32"]:,.0f} GFLOP/s float32 (default precision), {peaks["bfloat16"]:,.0f} bfloat16\n')

  results = []
  print(f'train step, {tokens} target tokens per batch ({tokens // SENTENCE_LENGTH} × {SENTENCE_LENGTH}), '
        f'median of {args.steps}\n')
  print('| shape | dtype | step ms | planned ms (40% MFU) | target tokens/s | model TFLOP/s | MFU (bf16 peak) '
        '| GiB / device | planned GiB |')
  print('|---|---|---|---|---|---|---|---|---|')
  for name in shapes:
    for dtype in dtypes:
      seconds, device_bytes = time_train_step(SHAPES[name], dtype, tokens, args.steps)
      prediction = planned(name, dtype, tokens, peaks['bfloat16'] / 1e3)
      flops = prediction['analytic_flops_per_step']
      fraction = flops / seconds / 1e9 / peaks['bfloat16']
      planned_bytes = plan.total_bytes(prediction)
      print(f'| {name} | {dtype} | {seconds * 1e3:.1f} | {prediction["step_seconds"] * 1e3:.1f} | '
            f'{tokens / seconds:,.0f} | {flops / seconds / 1e12:.2f} | {fraction:.2f} | '
            f'{device_bytes / 2**30:.2f} | {planned_bytes / 2**30:.2f} |', flush=True)
      results.append({'shape': name, 'dtype': dtype, 'tokens_per_second': round(tokens / seconds),
                      'step_seconds': round(seconds, 5), 'planned_step_seconds': round(prediction['step_seconds'], 5),
                      'peak_fraction': round(fraction, 3), 'device_bytes': device_bytes,
                      'planned_bytes': planned_bytes})

  batch, source_length, output_length = (8, 8, 8) if args.smoke else (128, 32, 64)
  print(f'\nbeam 4 decoding: {batch} sources of {source_length} tokens, exactly {output_length} generated tokens\n')
  print('| shape | dtype | sentences/s | generated tokens/s |\n|---|---|---|---|')
  for name in shapes:
    for dtype in dtypes:
      seconds = time_beam_search(jax, SHAPES[name], dtype, batch, source_length, output_length)
      print(f'| {name} | {dtype} | {batch / seconds:,.1f} | {batch * output_length / seconds:,.0f} |', flush=True)
      results.append({'shape': name, 'dtype': dtype, 'beam4_sentences_per_second': round(batch / seconds, 1)})
  sentences = 16 if args.smoke else 2048
  print(f'\nthe decoding engine, beam 4: {sentences} sources of newstest-like lengths, each output as long as '
        f'its source\n')
  from flax_transformer import engine
  devices = engine.decoding_mesh().size if engine.decoding_mesh() else 1
  print(f'slots spread over {devices} local device(s), as translate.py does\n')
  print('| shape | dtype | slots | sentences/s | target tokens/s |\n|---|---|---|---|---|')
  for name in shapes:
    for dtype in dtypes:
      for slots in ((8,) if args.smoke else (64, 512)):
        seconds, tokens = time_engine(jax, SHAPES[name], dtype, sentences, slots)
        print(f'| {name} | {dtype} | {slots} | {sentences / seconds:,.1f} | {tokens / seconds:,.0f} |', flush=True)
        results.append({'shape': name, 'dtype': dtype, 'engine_slots': slots, 'engine_devices': devices,
                        'engine_sentences_per_second': round(sentences / seconds, 1),
                        'engine_target_tokens_per_second': round(tokens / seconds)})
  memory = peak_memory_gb(jax)
  if memory is not None:
    print(f'\npeak device memory: {memory:.1f} GiB')
  print(json.dumps({'device': device.device_kind, 'matmul_peak_gflops': {k: round(v) for k, v in peaks.items()},
                    'runs': results}))


if __name__ == '__main__':
  main()
