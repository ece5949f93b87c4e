"""Scores: validation loss/perplexity/accuracy sums, sacreBLEU, and the paper's compound-split BLEU (the translations
come from translator.py)."""

import math
import re

import jax
import sacrebleu



def evaluate_loss(eval_step, params, batches, to_global, should_stop=None) -> dict | None:
  """Sums the jitted eval step over `batches` (numpy dicts); returns per-token loss, perplexity, accuracy.

  Returns None, abandoning the rest, as soon as `should_stop()` is true (checked before each batch).
  """
  totals = None
  for batch in batches:
    if should_stop and should_stop():
      return None
    sums = eval_step(params, to_global(batch))
    totals = sums if totals is None else jax.tree_util.tree_map(lambda a, b: a + b, totals, sums)
  totals = jax.device_get(totals)
  tokens = max(float(totals['tokens']), 1.0)
  nll = float(totals['nll']) / tokens
  return {'loss': float(totals['loss']) / tokens, 'nll': nll, 'perplexity': math.exp(min(nll, 50.0)),
          'accuracy': float(totals['correct']) / tokens, 'tokens': tokens}


def bleu(hypotheses: list[str], references: list[str], tokenize: str = '13a', lowercase: bool = False):
  """sacreBLEU corpus BLEU; returns (score, signature string)."""
  # tokenize='none' scores already-tokenized text on purpose: no "forgot to detokenize" warning at every eval.
  metric = sacrebleu.metrics.BLEU(tokenize=tokenize, lowercase=lowercase, force=tokenize == 'none')
  result = metric.corpus_score(hypotheses, [references])
  return result.score, str(metric.get_signature())


def split_compounds(text: str) -> str:
  """tensor2tensor's get_ende_bleu.sh compound splitting: 'a-b' -> 'a ##AT##-##AT## b'."""
  return re.sub(r'(\S)-(\S)', r'\1 ##AT##-##AT## \2', text)


def paper_bleu(hypotheses: list[str], references: list[str]):
  """The tokenized, compound-split BLEU that WMT14 EN-DE papers (Vaswani et al. 2017 included) report.

  Tokenisation approximates Moses with sacreBLEU's 13a tokenizer; the score is computed on the split
  tokens with tokenize='none'. Not comparable to detokenized sacreBLEU; labelled as such.
  Returns (score, label).
  """
  from sacrebleu.tokenizers.tokenizer_13a import Tokenizer13a
  tokenizer = Tokenizer13a()
  prepare = lambda text: split_compounds(tokenizer(text))
  score, _ = bleu([prepare(h) for h in hypotheses], [prepare(r) for r in references], tokenize='none')
  return score, 'tokenized BLEU, 13a tokens + compound splitting (paper-comparable, not sacreBLEU)'
