"""Input pipeline throughput vs what the training step consumes, side by side in one process.

python bench/input_pipeline.py [--config=configs/multi30k.py]
Prints a markdown table and, last, one JSON line.
"""

import functools
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

tf.config.set_visible_devices([], 'GPU')
config_flags.DEFINE_config_file('config', 'configs/multi30k.py', 'Run configuration.', lock_config=False)
flags.DEFINE_string('workdir', '/tmp/flax_transformer_bench', 'Where the vocabulary is trained or found.')
flags.DEFINE_integer('batches', 200, 'Pipeline batches to time.')
flags.DEFINE_integer('steps', 10, 'Timed train steps (after one warm-up step).')


def main(argv):
  del argv
  from flax_transformer import input_pipeline, partitioning, steps, tokenizer
  from flax_transformer.model import TransformerConfig
  config = flags.FLAGS.config
  _, vocab_path = tokenizer.train_or_load(config, flags.FLAGS.workdir, lambda: input_pipeline.python_pairs(config))
  iterator = input_pipeline.train_batches(config, vocab_path).as_numpy_iterator()
  next(iterator)
  start = time.perf_counter()
  batches = [next(iterator) for _ in range(flags.FLAGS.batches)]
  pipeline_tps = sum(int((b['targets'] > 0).sum()) for b in batches) / (time.perf_counter() - start)

  model_config = TransformerConfig.from_config(config)
  mesh = partitioning.create_mesh((1, 1, 1), jax.devices()[:1])
  state, shardings = partitioning.create_train_state(config, model_config, mesh, jax.random.key(0))
  step = partitioning.jit_train_step(functools.partial(steps.train_step, model_config=model_config,
                                                       label_smoothing=config.label_smoothing), mesh, shardings)
  shape = max({b['inputs'].shape + b['targets'].shape[1:] for b in batches},
              key=lambda s: sum(1 for b in batches if b['inputs'].shape + b['targets'].shape[1:] == s))
  same = [b for b in batches if b['inputs'].shape + b['targets'].shape[1:] == shape]
  rng = jax.random.key(1)
  state, metrics = step(state, same[0], rng)
  jax.block_until_ready(metrics)
  times, tokens = [], []
  for i in range(flags.FLAGS.steps):
    batch = same[(i + 1) % len(same)]
    start = time.perf_counter()
    state, metrics = step(state, batch, rng)
    jax.block_until_ready(metrics)
    times.append(time.perf_counter() - start)
    tokens.append(int((batch['targets'] > 0).sum()))
  step_tps = statistics.median(t / s for t, s in zip(tokens, times))
  print('| what | target tokens/s |\n|---|---|')
  print(f'| input pipeline ({flags.FLAGS.batches} batches) | {pipeline_tps:,.0f} |')
  print(f'| train step, batch shape {shape} (median of {flags.FLAGS.steps}) | {step_tps:,.0f} |')
  print(f'| ratio | {pipeline_tps / step_tps:.1f}× |')
  print(json.dumps({'pipeline_tokens_per_second': round(pipeline_tps), 'train_tokens_per_second': round(step_tps),
                    'ratio': round(pipeline_tps / step_tps, 2)}))


if __name__ == '__main__':
  app.run(main)
