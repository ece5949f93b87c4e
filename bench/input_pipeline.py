"""The start of a run at WMT14's size: tokenising the training split (every start, before the token cache)
against building the cache once and reading it at every later start; and serving the global batch stream.

python bench/input_pipeline.py [--pairs=4500000] [--processes=1,2] [--batches=300]

A synthetic WMT-like corpus (Zipf words, sentence lengths log-normal around 22 words, longest ~120) is
written as .gz files, and an 8k BPE vocabulary trained on it. Each row runs in a fresh process (peak RSS is a
per-process high-water mark) and reports its seconds and peak resident memory:
  tokenise         - the baseline: the whole split tokenised into an in-memory table, as every start did;
  build, 1 of P    - process 0 of P builds its blocks of a new cache (reads the split, tokenises 1/P, writes);
  read the cache   - a start with the cache built: the whole table read and checked (every process does this);
then, in the last row's process, the global stream's batches of `tokens_per_batch` as one host of an
8-device mesh gathers them (target tokens per second per core). Prints a markdown table and one JSON line.
"""

import json
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

from absl import app, flags  # noqa: E402

from bench.synthetic import cpu_model, synthetic_corpus  # noqa: E402

flags.DEFINE_integer('pairs', 4_500_000, 'Sentence pairs in the synthetic training split.')
flags.DEFINE_list('processes', ['1', '2'], 'Process counts of the cache builds timed (process 0 of each).')
flags.DEFINE_integer('batches', 300, 'Batches of the global stream served in the serving timing.')
flags.DEFINE_string('workdir', '/tmp/flax_transformer_bench_input', 'Corpus, vocabulary and cache directory.')
flags.DEFINE_string('measure', '', 'Internal: the row to measure in this process (tokenise, build:P or read).')


def config_for(source: str, paths: tuple[str, str]):
  from configs import base
  config = base.get_config()
  config.model.vocab_size = 8000
  config.vocab_sample_sentences = 40_000
  if source == 'files':
    config.dataset = 'files'
    config.train_source, config.train_target = paths
    config.eval_source, config.eval_target = paths  # not read here; a files config names every split
    config.token_cache = os.path.join(flags.FLAGS.workdir, 'cache')
  return config


def _peak_rss_gib() -> float:
  import resource
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20  # kilobytes on Linux


def _serve(table, data) -> float:
  """Target tokens per second per core of the global stream, gathered by one host holding 8 blocks."""
  from flax_transformer import input_pipeline
  batching = input_pipeline.train_batching(data, table.histogram(data.max_train_length), table.dropped, 8)
  stream = input_pipeline.train_batches(table, batching, seed=0, blocks=tuple(range(8)), data_parallel=8)
  next(stream)
  start = time.perf_counter()
  tokens = sum(int((next(stream)['targets'] > 0).sum()) for _ in range(flags.FLAGS.batches))
  return tokens / (time.perf_counter() - start) / len(os.sched_getaffinity(0))


def measure(what: str, paths, vocab_path: str) -> dict:
  """One row, in this process: {'row', 'seconds', 'peak_rss_gib', ...}."""
  from flax_transformer import parallel_text, settings, storage, token_cache, token_table
  data = settings.resolve(config_for('files', paths)).data
  cache = storage.path(flags.FLAGS.workdir) / 'cache' / token_cache.fingerprint(token_cache.identity(data, vocab_path))
  baseline, start, result = _peak_rss_gib(), time.perf_counter(), {}
  if what == 'tokenise':
    table = token_table.token_table(parallel_text.text_pairs(data, 'train'), vocab_path, data.max_train_length)
    result = {'row': 'tokenise the split into memory (every start, before the cache)'}
  elif what.startswith('build:'):
    processes = int(what.split(':')[1])
    shutil.rmtree(cache, ignore_errors=True)
    token_cache.build(data, vocab_path, cache, (0, processes))
    result = {'row': f'build the cache: process 0 of {processes}'}
    table = None
  else:
    from flax_transformer import input_pipeline
    table = token_cache.train_table(data, vocab_path, flags.FLAGS.workdir)  # as a start does: checked, read once
    batching = input_pipeline.train_batching(data, table.histogram(data.max_train_length), table.dropped, 8)
    next(input_pipeline.train_batches(table, batching, seed=0, blocks=tuple(range(8)), data_parallel=8))
    result = {'row': 'read the cache to the first batch (every later start)'}
  seconds = time.perf_counter() - start
  if table is not None:
    result['pairs'] = len(table)
  if what == 'read':
    result['serve_target_tokens_per_second_per_core'] = round(_serve(table, data))
  return {**result, 'seconds': seconds, 'peak_rss_gib': _peak_rss_gib(), 'start_rss_gib': baseline}


