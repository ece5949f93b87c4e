"""The pipeline's last stage: length-bucketed training batches (§5.1) from the token table, with tf.data.

The stages: parallel_text.py (text pairs) -> token_table.py (SentencePiece ids in memory) -> this module.

Training, on one process or many. Each data shard (the processes that feed the same rows of the global
batch; one per host on a data-parallel mesh) tokenises its 1/shards of the split once into an in-memory
table. The shards' joint (source, target) length histograms are summed, and from that global histogram
every process computes the same `bucketing.Batching`: boundaries, shapes (`config.bucket_shapes`:
'pairs' or 'longer_side'), global batch sizes within `config.tokens_per_batch` and draw weights. The
shape of step t is drawn from one seeded sequence shared by every process (`tf.random.stateless_uniform`
at (seed, t), weighted by each shape's batches per epoch), and each shard fills it from its own rows of
that shape, reshuffled every epoch by `tf.random.experimental.index_shuffle`
(`tf.data.Dataset.choose_from_datasets` over one stream per shape). So at every step every process
builds a batch of the same shape, and the global batch is one array of one compiled program.

Why this and not packing to one fixed shape: it keeps the paper's batches (§5.1: sentence pairs batched
by approximate length, no sentence split or concatenated) and the model's plain padding masks, at the
cost of a few compiled shapes; packing would need segment-aware attention masks and positions.

The iterator's state is a handful of integers (the step and each shape's batch position), saved per
process with each checkpoint; resume is exact. `tokens_per_batch` is the global batch (the paper's
~25,000 source and ~25,000 target tokens), split across shards and devices.

Inspect: python -m flax_transformer.input_pipeline --config=configs/multi30k.py (commands/inspect_batches.py)
"""

if __name__ == '__main__':  # the inspection program, before anything imports TensorFlow
  from flax_transformer.commands.inspect_batches import console
  console()

import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from flax_transformer import bucketing, cluster  # noqa: E402
from flax_transformer.parallel_text import DataError, DataSettings  # noqa: E402
from flax_transformer.errors import UserError  # noqa: E402
from flax_transformer.token_table import TokenTable, train_table  # noqa: E402



# --- Training batches ------------------------------------------------------------------------

def _schedule_seed(seed: int, stream: int) -> int:
  """The stateless seed of one random stream of a run: 0 draws the shapes, k + 1 shuffles shape k."""
  return (int(seed) % 2 ** 31) * 2 ** 16 + stream


def initial_state(batching: bucketing.Batching, shard: tuple[int, int], seed: int) -> dict:
  """The data state of a fresh stream: step 0, every shape at its first batch."""
  return {'step': 0, 'positions': [0] * len(batching.batch_sizes), 'seed': int(seed), 'shard': list(shard),
          'batching': batching.fingerprint()}


