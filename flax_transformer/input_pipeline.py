"""The pipeline's last stage: the run's one global stream of length-bucketed training batches (§5.1), the
same whatever number of processes reads it.

The stages: parallel_text.py (text pairs) -> token_table.py (SentencePiece ids) -> token_cache.py (the
training split's ids, built once) -> this module.

Every process reads the whole table from the cache and computes the same `bucketing.Batching` from its length
histogram (boundaries, shapes — `config.bucket_shapes` 'pairs' or 'longer_side' —, global batch sizes within
`config.tokens_per_batch`, multiples of data-parallel × accumulation, and draw weights), without an exchange.
The global batch of step t is a function of (seed, t, table):
  - its shape k, drawn by a counter-based hash of (seed, t), each shape weighted by its batches per epoch;
  - its rows, the next B_k places of shape k's endless stream: epoch e of that stream is a permutation of the
    shape's rows seeded by (seed, k, e), and the stream's position is the number of earlier steps that drew
    k (replayed from the draws of steps 0..t-1: milliseconds for a million steps).
Each process gathers only the rows its devices hold (the data-parallel blocks of partitioning.DataShard).

Why this and not packing to one fixed shape: it keeps the paper's batches (§5.1: sentence pairs batched
by approximate length, no sentence split or concatenated) and the model's plain padding masks, at the
cost of a few compiled shapes; packing would need segment-aware attention masks and positions.

The data state saved with a checkpoint is {step, seed, batching fingerprint, multiple}: a run resumes exactly
on any number of processes, and on a mesh of another data-parallel size that divides the saved batch sizes
(the global batch is kept; each device's share changes).

Inspect: python -m flax_transformer inspect --config=configs/multi30k.py (commands/inspect_batches.py)
"""

import collections
import hashlib
import time

import jax
import numpy as np

from flax_transformer import bucketing, cluster, token_cache
from flax_transformer.parallel_text import DataError, DataSettings
from flax_transformer.token_table import TokenTable

HASHES_KEPT = 100_000  # the last steps whose global-batch hashes the iterator remembers, for the metrics log


# --- The global stream -----------------------------------------------------------------------

def _mix(keys: np.ndarray) -> np.ndarray:
  """SplitMix64's finaliser: uint64 keys -> well-spread uint64 values (wrapping arithmetic)."""
  x = keys.astype(np.uint64)
  x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
  x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
  return x ^ (x >> np.uint64(31))


def step_shapes(seed: int, steps: np.ndarray, thresholds) -> np.ndarray:
  """The batch shape of each step in `steps`: shape k for a draw u in [thresholds[k-1], thresholds[k])."""
  thresholds = np.asarray(thresholds, np.uint64)
  keys = _mix(np.full(len(steps), int(seed) % 2 ** 63, np.uint64)) + np.asarray(steps, np.uint64)
  return np.searchsorted(thresholds, _mix(keys) % thresholds[-1], side='right')


def rows_by_shape(table: TokenTable, batching: bucketing.Batching) -> list[np.ndarray]:
  """[shapes] the table rows of each batch shape, ascending."""
  shapes = bucketing.shape_index(table.sources.lengths, table.targets.lengths, batching.boundaries, batching.mode)
  order = np.argsort(shapes, kind='stable')
  return np.split(order, np.searchsorted(shapes[order], np.arange(1, len(batching.batch_sizes))))


class GlobalStream:
  """The global batches of a run: which table rows step t holds, for any t, identical on every process."""

  def __init__(self, table: TokenTable, batching: bucketing.Batching, seed: int):
    self.table, self.batching, self.seed = table, batching, int(seed)
    self.rows = rows_by_shape(table, batching)
    self._permutations = {}  # (shape, epoch) -> [n] the order of that epoch, the last two epochs of a shape

  def shapes(self, steps: np.ndarray) -> np.ndarray:
    return step_shapes(self.seed, steps, self.batching.thresholds)

  def positions(self, step: int) -> np.ndarray:
    """[shapes] how many of steps 0 .. step-1 drew each shape: each shape's place in its stream at `step`."""
    counts = np.zeros(len(self.rows), np.int64)
    for first in range(0, step, 1 << 20):  # bounded memory for long runs
      counts += np.bincount(self.shapes(np.arange(first, min(step, first + (1 << 20)))), minlength=len(self.rows))
    return counts

  def _permutation(self, shape: int, epoch: int) -> np.ndarray:
    key = (shape, epoch)
    if key not in self._permutations:
      for old in [k for k in self._permutations if k[0] == shape and k[1] < epoch - 1]:
        del self._permutations[old]
      generator = np.random.Generator(np.random.Philox(key=[self.seed % 2 ** 64, (shape << 32) | epoch]))
      self._permutations[key] = generator.permutation(len(self.rows[shape]))
    return self._permutations[key]

  def batch_rows(self, shape: int, position: int) -> np.ndarray:
    """[B] the table rows of batch `position` of shape `shape`'s endless stream."""
    size, rows = self.batching.batch_sizes[shape], self.rows[shape]
    element = position * size + np.arange(size)  # [B] places in the endless stream
    epoch, place = element // len(rows), element % len(rows)
    picked = np.empty(size, np.int64)
    for e in np.unique(epoch):
      picked[epoch == e] = rows[self._permutation(shape, int(e))[place[epoch == e]]]
    return picked


