"""Length buckets and the batching (§5.1) that every process of a run computes identically.

Input: the joint (source length, target length) histogram of the *whole* training split, summed over
the processes' shards. Output: a `Batching` — the bucket boundaries, the padded shape of each batch
kind, its global batch size (rows within `tokens_per_batch`), and the integer weights with which the
shape of step t is drawn. Being a pure function of the global histogram and the config, it is the same
on every process, so at every step every process builds a batch of the same shape (each from its own
shard), and the global batch is one array of one compiled shape.
"""

import dataclasses
import hashlib
import json

import numpy as np

from flax_transformer.errors import UserError

BUCKET_SHAPES = ('pairs', 'longer_side')
WEIGHT_SCALE = 2 ** 24  # Integer draw weights: a shape's weight is its expected batches per epoch × 2^24.


class BatchingError(UserError):
  """A configuration that cannot batch the data; the message says what to change."""


def check_bucket_shapes(mode: str) -> None:
  if mode not in BUCKET_SHAPES:
    raise BatchingError(f"config.bucket_shapes={mode!r} is not one of {', '.join(BUCKET_SHAPES)}")


def bucket_boundaries(histogram: np.ndarray, count: int) -> list[int]:
  """At most `count` padded lengths that minimise the padding of a length histogram.

  histogram: [max_train_length + 1] pairs whose longer side has l tokens. The last boundary is the longest
  length present. Dynamic programming: cost[k, b] is the least padding of all lengths <= b with k
  boundaries, the last at b, so boundaries land where the data is dense and few shapes pad little.
  """
  if count < 1:
    raise BatchingError(f'config.num_bucket_boundaries={count}: must be at least 1')
  histogram = np.asarray(histogram, np.int64)
  present = np.flatnonzero(histogram)
  longest = int(present[-1]) if present.size else 1
  histogram = histogram[:longest + 1]
  n_upto = np.cumsum(histogram)  # [L + 1] pairs of length <= b
  sum_upto = np.cumsum(histogram * np.arange(longest + 1))  # [L + 1] their total length
  a, b = np.meshgrid(np.arange(longest + 1), np.arange(longest + 1), indexing='ij')
  padding = np.where(a < b, b * (n_upto[b] - n_upto[a]) - (sum_upto[b] - sum_upto[a]), np.inf)  # [a, b]: pad (a, b] to b
  cost = np.full((count + 1, longest + 1), np.inf)
  parent = np.zeros((count + 1, longest + 1), np.int64)
  cost[0, 0] = 0.0
  for k in range(1, count + 1):
    total = cost[k - 1][:, None] + padding  # [a, b]
    parent[k] = np.argmin(total, axis=0)
    cost[k] = total[parent[k], np.arange(longest + 1)]
  k = min(range(1, count + 1), key=lambda k: (cost[k, longest], k))
  boundaries, b = [], longest
  while k > 0 and b > 0:
    boundaries.append(b)
    b, k = int(parent[k, b]), k - 1
  return sorted(boundaries)


def bucket_shapes(boundaries: list[int], mode: str = 'pairs') -> tuple[np.ndarray, np.ndarray]:
  """Padded (source, target) lengths of each batch shape, for bucket m of the longer side.

  'pairs', 3 shapes per bucket: shape 3m has both sides in bucket m; 3m+1: target in m, source shorter
  (padded to bucket m-1); 3m+2: source in m, target shorter. 'longer_side': shape m pads both sides to
  bucket m (more padding, a third of the compilations).
  """
  b = list(boundaries)
  if mode == 'longer_side':
    return np.array(b), np.array(b)
  source, target = [], []
  for m, length in enumerate(b):
    shorter = b[m - 1] if m else length
    source += [length, shorter, length]
    target += [length, length, shorter]
  return np.array(source), np.array(target)


