"""Input pipeline throughput per CPU core: building the token table, then serving 25k-token batches; and
the time and memory for one process to build its shard of a WMT14-sized split.

python bench/input_pipeline.py [--pairs=200000] [--shards=1,2] [--repeats=3]
python bench/input_pipeline.py --memory --pairs=4500000 --shards=1,4

A synthetic WMT-like corpus (Zipf words, sentence lengths log-normal around 25 words, longest ~120) is
written as .gz files and as a tfds-shaped mock (tfds.testing.mock_data, so the tfds code path runs
without a download). For each source and shard count it times, for shard 0:
  table build  - read, tokenise (tensorflow-text SentencePiece) and store its shard of the split,
  serving      - batches of the global `tokens_per_batch`, as the trainer pulls them.
Prints a markdown table (medians of --repeats) and, last, one JSON line. docs/scaling.md turns these
rates into the CPU cores a host needs to feed its accelerators.

--memory: each row in a fresh process (peak RSS is a per-process high-water mark): the seconds and peak
resident memory for process 0 to build its table of 1/shards of the split (files streamed line by line,
other shards' lines skipped), beside the same process reading both files whole into Python lists, as a
reader that loads the split would.
"""

import gzip
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import app, flags  # noqa: E402

tf.config.set_visible_devices([], 'GPU')
flags.DEFINE_integer('pairs', 200_000, 'Sentence pairs in the synthetic training split.')
flags.DEFINE_list('shards', ['1', '2'], 'Data shard counts to time (the table of shard 0 is built).')
flags.DEFINE_integer('batches', 300, 'Batches served per timing.')
flags.DEFINE_integer('repeats', 3, 'Timings per row; the table reports the median.')
flags.DEFINE_integer('tfds_pairs', 20_000, 'Pairs of the tfds mock (generated in Python, so kept smaller).')
flags.DEFINE_string('workdir', '/tmp/flax_transformer_bench_input', 'Corpus and vocabulary directory.')
flags.DEFINE_bool('memory', False, 'Time and peak memory of one shard\'s table build, one process per row.')
flags.DEFINE_string('measure', '', 'Internal: the row to measure in this process (table:SHARDS or lists).')


def synthetic_corpus(directory: str, pairs: int, seed: int = 0) -> tuple[str, str]:
  """WMT-like parallel text: Zipf(1.1) over 30k synthetic words, source lengths ~ LogNormal(ln 22, 0.55),
  target lengths 0.8-1.3× the source's."""
  paths = [os.path.join(directory, f'train.{lang}.gz') for lang in ('en', 'de')]
  if all(os.path.exists(p) for p in paths):
    return tuple(paths)
  rng = np.random.default_rng(seed)
  letters = np.array(list('abcdefghijklmnopqrstuvwxyz'))
  words = [''.join(rng.choice(letters, rng.integers(2, 10))) for _ in range(30_000)]
  lengths = np.clip(rng.lognormal(np.log(22), 0.55, pairs).astype(int), 1, 120)
  with gzip.open(paths[0], 'wt', encoding='utf-8') as source, gzip.open(paths[1], 'wt', encoding='utf-8') as target:
    for n in lengths:
      for f, length in ((source, n), (target, max(1, int(n * rng.uniform(0.8, 1.3))))):
        ids = np.minimum(rng.zipf(1.1, length), len(words)) - 1
        f.write(' '.join(words[i] for i in ids) + '\n')
  return tuple(paths)


def config_for(source: str, paths: tuple[str, str]):
  from configs import base
  config = base.get_config()
  config.model.vocab_size = 8000
  config.vocab_sample_sentences = 40_000
  if source == 'files':
    config.dataset = 'files'
    config.train_source, config.train_target = paths
  return config


def time_source(source: str, paths, shards: int, vocab_path: str) -> dict:
  from flax_transformer import input_pipeline, settings, token_table
  config = config_for(source, paths)
  cores = len(os.sched_getaffinity(0))
  builds, serves = [], []
  for _ in range(flags.FLAGS.repeats):
    start = time.perf_counter()
    table = token_table.train_table(settings.resolve(config).data, vocab_path, (0, shards))
    seconds = time.perf_counter() - start
    table_tokens = int(table.sources.lengths.sum() + table.targets.lengths.sum())
    builds.append(table_tokens / seconds / cores)
    histogram = table.histogram(config.max_train_length) * shards  # the other shards: alike in distribution
    batching = input_pipeline.train_batching(settings.resolve(config).data, histogram, table.dropped * shards)
    stream = input_pipeline.train_batches(table, batching, (0, shards), seed=0)
    next(stream)
    start = time.perf_counter()
    batches = [next(stream) for _ in range(flags.FLAGS.batches)]
    seconds = time.perf_counter() - start
    serves.append(sum(int((b['targets'] > 0).sum()) for b in batches) / seconds / cores)
  return {'source': source, 'shards': shards, 'pairs': len(table), 'table_tokens': table_tokens,
          'build_tokens_per_second_per_core': round(statistics.median(builds)),
          'serve_target_tokens_per_second_per_core': round(statistics.median(serves)),
          'cores': cores}


