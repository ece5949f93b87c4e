"""What each speed option of the train step is worth: the Multi30k step with one option changed at a time.

python tools/ablation.py [--rounds 10] [--batch 128 --length 16]

Every variant is compiled in this one process and the variants' steps alternate round by round, so all
see the same machine noise; each row is the median over the rounds, relative to configs/multi30k.py.
Random token ids, all real; the Multi30k model (vocab 6000, d_model 128, 3+3 layers) unless a row changes it.
"""

import argparse
import functools
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from configs import multi30k  # noqa: E402
from flax_transformer import settings, train_state
from flax_transformer import partitioning, steps  # noqa: E402

VARIANTS = {  # name: (config overrides, train_step keyword arguments)
    'configs/multi30k.py': ({}, {}),
    'autodiff projection + loss (fused_output_loss=False)': ({}, {'fused_output_loss': False}),
    "dropout masks from jax.random (model.dropout_masks='random', rbg keys)": ({'model.dropout_masks': 'random'}, {}),
    "dropout masks from jax.random with threefry keys": ({'model.dropout_masks': 'random',
                                                          'dropout_rng_impl': 'threefry2x32'}, {}),
    'layers scanned one per iteration (model.scan_unroll=1)': ({'model.scan_unroll': 1}, {}),
    'vocabulary 4000 (model.vocab_size=4000)': ({'model.vocab_size': 4000}, {}),
}


def build(overrides: dict, step_kwargs: dict, batch: int, length: int):
  """-> (run one step, compile seconds)."""
  config = multi30k.get_config()
  for name, value in overrides.items():
    node = config
    *path, leaf = name.split('.')
    for part in path:
      node = node[part]
    node[leaf] = value
  model_config = settings.model_settings(config)
  mesh = partitioning.create_mesh((1, 1, 1), jax.devices()[:1])
  state, shardings = train_state.create_train_state(model_config, settings.resolve(config).optimizer, mesh, jax.random.key(0))
  step = partitioning.jit_train_step(functools.partial(steps.train_step, model_config=model_config,
                                                       label_smoothing=0.1, **step_kwargs), mesh, shardings)
  rng = np.random.default_rng(0)
  data = {k: rng.integers(3, model_config.vocab_size, (batch, length)).astype(np.int32)
          for k in ('inputs', 'targets')}
  key = jax.random.key(0, impl=config.dropout_rng_impl)
  holder = {'state': state}

  def run():
    holder['state'], metrics = step(holder['state'], data, key)
    jax.block_until_ready(metrics)

  start = time.perf_counter()
  run()
  compile_seconds = time.perf_counter() - start
  run()
  return run, compile_seconds


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument('--rounds', type=int, default=10)
  parser.add_argument('--batch', type=int, default=128)
  parser.add_argument('--length', type=int, default=16)
  args = parser.parse_args()
  runs = {name: build(*spec, args.batch, args.length) for name, spec in VARIANTS.items()}
  times = {name: [] for name in runs}
  for _ in range(args.rounds):
    for name, (run, _) in runs.items():
      start = time.perf_counter()
      run()
      times[name].append(time.perf_counter() - start)
  tokens = args.batch * args.length
  baseline = statistics.median(times['configs/multi30k.py'])
  print(f'Multi30k train step, {args.batch} × {args.length} tokens, median of {args.rounds} alternating rounds\n')
  print('| variant | step ms | target tokens/s | step time vs configs/multi30k.py | first step (compile) s |')
  print('|---|---|---|---|---|')
  for name, (_, compile_seconds) in runs.items():
    seconds = statistics.median(times[name])
    print(f'| {name} | {seconds * 1e3:.0f} | {tokens / seconds:,.0f} | {seconds / baseline:.2f}× | '
          f'{compile_seconds:.1f} |')


if __name__ == '__main__':
  main()
