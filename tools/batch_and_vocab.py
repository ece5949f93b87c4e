"""How batch size and vocabulary size change the Multi30k model's training throughput, side by side in one process.

python tools/batch_and_vocab.py [--data_dir=../shared/data/multi30k/tok] [--steps 12]

Our jitted train step (bench/train_step.py's `build_ours`, configs/multi30k.py's model) at several batch shapes
and vocabulary sizes, the steps of all cases alternating so they see the same machine noise. A larger vocabulary
cuts sentences into fewer pieces, so the table also gives sentences/s: target tok/s divided by the mean number of
target pieces a sentence takes under a joint SentencePiece BPE of that size trained on the corpus's train split.
"""

import argparse
import gzip
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'bench'))

import numpy as np  # noqa: E402

import train_step  # noqa: E402
from flax_transformer import tokenizer  # noqa: E402

DEFAULT_DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', '..', 'shared', 'data', 'multi30k', 'tok')


def read_pairs(data_dir: str) -> tuple[list[str], list[str]]:
  """The train split's English and German sentences."""
  read = lambda lang: [line.strip() for line in gzip.open(os.path.join(data_dir, f'train.lc.norm.tok.{lang}.gz'), 'rt')]
  return read('en'), read('de')


def pieces_per_sentence(sources: list[str], targets: list[str], vocab_size: int) -> float:
  """Mean pieces a target sentence takes under a joint BPE of `vocab_size` trained on these pairs."""
  with tempfile.TemporaryDirectory() as scratch:
    path = tokenizer.train_sentencepiece(zip(sources, targets), os.path.join(scratch, 'spm'), vocab_size)
    processor = tokenizer.load(path, vocab_size)
  return float(np.mean([len(ids) for ids in processor.encode(targets)]))


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument('--data_dir', default=DEFAULT_DATA)
  parser.add_argument('--steps', type=int, default=12)
  args = parser.parse_args()
  if not os.path.exists(os.path.join(args.data_dir, 'train.lc.norm.tok.de.gz')):
    parser.error(f'--data_dir={args.data_dir}: no train.lc.norm.tok.de.gz there; pass the Multi30k tok/ folder')
  base = train_step.SHAPES['multi30k']
  cases = [('batch 64 × 16', base | {'batch': 64}), ('batch 128 × 16 (the config)', base),
           ('batch 256 × 16', base | {'batch': 256}), ('batch 64 × 32', base | {'batch': 64, 'length': 32})]
  cases += [(f'vocab {v}', base | {'vocab': v}) for v in (4000, 8000, 10000) if v != base['vocab']]
  sources, targets = read_pairs(args.data_dir)
  pieces = {v: pieces_per_sentence(sources, targets, v) for v in sorted({s['vocab'] for _, s in cases})}
  runs = []
  for name, shape in cases:
    rng = np.random.default_rng(0)
    batch = {k: rng.integers(3, shape['vocab'], (shape['batch'], shape['length'])).astype(np.int32)
             for k in ('inputs', 'targets')}
    run, _ = train_step.build_ours(shape, batch)
    run()  # compile
    run()
    runs.append((name, shape, run, []))
  for _ in range(args.steps):
    for _, _, run, times in runs:
      times += train_step.timed(run, 1)
  print(f'median of {args.steps} alternating steps; target pieces a sentence (joint BPE on train): '
        + ', '.join(f'{v}: {p:.2f}' for v, p in pieces.items()) + '\n')
  print('| case | step ms | target tok/s | sentences/s | sentences/s vs the config |')
  print('|---|---|---|---|---|')
  results = []
  for name, shape, _, times in runs:
    seconds = statistics.median(times)
    tokens_per_second = shape['batch'] * shape['length'] / seconds
    results.append((name, shape, seconds, tokens_per_second, tokens_per_second / pieces[shape['vocab']]))
  reference = next(sentences for _, shape, _, _, sentences in results if shape == base)
  for name, _, seconds, tokens_per_second, sentences in results:
    print(f'| {name} | {seconds * 1e3:.1f} | {tokens_per_second:,.0f} | {sentences:,.0f} | {sentences / reference:.2f}× |')


if __name__ == '__main__':
  main()
