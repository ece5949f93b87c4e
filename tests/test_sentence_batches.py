"""Sentences to translation batches (sentence_batches.py), against a direct reading of what each batch must hold."""

import numpy as np
import pytest

from flax_transformer import sentence_batches
from flax_transformer.constants import EOS_ID, PAD_ID


class Words:
  """A stand-in SentencePiece processor: one id a word (its length + 3), one for the space between words."""

  def encode(self, text: str) -> list[int]:
    return [3] if text == ' ' else [len(w) + 3 for w in text.split()]


@pytest.mark.parametrize('budget', [16, 64, 1000])
def test_translation_batches_hold_every_sentence_once_cut_padded_and_sorted(budget):
  """Every non-empty sentence in exactly one batch, its row its ids (cut to the limit) + EOS then padding; rows and
  lengths multiples of 8; batches sorted by length and within the token budget unless one sentence exceeds it."""
  rng = np.random.default_rng(budget)
  encoded = [list(rng.integers(3, 50, rng.integers(0, 30))) for _ in range(60)]
  batches = sentence_batches.translation_batches(encoded, limit=20, eval_tokens_per_batch=budget)
  seen = [i for indices, _ in batches for i in indices]
  assert sorted(seen) == [i for i, ids in enumerate(encoded) if ids]
  longest_before = 0
  for indices, inputs in batches:
    assert inputs.shape[0] % 8 == 0 and inputs.shape[1] % 8 == 0 and inputs.dtype == np.int32
    lengths = [min(len(encoded[i]), 20) + 1 for i in indices]
    assert min(lengths) >= longest_before  # sorted by length across batches
    longest_before = max(lengths)
    assert max(lengths) * len(indices) <= budget or len(indices) == 1
    for row, i in enumerate(indices):
      expected = encoded[i][:20] + [EOS_ID]
      assert inputs[row, :len(expected)].tolist() == expected and not inputs[row, len(expected):].any()
    assert (inputs[len(indices):] == PAD_ID).all()


def test_a_long_line_splits_after_sentence_punctuation_into_pieces_within_the_limit():
  words = Words()
  line = 'aa bb. cc dd ee! ff? gg hh ii jj kk ll: mm'
  pieces = sentence_batches.split_at_punctuation(words, line, limit=5)
  assert ' '.join(pieces) == line  # nothing lost, nothing reordered
  assert pieces == ['aa bb.', 'cc dd ee! ff?', 'gg hh ii jj kk ll:', 'mm']  # joined while within 5 (a join costs
  # a space's id); a part with no break inside stays whole, over the limit
  assert sentence_batches.split_at_punctuation(words, 'no break here at all', limit=2) == ['no break here at all']
  assert sentence_batches.encode_sentences(words, ['a b', '  ', '']) == [[4, 4], [], []]