def _shape_stream(sources: tf.RaggedTensor, targets: tf.RaggedTensor, rows: np.ndarray,
                  shape: int, batching: bucketing.Batching, shard_count: int, seed: int, start: int,
                  repeat: bool) -> tf.data.Dataset:
  """This shard's batches of one shape: its rows in a fresh random order every epoch, `batch` at a time."""
  batch = batching.batch_sizes[shape] // shard_count
  source_length, target_length = batching.source_lengths[shape], batching.target_lengths[shape]
  n = len(rows)
  rows = tf.constant(rows, tf.int64)
  shuffle_seed = _schedule_seed(seed, shape + 1)

  def make(position):  # position: the batch's number in this shape's stream
    element = position * batch + tf.range(batch, dtype=tf.int64)  # [batch] places in the endless stream
    if n == 0:  # this shard holds no pair of this shape: a batch of padding (weight 0)
      inputs = tf.zeros([batch, source_length], tf.int32)
      outputs = tf.zeros([batch, target_length], tf.int32)
    else:
      epoch, place = element // n, element % n
      seeds = tf.stack([tf.fill([batch], tf.constant(shuffle_seed, tf.int64)), epoch, tf.zeros_like(epoch)],
                       axis=1)  # [batch, 3]: epoch e of this shape is permutation (seed, e)
      # The raw op: the public wrapper mis-pads per-row seeds.
      permuted = tf.raw_ops.RandomIndexShuffle(index=place, seed=seeds, max_index=tf.fill([batch], np.int64(n - 1)),
                                               rounds=4)  # [batch]
      picked = tf.gather(rows, permuted)
      valid = tf.cast(element < n, tf.int32)[:, None] if not repeat else 1  # [batch, 1]: an epoch's last batch
      inputs = tf.cast(tf.gather(sources, picked).to_tensor(shape=[batch, source_length]), tf.int32) * valid
      outputs = tf.cast(tf.gather(targets, picked).to_tensor(shape=[batch, target_length]), tf.int32) * valid
    return {'inputs': inputs, 'targets': outputs, 'shape': tf.constant(shape, tf.int64), 'position': position}

  positions = tf.data.Dataset.counter(start) if repeat else tf.data.Dataset.range(-(-n // batch))
  return positions.map(make, num_parallel_calls=tf.data.AUTOTUNE)


class TrainBatches:
  """Iterator of one process's training batches {'inputs': [B, S], 'targets': [B, T]} int32 numpy.

  `state()` is the position after the last batch returned; `train_batches(..., state=that)` continues
  exactly from there.
  """

  def __init__(self, dataset: tf.data.Dataset, state: dict, batching: bucketing.Batching):
    self._iterator = iter(dataset)
    self._state = {**state, 'positions': list(state['positions'])}
    self.batching = batching

  def __iter__(self):
    return self

  def __next__(self) -> dict:
    batch = next(self._iterator)
    self._state['step'] += 1
    self._state['positions'][int(batch['shape'])] = int(batch['position']) + 1
    return {'inputs': batch['inputs'].numpy(), 'targets': batch['targets'].numpy()}

  def state(self) -> dict:
    return {**self._state, 'positions': list(self._state['positions'])}


def train_batches(table: TokenTable, batching: bucketing.Batching, shard: tuple[int, int] = (0, 1), seed: int = 0,
                  state: dict | None = None, repeat: bool = True) -> TrainBatches:
  """This shard's training batches under `batching`: at step t the shape every shard draws, filled from `table`.

  repeat=False gives one epoch of this shard (every pair once, the last batch of each shape padded with
  empty rows) for inspection; its batch count depends on the shard, so only `repeat` runs on many processes.
  """
  state = state or initial_state(batching, shard, seed)
  shapes = bucketing.shape_index(table.sources.lengths, table.targets.lengths, batching.boundaries, batching.mode)
  order = np.argsort(shapes, kind='stable')
  rows = np.split(order, np.searchsorted(shapes[order], np.arange(1, len(batching.batch_sizes))))
  with tf.device('/CPU:0'):
    sources, targets = table.sources.ragged(), table.targets.ragged()
  streams = [_shape_stream(sources, targets, rows[k], k, batching, shard[1], state['seed'],
                           state['positions'][k], repeat) for k in range(len(batching.batch_sizes))]
  thresholds = tf.constant(batching.thresholds, tf.int64)
  schedule_seed = _schedule_seed(state['seed'], 0)

  def draw(step):  # the shape of `step`: the same on every process
    u = tf.random.stateless_uniform([], tf.stack([tf.constant(schedule_seed, tf.int64), step]), minval=0,
                                    maxval=thresholds[-1], dtype=tf.int64)
    return tf.searchsorted(thresholds, u[None], side='right', out_type=tf.int64)[0]

  if repeat:
    dataset = tf.data.Dataset.choose_from_datasets(streams, tf.data.Dataset.counter(state['step']).map(draw))
  else:  # one epoch of this shard: the shapes mixed in proportion to their batches left
    weights = [-(-len(r) // (size // shard[1])) for r, size in zip(rows, batching.batch_sizes)]
    dataset = tf.data.Dataset.sample_from_datasets(streams, [w / sum(weights) for w in weights], seed=state['seed'],
                                                   stop_on_empty_dataset=False)
  options = tf.data.Options()
  options.deterministic = True  # Same seed and state, same batch sequence (exact resume depends on it).
  return TrainBatches(dataset.with_options(options).prefetch(tf.data.AUTOTUNE), state, batching)


def train_batching(data: DataSettings, histogram: np.ndarray, dropped: int, data_parallel_size: int = 1) -> bucketing.Batching:
  """The batching of a global length histogram; global batch sizes are multiples of data-parallel × k."""
  return bucketing.make_batching(histogram, dropped, data.num_bucket_boundaries, data.tokens_per_batch,
                             data_parallel_size * data.gradient_accumulation_steps, data.bucket_shapes)


def _sum_over_shards(values: np.ndarray, shard: tuple[int, int]) -> np.ndarray:
  """The sum of an int vector over the data shards (each counted once), identical on every process."""
  if jax.process_count() == 1:
    return values
  from jax.experimental import multihost_utils
  gathered = np.asarray(multihost_utils.process_allgather(np.concatenate([[shard[0]], values]).astype(np.int32)))
  _, first = np.unique(gathered[:, 0], return_index=True)
  if len(first) != shard[1]:
    raise DataError(f'the processes report {len(first)} data shards, expected {shard[1]}')
  return gathered[first, 1:].astype(np.int64).sum(0)


def process_train_batches(data: DataSettings, vocab_path: str, shard: tuple[int, int], data_parallel_size: int,
                          seed: int, state: dict | None = None) -> TrainBatches:
  """This process's training batches in a run of any number of processes (collective: call on all)."""
  table, error = None, None
  try:
    table = train_table(data, vocab_path, shard)
  except UserError as raised:  # a shard without usable data, a file only this process cannot read...
    error = raised
  cluster.agree('training data', error)  # every process stops on it, before the collective below
  size = data.max_train_length + 1
  totals = _sum_over_shards(np.concatenate([[table.dropped], table.histogram(data.max_train_length).ravel()]), shard)
  batching = train_batching(data, totals[1:].reshape(size, size), int(totals[0]), data_parallel_size)
  if jax.process_count() > 1:  # every process must hold the same batching, or the batch shapes differ
    from jax.experimental import multihost_utils
    fingerprint = np.frombuffer(bytes.fromhex(batching.fingerprint()), np.int32)
    if not (np.asarray(multihost_utils.process_allgather(fingerprint)) == fingerprint).all():
      raise DataError('the processes computed different batchings; run every process with the same config, '
                      'data and vocabulary')
  saved = None if state is None else state.get('batching', state.get('plan'))  # 'plan': its name in older checkpoints
  if state is not None and (state.get('shard') != list(shard) or saved != batching.fingerprint()):
    raise DataError(f'the saved data-iterator state belongs to data shard {state.get("shard")} of another batch batching '
                    f'or mesh (this process: shard {list(shard)}); rerun with --config.restore_data_state=false '
                    f'to restart the data stream')
  return train_batches(table, batching, shard, seed, state)


# --- Inspection ------------------------------------------------------------------------------

def _fill(batches) -> tuple[int, int]:
  real = sum(int((b['inputs'] > 0).sum() + (b['targets'] > 0).sum()) for b in batches)
  return real, sum(b['inputs'].size + b['targets'].size for b in batches)


def inspect(data: DataSettings, vocab_path: str) -> dict:
  """One epoch of training batches (no repeat) on one process: counts, shapes, budget, table-build and
  batch-serving throughput; then the fill of the repeated stream over as many batches."""
  start = time.perf_counter()
  table = train_table(data, vocab_path)
  table_seconds = time.perf_counter() - start
  batching = train_batching(data, table.histogram(data.max_train_length), table.dropped)
  start = time.perf_counter()
  epoch = list(train_batches(table, batching, repeat=False, seed=data.seed))
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