def batch_hash(rows: np.ndarray) -> str:
  """A global batch's identity: its table rows, in order."""
  return hashlib.blake2b(np.asarray(rows, '<i8').tobytes(), digest_size=8).hexdigest()


def initial_state(batching: bucketing.Batching, seed: int, multiple: int) -> dict:
  """The data state of a fresh stream."""
  return {'step': 0, 'seed': int(seed), 'batching': batching.fingerprint(), 'multiple': int(multiple)}


class TrainBatches:
  """Iterator of one process's rows of the global training batches {'inputs': [b, S], 'targets': [b, T]} int32
  numpy: the data-parallel blocks `blocks` of `data_parallel`, block by block (all of them on one process).

  `state()` is the position after the last batch returned; `train_batches(..., state=that)` continues exactly
  from there, on any number of processes.
  """

  def __init__(self, stream: GlobalStream, state: dict, blocks: tuple[int, ...] = (0,), data_parallel: int = 1):
    self.stream, self.batching, self.blocks, self.data_parallel = stream, stream.batching, blocks, data_parallel
    self._state = dict(state)
    self._positions = stream.positions(state['step'])
    self._starts = [stream.table.sources.starts(), stream.table.targets.starts()]
    self.hashes = collections.OrderedDict()  # step (1-based, as the loop counts) -> batch_hash of its global batch

  def __iter__(self):
    return self

  def __next__(self) -> dict:
    step = self._state['step']
    shape = int(self.stream.shapes(np.array([step]))[0])
    rows = self.stream.batch_rows(shape, int(self._positions[shape]))
    self._positions[shape] += 1
    self._state['step'] = step + 1
    self.hashes[step + 1] = batch_hash(rows)
    if len(self.hashes) > HASHES_KEPT:
      self.hashes.popitem(last=False)
    local = rows.reshape(self.data_parallel, -1)[list(self.blocks)].ravel()  # this process's blocks, in order
    b = self.batching
    return {'inputs': self.stream.table.sources.padded(local, b.source_lengths[shape], self._starts[0]),
            'targets': self.stream.table.targets.padded(local, b.target_lengths[shape], self._starts[1])}

  def state(self) -> dict:
    return dict(self._state)

  def row_hashes(self, first: int, last: int) -> list[str]:
    """The global-batch hashes of steps first..last (1-based), those still remembered."""
    return [self.hashes[s] for s in range(first, last + 1) if s in self.hashes]


def train_batches(table: TokenTable, batching: bucketing.Batching, seed: int = 0, state: dict | None = None,
                  blocks: tuple[int, ...] = (0,), data_parallel: int = 1) -> TrainBatches:
  """The global stream of `batching` over `table` from `state` (default: step 0 of `seed`), as the rows of
  data-parallel blocks `blocks` of `data_parallel`."""
  state = state or initial_state(batching, seed, data_parallel)
  return TrainBatches(GlobalStream(table, batching, state['seed']), state, tuple(blocks), data_parallel)


def epoch_batches(table: TokenTable, batching: bucketing.Batching, seed: int = 0) -> list[dict]:
  """One epoch, every pair once: each shape's first epoch in batches (its last one padded with empty rows),
  the batches in a seeded order. For inspection; training repeats the stream."""
  stream = GlobalStream(table, batching, seed)
  starts = [table.sources.starts(), table.targets.starts()]
  chunks = []
  for shape, rows in enumerate(stream.rows):
    ordered = rows[stream._permutation(shape, 0)] if len(rows) else rows
    size = batching.batch_sizes[shape]
    for first in range(0, len(ordered), size):
      chunk = np.full(size, -1, np.int64)
      chunk[:len(ordered[first:first + size])] = ordered[first:first + size]
      chunks.append((shape, chunk))
  order = np.random.default_rng(seed).permutation(len(chunks))
  return [{'inputs': table.sources.padded(chunks[i][1], batching.source_lengths[chunks[i][0]], starts[0]),
           'targets': table.targets.padded(chunks[i][1], batching.target_lengths[chunks[i][0]], starts[1])}
          for i in order]


