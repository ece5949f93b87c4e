"""Lexical constraints on real sentences: how many outputs hold their constraints, BLEU and speed, against
unconstrained beam search on the same sentences in the same invocation.

python bench/constraints.py --workdir=RUN --sentences=FILE --references=FILE --cased_references=FILE [--rounds=3]

Each sentence's constraint is one noun of its reference: the first word after the first that is capitalised
in --cased_references (German capitalises nouns), spelt as in --references (the text the model was trained to
write, e.g. Multi30k's lowercased tokenized files; the word must occur there); a sentence with none has no
constraint. Beam 4 without and with the constraints (and with them in order, for one noun the same), alternating
round by round; medians. A constraint is met as the noun's pieces; the output may go on with more pieces of the
same word (the noun's plural, say), so the table gives both shares. Prints a markdown table; the last line is
one JSON object.
"""

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import sacrebleu  # noqa: E402

from bench.synthetic import cpu_model  # noqa: E402
from flax_transformer import parallel_text  # noqa: E402
from flax_transformer.translator import Translator  # noqa: E402


def reference_nouns(references: list[str], cased: list[str]) -> list[list[str]]:
  """Per sentence [its first noun as the reference spells it] or []: see the module docstring."""
  chosen = []
  for reference, original in zip(references, cased):
    words = set(reference.split())
    noun = next((w.strip('.,;:!?"()').lower() for w in original.split()[1:]
                 if w[:1].isupper() and w.strip('.,;:!?"()').lower() in words), None)
    chosen.append([noun] if noun else [])
  return chosen


def _holds(pieces: list[str], phrase: list[str]) -> bool:
  return any(pieces[i:i + len(phrase)] == phrase for i in range(len(pieces) - len(phrase) + 1))


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--workdir', required=True)
  parser.add_argument('--sentences', required=True)
  parser.add_argument('--references', required=True)
  parser.add_argument('--cased_references', required=True)
  parser.add_argument('--rounds', type=int, default=3)
  args = parser.parse_args()
  sources, references = parallel_text.read_lines(args.sentences), parallel_text.read_lines(args.references)
  constraints = reference_nouns(references, parallel_text.read_lines(args.cased_references))
  translator = Translator.from_workdir(args.workdir)
  tokenize = translator.decoding.bleu_tokenize
  runs = {'beam 4': {}, 'beam 4, one reference noun': {'constraints': constraints}}
  outputs, seconds = {}, {name: [] for name in runs}
  for name, kwargs in runs.items():  # warm-up: compile every shape
    outputs[name] = translator.translate(sources, **kwargs)
  for _ in range(args.rounds):
    for name, kwargs in runs.items():
      start = time.perf_counter()
      outputs[name] = translator.translate(sources, **kwargs)
      seconds[name].append(time.perf_counter() - start)
  constrained = sum(1 for c in constraints if c)
  print(f'{len(sources)} sentences of {args.sentences}, {constrained} with a constraint; {cpu_model()}, '
        f'{os.cpu_count()} cores, JAX {__import__("jax").__version__} on {__import__("jax").default_backend()}; '
        f'median of {args.rounds} alternating rounds\n')
  print('| decoding | outputs holding their noun\'s pieces | ... as a whole word | BLEU | sentences/s | time vs '
        'beam 4 |')
  print('|---|---:|---:|---:|---:|---:|')
  rows = {}
  for name in runs:
    pieces = [translator.processor.encode(out, out_type=str) for out in outputs[name]]
    held = sum(1 for c, out in zip(constraints, pieces) if c and _holds(out, translator.processor.encode(c[0], out_type=str)))
    words = sum(1 for c, out in zip(constraints, outputs[name]) if c and c[0] in out.split())
    bleu = sacrebleu.corpus_bleu(outputs[name], [references], tokenize=tokenize).score
    median = statistics.median(seconds[name])
    rows[name] = {'held': held, 'whole_words': words, 'of': constrained, 'bleu': round(bleu, 2),
                  'sentences_per_second': round(len(sources) / median, 1), 'seconds': round(median, 2)}
    share = lambda count: f'{count}/{constrained} ({100 * count / constrained:.1f}%)'
    print(f'| {name} | {share(held)} | {share(words)} | {bleu:.2f} | {len(sources) / median:.1f} | '
          f'{median / statistics.median(seconds["beam 4"]):.2f}× |')
  print(json.dumps({'cpu': cpu_model(), 'rows': rows}))


if __name__ == '__main__':
  main()
