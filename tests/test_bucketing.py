"""Length buckets: the boundaries that pad least (checked exhaustively against the dynamic programme)."""

import numpy as np

from flax_transformer import bucketing


def test_bucket_boundaries_minimise_padding():
  rng = np.random.default_rng(0)
  lengths = np.concatenate([rng.integers(5, 12, 500), rng.integers(20, 26, 300), [40]])
  histogram = np.bincount(lengths, minlength=101)
  boundaries = bucketing.bucket_boundaries(histogram, 3)
  assert boundaries[-1] == 40  # the longest pair present

  def padding(bounds):
    padded = np.asarray(bounds)[np.searchsorted(bounds, lengths)]
    return int((padded - lengths).sum())
  # Exhaustive check of the DP: no other 3 boundaries ending at 40 pad less.
  best = min(padding([a, b, 40]) for a in range(1, 40) for b in range(a + 1, 40))
  assert padding(boundaries) == best
  assert bucketing.bucket_boundaries(np.bincount([7, 7, 9], minlength=20), 5) == [7, 9]  # no more than needed