def train_batching(data: DataSettings, histogram: np.ndarray, dropped: int, multiple: int = 1) -> bucketing.Batching:
  """The batching of a length histogram; global batch sizes are multiples of `multiple` (data-parallel × k)."""
  return bucketing.make_batching(histogram, dropped, data.num_bucket_boundaries, data.tokens_per_batch,
                                 multiple, data.bucket_shapes)


def _resumed_batching(data: DataSettings, table: TokenTable, state: dict, multiple: int) -> bucketing.Batching:
  """The batching a saved data state was made with, if this run can continue it; else a one-line DataError."""
  fix = 'or rerun with --config.restore_data_state=false to restart the data stream'
  if 'positions' in state or 'multiple' not in state:
    raise DataError(f'the saved data state is of the per-process stream of earlier versions; {fix}')
  batching = train_batching(data, table.histogram(data.max_train_length), table.dropped, int(state['multiple']))
  if batching.fingerprint() != state['batching']:
    raise DataError(f'the saved data state belongs to another batching (other data, vocabulary, max_train_length, '
                    f'tokens_per_batch, num_bucket_boundaries or bucket_shapes); restore those, {fix}')
  if any(size % multiple for size in batching.batch_sizes):
    raise DataError(f'the saved global batches hold multiples of {state["multiple"]} rows, which this mesh '
                    f'cannot split into data-parallel x accumulation = {multiple} equal parts; use a mesh whose '
                    f'data x fsdp size times config.gradient_accumulation_steps divides {state["multiple"]}, {fix}')
  return batching


def process_train_batches(data: DataSettings, vocab_path: str, workdir, blocks: tuple[int, ...],
                          data_parallel: int, seed: int, state: dict | None = None) -> TrainBatches:
  """This process's rows (data-parallel blocks `blocks` of `data_parallel`) of the run's global stream, from
  the token cache (built first where missing; collective: call on every process)."""
  error, table = None, None
  try:
    table = token_cache.train_table(data, vocab_path, workdir, (jax.process_index(), jax.process_count()))
  except DataError as raised:
    error = raised
  cluster.agree('training data', error)
  multiple = data_parallel * data.gradient_accumulation_steps
  if state is None:
    batching = train_batching(data, table.histogram(data.max_train_length), table.dropped, multiple)
    state = initial_state(batching, seed, multiple)
  else:
    batching = _resumed_batching(data, table, state, multiple)
  prints = cluster.agree('batching', value=batching.fingerprint())
  if len(set(prints)) > 1:  # every process must hold the same batching, or the batch shapes differ
    raise DataError('the processes computed different batchings; run every process with the same config, '
                    'data and vocabulary')
  return TrainBatches(GlobalStream(table, batching, state['seed']), state, tuple(blocks), data_parallel)


# --- Inspection ------------------------------------------------------------------------------

def _fill(batches) -> tuple[int, int]:
  real = sum(int((b['inputs'] > 0).sum() + (b['targets'] > 0).sum()) for b in batches)
  return real, sum(b['inputs'].size + b['targets'].size for b in batches)


def inspect(data: DataSettings, vocab_path: str, workdir) -> dict:
  """One epoch of training batches on one process: counts, shapes, budget, token-cache and batch-serving
  throughput; then the fill of the repeated stream over as many batches."""
  start = time.perf_counter()
  table = token_cache.train_table(data, vocab_path, workdir)
  table_seconds = time.perf_counter() - start
  batching = train_batching(data, table.histogram(data.max_train_length), table.dropped)
  start = time.perf_counter()
  epoch = epoch_batches(table, batching, seed=data.seed)
  seconds = time.perf_counter() - start
  shapes = sorted({(b['inputs'].shape[0], b['inputs'].shape[1], b['targets'].shape[1]) for b in epoch})
  tokens = [int((b['targets'] > 0).sum()) for b in epoch]
  stream = train_batches(table, batching, seed=data.seed)
  real, padded = _fill([next(stream) for _ in epoch])
  epoch_real, epoch_padded = _fill(epoch)
  table_tokens = int(table.sources.lengths.sum() + table.targets.lengths.sum())
  return {'examples': sum(int((b['targets'] > 0).any(1).sum()) for b in epoch), 'batches': len(epoch),
          'shapes': len(shapes), 'shape_list': shapes, 'boundaries': list(batching.boundaries),
          'tokens_per_batch': {'min': min(tokens), 'median': float(np.median(tokens)), 'max': max(tokens),
                               'budget': data.tokens_per_batch},
          'non_padding_fraction': round(real / padded, 4),
          'epoch_non_padding_fraction': round(epoch_real / epoch_padded, 4),
          'dropped_too_long': batching.dropped,
          'table_tokens_per_second': round(table_tokens / table_seconds, 1),
          'tokens_per_second': round(sum(tokens) / seconds, 1)}


if __name__ == '__main__':  # the program is python -m flax_transformer inspect
  from flax_transformer.__main__ import moved
  moved('input_pipeline', 'inspect')