def shape_index(source_lengths: np.ndarray, target_lengths: np.ndarray, boundaries: list[int],
                mode: str = 'pairs') -> np.ndarray:
  """The batch shape (an index into `bucket_shapes`) of each pair; lengths must be <= boundaries[-1]."""
  i = np.searchsorted(boundaries, source_lengths)  # bucket of each side: first boundary >= length
  j = np.searchsorted(boundaries, target_lengths)
  m = np.maximum(i, j)
  if mode == 'longer_side':
    return m
  return 3 * m + np.where(i == j, 0, np.where(j > i, 1, 2))


def batch_sizes(boundaries: list[int], tokens_per_batch: int, multiple: int, mode: str = 'pairs') -> np.ndarray:
  """Global rows per shape: the most within `tokens_per_batch` on both sides, a multiple of `multiple`."""
  longer = np.maximum(*bucket_shapes(boundaries, mode))
  sizes = tokens_per_batch // longer // multiple * multiple
  if sizes.min() < multiple:
    raise BatchingError(f'config.tokens_per_batch={tokens_per_batch} cannot hold {multiple} sentences of '
                    f'{boundaries[-1]} tokens (a multiple of the data-parallel size times gradient accumulation '
                    f'steps); raise it to at least {multiple * boundaries[-1]} or lower config.max_train_length')
  return sizes


@dataclasses.dataclass(frozen=True)
class Batching:
  """What every process agrees on: the shapes, their global batch sizes and draw weights."""
  boundaries: tuple[int, ...]
  mode: str
  source_lengths: tuple[int, ...]  # [shapes] padded source length of each shape
  target_lengths: tuple[int, ...]  # [shapes]
  batch_sizes: tuple[int, ...]  # [shapes] global rows
  pairs: tuple[int, ...]  # [shapes] training pairs of each shape in the whole split
  thresholds: tuple[int, ...]  # [shapes] cumulative integer weights; shape k is drawn for u in [t[k-1], t[k])
  dropped: int  # pairs over max_train_length on either side, in the whole split

  @property
  def used_shapes(self) -> list[int]:
    return [k for k, n in enumerate(self.pairs) if n]

  def fingerprint(self) -> str:
    return hashlib.sha256(json.dumps(dataclasses.asdict(self), sort_keys=True).encode()).hexdigest()[:16]


def make_batching(histogram: np.ndarray, dropped: int, num_boundaries: int, tokens_per_batch: int, multiple: int,
                  mode: str = 'pairs') -> Batching:
  """The batching of a joint length histogram ([L + 1, L + 1]: pairs of source length s, target length t).

  A shape's weight is the number of batches it fills per epoch (pairs / global batch size): the shape of
  each step is drawn in proportion, so over an epoch each pair is seen about once whatever its length.
  """
  check_bucket_shapes(mode)
  histogram = np.asarray(histogram, np.int64)
  if histogram.sum() == 0:
    raise BatchingError('no training pair fits config.max_train_length on both sides; raise config.max_train_length')
  boundaries = bucket_boundaries(np.bincount(np.maximum(*np.indices(histogram.shape)).ravel(),
                                             weights=histogram.ravel(), minlength=histogram.shape[0]), num_boundaries)
  source, target = np.nonzero(histogram)
  counts = np.bincount(shape_index(source, target, boundaries, mode), weights=histogram[source, target],
                       minlength=len(bucket_shapes(boundaries, mode)[0])).astype(np.int64)
  sizes = batch_sizes(boundaries, tokens_per_batch, multiple, mode)
  weights = [max(1, int(n) * WEIGHT_SCALE // int(size)) if n else 0 for n, size in zip(counts, sizes)]
  source_lengths, target_lengths = bucket_shapes(boundaries, mode)
  return Batching(boundaries=tuple(int(b) for b in boundaries), mode=mode,
                   source_lengths=tuple(int(x) for x in source_lengths),
                   target_lengths=tuple(int(x) for x in target_lengths),
                   batch_sizes=tuple(int(x) for x in sizes), pairs=tuple(int(x) for x in counts),
                   thresholds=tuple(int(x) for x in np.cumsum(weights)), dropped=int(dropped))
