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


def read_parallel_files(source_path: str, target_path: str) -> tuple[list[str], list[str]]:
  """Both files whole, as lists of lines (parallel_text.parallel_lines streams them)."""
  from flax_transformer.parallel_text import parallel_lines
  pairs = [(s.decode('utf-8'), t.decode('utf-8')) for s, t in parallel_lines(source_path, target_path)]
  return [p[0] for p in pairs], [p[1] for p in pairs]
