"""A small synthetic parallel corpus: the second side is the first reversed and upper-cased."""

import gzip
import os

import numpy as np

WORDS = 'the a cat dog sat on mat runs fast slow red blue house tree big small man woman child ball'.split()


def write_corpus(directory, n=300, seed=0, name='train'):
  rng = np.random.default_rng(seed)
  sources, targets = [], []
  for _ in range(n):
    words = list(rng.choice(WORDS, size=rng.integers(1, 14)))
    sources.append(' '.join(words))
    targets.append(' '.join(w.upper() for w in reversed(words)))
  paths = []
  for lang, lines in (('src', sources), ('tgt', targets)):
    path = os.path.join(directory, f'{name}.{lang}.gz')
    with gzip.open(path, 'wt', encoding='utf-8') as f:
      f.write('\n'.join(lines) + '\n')
    paths.append(path)
  return paths, sources, targets