def main(argv):
  del argv
  import subprocess
  from flax_transformer import parallel_text, settings, token_cache, tokenizer
  os.makedirs(flags.FLAGS.workdir, exist_ok=True)
  paths = synthetic_corpus(flags.FLAGS.workdir, flags.FLAGS.pairs)
  data = settings.resolve(config_for('files', paths)).data
  start = time.perf_counter()
  trained = not os.path.exists(os.path.join(flags.FLAGS.workdir, 'sentencepiece.model'))
  _, vocab_path = tokenizer.train_or_load(data, flags.FLAGS.workdir, lambda: parallel_text.python_pairs(data))
  vocabulary_seconds = time.perf_counter() - start if trained else None
  if flags.FLAGS.measure:
    print(json.dumps(measure(flags.FLAGS.measure, paths, vocab_path)))
    return
  rows = []
  largest = max(map(int, flags.FLAGS.processes))
  # The full build last before reading: `read` needs every block, so the last build is by one process.
  order = ['tokenise'] + [f'build:{n}' for n in sorted(map(int, flags.FLAGS.processes), reverse=True)] + ['read']
  for what in order:
    if what == 'read':  # the other processes' blocks of the last build, then the manifest
      directory = os.path.join(flags.FLAGS.workdir, 'cache', token_cache.fingerprint(token_cache.identity(data, vocab_path)))
      from flax_transformer import storage
      lines = max(token_cache.build(data, vocab_path, storage.path(directory), (i, largest)) or 0
                  for i in range(largest))
      token_cache._finish(storage.path(directory), lines or flags.FLAGS.pairs, data.token_cache_block_pairs)
    output = subprocess.run([sys.executable, os.path.abspath(__file__), f'--measure={what}',
                             f'--pairs={flags.FLAGS.pairs}', f'--workdir={flags.FLAGS.workdir}',
                             f'--batches={flags.FLAGS.batches}'], capture_output=True, text=True, check=True).stdout
    rows.append(json.loads(output.strip().splitlines()[-1]))
  print(f'CPU: {cpu_model()}, {len(os.sched_getaffinity(0))} cores; {flags.FLAGS.pairs:,} synthetic WMT-shaped '
        f'pairs, 8k BPE, blocks of {data.token_cache_block_pairs:,} pairs')
  base = rows[0]['seconds']
  print('| start of a run | seconds | vs tokenising | peak RSS, GiB (at start) |')
  print('|---|---|---|---|')
  for r in rows:
    print(f"| {r['row']} | {r['seconds']:.1f} | {r['seconds'] / base:.3f}x | {r['peak_rss_gib']:.2f} "
          f"({r['start_rss_gib']:.2f}) |")
  if vocabulary_seconds is not None:
    print(f'training the vocabulary (once, before the cache; {data.vocab_sample_sentences:,} sentences drawn from the split): {vocabulary_seconds:.1f} s')
  print(f"serving the global stream (one host of 8 devices): {rows[-1]['serve_target_tokens_per_second_per_core']:,} "
        f"target tokens/s/core")
  print(json.dumps(rows))


if __name__ == '__main__':
  app.run(main)
