"""Evaluation loops: validation loss/perplexity/accuracy, and translate-then-sacreBLEU."""

import math
import re

import jax
import numpy as np
import sacrebleu

from flax_transformer import decode, input_pipeline, platforms, tokenizer
from flax_transformer.model import Transformer


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


def translate_sentences(params, model_config, processor, sentences: list[str], *, beam_size: int, alpha: float,
                        max_extra_length: int, batch_tokens: int = 4096, progress=None,
                        should_stop=None, top_k: str = 'auto', encoded: list[list[int]] | None = None
                        ) -> list[str] | None:
  """Translates `sentences` in length-sorted batches and returns the translations in input order.

  Empty sentences translate to empty strings; sources longer than the model's position table are cut.
  Returns None, abandoning the rest, as soon as `should_stop()` is true (checked before each batch).
  top_k: config.beam_top_k ('auto', 'two_stage' or 'lax').
  encoded: the sentences' ids from `input_pipeline.encode_sentences`, when the caller already has them.
  """
  model = Transformer(model_config)
  outputs = [''] * len(sentences)
  if encoded is None:
    encoded = input_pipeline.encode_sentences(processor, sentences)
  batches = input_pipeline.translation_batches(encoded, model_config.max_len - 1, batch_tokens)
  total, done = sum(len(indices) for indices, _ in batches), 0
  for indices, inputs in batches:
    if should_stop and should_stop():
      return None
    max_decode_len = decode.decode_length(inputs.shape[1], max_extra_length, model_config.max_len)
    translate = decode.jitted_translate(model, beam_size, alpha, max_extra_length, max_decode_len,
                                        platforms.top_k(top_k))
    tokens, _ = translate(params, inputs)
    tokens = np.asarray(jax.device_get(tokens))
    for row, i in enumerate(indices):
      outputs[i] = tokenizer.decode_ids(processor, tokens[row])
    done += len(indices)
    if progress:
      progress(done, total)
  return outputs


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
