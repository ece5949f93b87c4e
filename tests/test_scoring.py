"""Scores of translations (scoring.py): sacreBLEU as configured, and the paper's tokenized, compound-split BLEU
checked against BLEU computed by hand."""

import math

from flax_transformer import scoring


def test_compounds_split_as_tensor2tensor_does():
  assert scoring.split_compounds('Rot-Kreuz-Helfer und ein - Strich') == (
      'Rot ##AT##-##AT## Kreuz ##AT##-##AT## Helfer und ein - Strich')


def test_paper_bleu_scores_the_split_tokens():
  """One sentence whose hyphen splits into three tokens: BLEU over the split tokens, by the formula (n-gram
  precisions' geometric mean, brevity penalty 1 for equal lengths)."""
  hypothesis, reference = 'Das Rot-Kreuz Haus steht .', 'Das Rot-Kreuz Haus steht dort .'
  score, label = scoring.paper_bleu([hypothesis], [reference])
  # split: hyp 'Das Rot ##AT##-##AT## Kreuz Haus steht .' (7 tokens), ref the same with 'dort' before '.' (8)
  hyp = 'Das Rot ##AT##-##AT## Kreuz Haus steht .'.split()
  ref = 'Das Rot ##AT##-##AT## Kreuz Haus steht dort .'.split()
  precisions = []
  for n in range(1, 5):
    grams = [tuple(hyp[i:i + n]) for i in range(len(hyp) - n + 1)]
    ref_grams = [tuple(ref[i:i + n]) for i in range(len(ref) - n + 1)]
    matched = sum(min(grams.count(g), ref_grams.count(g)) for g in set(grams))
    precisions.append(matched / len(grams))
  expected = 100 * math.exp(1 - len(ref) / len(hyp)) * math.exp(sum(map(math.log, precisions)) / 4)
  assert abs(score - expected) < 1e-9 and 'compound splitting' in label


def test_bleu_lowercase_and_signature():
  score, signature = scoring.bleu(['A dog runs .'], ['a dog runs .'], tokenize='none', lowercase=True)
  assert abs(score - 100.0) < 1e-9 and 'case:lc' in signature and 'tok:none' in signature