def _peak_rss_gib() -> float:
  import resource
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20  # kilobytes on Linux


def measure(what: str, paths, vocab_path: str) -> dict:
  """One --memory row, in this process: {'row', 'seconds', 'peak_rss_gib', ...}."""
  from flax_transformer import parallel_text, settings, token_table
  config = config_for('files', paths)
  baseline = _peak_rss_gib()
  start = time.perf_counter()
  if what == 'lists':
    sources, targets = parallel_text.read_parallel_files(*paths)
    result = {'row': 'both files whole as Python lists (no tokenising)', 'pairs': len(sources)}
  else:
    shards = int(what.split(':')[1])
    table = token_table.train_table(settings.resolve(config).data, vocab_path, (0, shards))
    table_bytes = sum(a.nbytes for side in (table.sources, table.targets) for a in (side.values, side.lengths))
    result = {'row': f'token table of shard 0 of {shards}', 'pairs': len(table), 'table_gib': table_bytes / 2 ** 30}
  return {**result, 'seconds': time.perf_counter() - start, 'peak_rss_gib': _peak_rss_gib(),
          'start_rss_gib': baseline}


def memory_rows(paths, vocab_path: str) -> None:
  import subprocess
  rows = []
  for what in [f'table:{n}' for n in flags.FLAGS.shards] + ['lists']:
    output = subprocess.run([sys.executable, os.path.abspath(__file__), f'--measure={what}',
                             f'--pairs={flags.FLAGS.pairs}', f'--workdir={flags.FLAGS.workdir}'],
                            capture_output=True, text=True, check=True).stdout
    rows.append(json.loads(output.strip().splitlines()[-1]))
  print(f'CPU: {cpu_model()}, {len(os.sched_getaffinity(0))} cores; {flags.FLAGS.pairs:,} synthetic WMT-shaped pairs')
  print('| process 0 builds | pairs | seconds | table, GiB | peak RSS, GiB (at start) |')
  print('|---|---|---|---|---|')
  for r in rows:
    table = f"{r['table_gib']:.2f}" if 'table_gib' in r else '-'
    print(f"| {r['row']} | {r['pairs']:,} | {r['seconds']:.0f} | {table} | {r['peak_rss_gib']:.2f} "
          f"({r['start_rss_gib']:.2f}) |")
  print(json.dumps(rows))


def main(argv):
  del argv
  import tensorflow_datasets as tfds
  from flax_transformer import parallel_text, settings, tokenizer
  os.makedirs(flags.FLAGS.workdir, exist_ok=True)
  paths = synthetic_corpus(flags.FLAGS.workdir, flags.FLAGS.pairs)
  files_config = config_for('files', paths)
  _, vocab_path = tokenizer.train_or_load(settings.resolve(files_config).data, flags.FLAGS.workdir,
                                          lambda: parallel_text.python_pairs(settings.resolve(files_config).data))
  if flags.FLAGS.measure:
    print(json.dumps(measure(flags.FLAGS.measure, paths, vocab_path)))
    return
  if flags.FLAGS.memory:
    memory_rows(paths, vocab_path)
    return
  rows = []
  for shards in map(int, flags.FLAGS.shards):
    rows.append(time_source('files', paths, shards, vocab_path))
  with tfds.testing.mock_data(num_examples=flags.FLAGS.tfds_pairs, policy=tfds.testing.MockPolicy.USE_CODE):
    rows.append(time_source('tfds', paths, 1, vocab_path))
  print(f'CPU: {cpu_model()}, {rows[0]["cores"]} cores; global batch {files_config.tokens_per_batch:,} tokens')
  print('| source | shards | pairs in shard 0 | table build, tokens/s/core | serving, target tokens/s/core |')
  print('|---|---|---|---|---|')
  for r in rows:
    print(f"| {r['source']} | {r['shards']} | {r['pairs']:,} | {r['build_tokens_per_second_per_core']:,} | "
          f"{r['serve_target_tokens_per_second_per_core']:,} |")
  print(json.dumps(rows))


def cpu_model() -> str:
  try:
    with open('/proc/cpuinfo') as f:
      return next(line.split(':', 1)[1].strip() for line in f if line.startswith('model name'))
  except (OSError, StopIteration):
    return 'unknown CPU'


if __name__ == '__main__':
  app.run(main)
