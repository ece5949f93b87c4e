"""Sentences to translation batches: encoded (SentencePiece ids), lines longer than the model takes split at
sentence punctuation, and grouped by length into padded batches whose rows and lengths are multiples of 8 (a
few shapes, a few compilations)."""

import re

import numpy as np

from flax_transformer.constants import EOS_ID, PAD_ID


def _round_up(x: int, to: int) -> int:
  return -(-x // to) * to


_SENTENCE_END = re.compile(r'(?<=[.!?;:])\s+')


def encode_sentences(processor, sentences: list[str]) -> list[list[int]]:
  """Each sentence's token ids (no EOS); a blank sentence has none."""
  return [processor.encode(s) if s.strip() else [] for s in sentences]


def split_at_punctuation(processor, sentence: str, limit: int) -> list[str]:
  """`sentence` as pieces cut after sentence punctuation (. ! ? ; :) and regrouped greedily, each within
  `limit` tokens where the punctuation allows (a piece with no such break inside stays whole, and is cut).

  Each part is encoded once: a joined piece's length is its parts' plus a space's per join (SentencePiece
  does not merge tokens across whitespace).
  """
  parts = _SENTENCE_END.split(sentence.strip())
  lengths, space = [len(processor.encode(part)) for part in parts], len(processor.encode(' '))
  pieces, current, current_length = [], parts[0], lengths[0]
  for part, length in zip(parts[1:], lengths[1:]):
    if current_length + space + length > limit:
      pieces.append(current)
      current, current_length = part, length
    else:
      current, current_length = f'{current} {part}', current_length + space + length
  return pieces + [current]


def translation_batches(encoded: list[list[int]], limit: int, eval_tokens_per_batch: int,
                        max_batch: int = 512) -> list[tuple[list[int], np.ndarray]]:
  """Sentences' ids (`encode_sentences`) as length-sorted batches to translate, each (its sentences'
  indices in `encoded`, right-padded ids [rows, length] int32 ending in EOS), of about `eval_tokens_per_batch`
  source tokens.

  Sentences longer than `limit` tokens are cut to `limit` (plus EOS); empty ones are left out (they
  translate to empty lines). Rows and lengths are rounded up to multiples of 8: a few shapes, a few
  compilations; padding rows are all PAD_ID.
  """
  encoded = [ids[:limit] + [EOS_ID] if ids else [] for ids in encoded]
  order = sorted((i for i, ids in enumerate(encoded) if ids), key=lambda i: len(encoded[i]))
  groups, current, longest = [], [], 0
  for i in order:
    if current and (max(longest, len(encoded[i])) * (len(current) + 1) > eval_tokens_per_batch or len(current) >= max_batch):
      groups.append(current)
      current, longest = [], 0
    current.append(i)
    longest = max(longest, len(encoded[i]))
  if current:
    groups.append(current)
  batches = []
  for indices in groups:
    inputs = np.full((_round_up(len(indices), 8), _round_up(max(len(encoded[i]) for i in indices), 8)), PAD_ID,
                     np.int32)  # [rows, length]
    for row, i in enumerate(indices):
      inputs[row, :len(encoded[i])] = encoded[i]
    batches.append((indices, inputs))
  return batches
