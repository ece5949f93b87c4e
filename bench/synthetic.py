"""What the benchmarks share: a synthetic WMT-shaped parallel corpus, and the name of the CPU they ran on."""

import gzip
import os

import numpy as np


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


def cpu_model() -> str:
  try:
    with open('/proc/cpuinfo') as f:
      return next(line.split(':', 1)[1].strip() for line in f if line.startswith('model name'))
  except (OSError, StopIteration):
    return 'unknown CPU'
