"""Parallel text -> SentencePiece ids -> length-bucketed token batches (§5.1), with tf.data.

Two sources behind one interface: a tfds dataset (`config.dataset='wmt14_translate/de-en'`) or
plain/.gz text files, one sentence a line (`config.dataset='files'`).

Training, on one process or many. Each data shard (the processes that feed the same rows of the global
batch; one per host on a data-parallel mesh) tokenises its 1/shards of the split once into an in-memory
table. The shards' joint (source, target) length histograms are summed, and from that global histogram
every process computes the same `bucketing.BatchPlan`: boundaries, shapes (`config.bucket_shapes`:
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

Evaluation: every process reads the whole split and builds the same batches in file order (the last one
padded with all-padding rows, weight 0), so the global evaluation batch is the same on every process.

Inspect: python -m flax_transformer.input_pipeline --config=configs/multi30k.py
"""
import dataclasses
import gzip
import itertools
import json
import os
import sys
import time
import zlib

import jax
import numpy as np
import tensorflow as tf

from flax_transformer import bucketing, cluster, storage
from flax_transformer.constants import EOS_ID, PAD_ID
from flax_transformer.errors import UserError



class DataError(UserError):
  """Input data that cannot be used; the message says what and how to fix it."""


# --- Sources -------------------------------------------------------------------------------

def read_lines(path: str) -> list[str]:
  """Lines of a plain or gzipped UTF-8 file, without newlines."""
  _check_file(path)
  data = storage.path(path).read_bytes()
  if path.endswith('.gz'):
    try:
      data = gzip.decompress(data)
    except (OSError, EOFError, zlib.error) as error:
      raise _damaged_gzip(path, error) from None
  return decode_lines(data, path)


def decode_lines(data: bytes, name: str) -> list[str]:
  """UTF-8 bytes -> lines without newlines; a bad line is a one-line error naming `name` and its number."""
  lines = data.split(b'\n')
  if lines and lines[-1] == b'':
    lines.pop()
  return [decode_line(line.rstrip(b'\r'), name, number) for number, line in enumerate(lines, 1)]


def decode_line(line: bytes, name: str, number: int) -> str:
  """One line's bytes as text, or a one-line error naming `name` and the line's number."""
  try:
    return line.decode('utf-8')
  except UnicodeDecodeError as error:
    raise DataError(f'{name}: line {number} is not valid UTF-8 ({error.reason} at byte {error.start}); '
                    f're-encode the file as UTF-8') from None


def _damaged_gzip(path: str, error: BaseException) -> DataError:
  reason = str(error).splitlines()[0] if str(error) else type(error).__name__
  return DataError(f'{path} is not a readable gzip file ({reason}); download or copy it again, or give it '
                   f'without the .gz suffix if it is plain text')


def _check_file(path: str) -> None:
  if not path:
    raise DataError('a data file path is empty; set the config.*_source / config.*_target paths')
  if not storage.path(path).exists():
    raise DataError(f'data file {path} does not exist; check the path (override with --config.<field>=PATH)')


def _raw_lines(path: str):
  """The lines of a plain or gzipped file as bytes, without line ends, streamed (never the whole file)."""
  with storage.path(path).open('rb') as raw:
    stream = gzip.GzipFile(fileobj=raw) if path.endswith('.gz') else raw
    try:
      for line in stream:
        yield line.rstrip(b'\n').rstrip(b'\r')
    except (OSError, EOFError, zlib.error) as error:  # gzip.BadGzipFile is an OSError
      raise _damaged_gzip(path, error) from None


def _utf8(line: bytes, path: str, number: int) -> bytes:
  decode_line(line, path, number)
  return line


def parallel_lines(source_path: str, target_path: str, shard: tuple[int, int] = (0, 1)):
  """(source, target) UTF-8 bytes of every count-th line pair from the index-th (shard = (index, count)),
  read line by line from both files at once; the lines of other shards are skipped as they are read."""
  index, count = shard
  for path in (source_path, target_path):
    _check_file(path)
  sources, targets, number = _raw_lines(source_path), _raw_lines(target_path), 0
  for number, (source, target) in enumerate(itertools.zip_longest(sources, targets), 1):
    if source is None or target is None:  # one file ended first: count the other's lines for the message
      longer = sum(1 for _ in (targets if source is None else sources)) + number
      lengths = (number - 1, longer) if source is None else (longer, number - 1)
      raise DataError(f'{source_path} has {lengths[0]} lines but {target_path} has {lengths[1]}; '
                      f'parallel files must have one sentence per line, line for line')
    if (number - 1) % count == index:
      yield _utf8(source, source_path, number), _utf8(target, target_path, number)
  if number == 0:
    raise DataError(f'{source_path} is empty; a corpus needs at least one sentence pair')


def read_parallel_files(source_path: str, target_path: str) -> tuple[list[str], list[str]]:
  """Both files whole, as lists of lines (for inspection and small files; training streams them)."""
  pairs = [(s.decode('utf-8'), t.decode('utf-8')) for s, t in parallel_lines(source_path, target_path)]
  return [p[0] for p in pairs], [p[1] for p in pairs]


def _split_paths(config, split: str) -> tuple[str, str]:
  """The split's (source, target) files; a missing one is a one-line error naming its config field."""
  paths = {f'{split}_{side}': config[f'{split}_{side}'] for side in ('source', 'target')}
  for field, path in paths.items():
    if path and not storage.path(path).exists():
      raise DataError(f'config.{field}={path} does not exist; set the path (--config.{field}=PATH); for '
                      f'Multi30k, python tools/get_multi30k.py --dir=DIR downloads it, then '
                      f'--config=configs/multi30k.py:DIR')
  return tuple(paths.values())


def _tfds_builder(config):
  import tensorflow_datasets as tfds
  data_dir = config.data_dir or os.environ.get('TFDS_DATA_DIR') or None
  try:
    builder = tfds.builder(config.dataset, data_dir=data_dir)
  except Exception as error:  # tfds raises several types for unknown names / configs
    raise DataError(f'config.dataset={config.dataset!r} is not a tfds dataset ({type(error).__name__}); '
                    f"use e.g. 'wmt14_translate/de-en' or 'files'") from None
  return builder


def _not_prepared(config, builder) -> DataError:
  return DataError(f'tfds dataset {config.dataset} is not prepared in {builder.data_dir} and this run will not '
                   f'download it; on a machine with internet run `tfds build {config.dataset} '
                   f'--data_dir=DIR`, then set TFDS_DATA_DIR=DIR or --config.data_dir=DIR')


def _tfds_split(config, split: str) -> str:
  return {'train': config.train_split, 'eval': config.eval_split, 'test': config.test_split}[split]


def text_pairs(config, split: str, shard: tuple[int, int] = (0, 1)):
  """Iterator of (source, target) UTF-8 bytes of `split` ('train', 'eval' or 'test'), in file order.

  shard = (index, count): this process's 1/count of the split, disjoint from the other shards and together
  covering it. Text files: every count-th line pair from the index-th, streamed (other lines skipped as they
  are read). tfds: the index-th of `count` even sub-splits (tfds.even_splits), the only examples decoded.
  """
  if config.dataset == 'files':
    yield from parallel_lines(*_split_paths(config, split), shard)
    return
  import tensorflow_datasets as tfds
  builder = _tfds_builder(config)
  index, count = shard
  name = _tfds_split(config, split)
  try:
    dataset = builder.as_dataset(split=tfds.even_splits(name, n=count)[index] if count > 1 else name,
                                 shuffle_files=False)
  except (AssertionError, FileNotFoundError, tf.errors.NotFoundError):
    raise _not_prepared(config, builder) from None
  source_lang, target_lang = config.source_lang, config.target_lang
  for example in dataset.map(lambda ex: (ex[source_lang], ex[target_lang])).as_numpy_iterator():
    yield example


def python_pairs(config, split: str = 'train'):
  """Iterator of (source, target) Python strings, e.g. to train the vocabulary."""
  for source, target in text_pairs(config, split):
    yield source.decode('utf-8'), target.decode('utf-8')


# --- Tokenisation into in-memory tables ----------------------------------------------------------

def tokenize(pairs, vocab_path: str, batch_size: int = 1024):
  """(source, target) string pairs -> batches of (source, target) ragged int32 ids ending in EOS, with
  tensorflow-text's op, batched so one call encodes many sentences, in parallel across cores. An error met
  while reading `pairs` (a DataError) is raised as itself once the batches before it are out."""
  import tensorflow_text as tf_text
  tokenizer = tf_text.SentencepieceTokenizer(model=storage.path(vocab_path).read_bytes(), add_eos=True)
  errors = []

  def batches():
    iterator = iter(pairs)
    try:
      while batch := list(itertools.islice(iterator, batch_size)):
        yield [p[0] for p in batch], [p[1] for p in batch]
    except UserError as error:  # tf.data would turn it into an op error without its message
      errors.append(error)

  strings = tf.TensorSpec([None], tf.string)
  dataset = tf.data.Dataset.from_generator(batches, output_signature=(strings, strings))
  yield from dataset.map(lambda s, t: (tokenizer.tokenize(s), tokenizer.tokenize(t)),
                         num_parallel_calls=tf.data.AUTOTUNE)
  if errors:
    raise errors[0]


@dataclasses.dataclass
class Side:
  """One side of a table: the ids of every row, concatenated, and each row's length."""
  values: np.ndarray  # [total tokens] uint16 (vocabularies up to 65,536) or int32
  lengths: np.ndarray  # [rows] int64

  def select(self, keep: np.ndarray) -> 'Side':
    return Side(self.values[np.repeat(keep, self.lengths)], self.lengths[keep])

  def ragged(self) -> tf.RaggedTensor:  # [rows, None]
    return tf.RaggedTensor.from_row_lengths(self.values, self.lengths)

  def padded(self, rows: np.ndarray, length: int) -> np.ndarray:
    """Rows `rows` as a [len(rows), length] int32 array, right-padded with PAD_ID."""
    starts = np.concatenate([[0], np.cumsum(self.lengths)])
    out = np.full((len(rows), length), PAD_ID, np.int32)
    for row, i in enumerate(rows):
      out[row, :self.lengths[i]] = self.values[starts[i]:starts[i + 1]]
    return out


@dataclasses.dataclass
class TokenTable:
  """Sentence pairs as ids (EOS included), held in memory: one shard of a split."""
  sources: Side
  targets: Side
  dropped: int = 0  # pairs over the length limit on either side, left out

  def __len__(self) -> int:
    return len(self.sources.lengths)

  def histogram(self, max_length: int) -> np.ndarray:
    """[max_length + 1, max_length + 1] pairs of each (source length, target length)."""
    cells = self.sources.lengths * (max_length + 1) + self.targets.lengths
    return np.bincount(cells, minlength=(max_length + 1) ** 2).reshape(max_length + 1, max_length + 1)


def token_table(pairs, vocab_path: str, max_length: int, truncate: bool = False) -> TokenTable:
  """Tokenises string pairs into a table. Pairs with a side over `max_length` tokens are dropped and
  counted, or with `truncate` cut to `max_length` tokens ending in EOS (evaluation: every sentence kept)."""
  parts, dropped = {'sources': ([], []), 'targets': ([], [])}, 0
  for batch in tokenize(pairs, vocab_path):  # filtered and narrowed batch by batch: the peak stays near the table
    sides = [(ragged.flat_values.numpy(), ragged.row_lengths().numpy()) for ragged in batch]
    if not truncate:
      too_long = (sides[0][1] > max_length) | (sides[1][1] > max_length)
      if too_long.any():
        dropped += int(too_long.sum())
        sides = [(values[np.repeat(~too_long, lengths)], lengths[~too_long]) for values, lengths in sides]
    for (values, lengths), (batch_values, batch_lengths) in zip(parts.values(), sides):
      small = batch_values.size == 0 or batch_values.max() < 2 ** 16  # vocabularies up to 65,536 ids
      values.append(batch_values.astype(np.uint16) if small else batch_values)
      lengths.append(batch_lengths.astype(np.int64))
  table = TokenTable(**{name: Side(np.concatenate(values) if values else np.zeros([0], np.uint16),
                                   np.concatenate(lengths) if lengths else np.zeros([0], np.int64))
                        for name, (values, lengths) in parts.items()}, dropped=dropped)
  if not truncate:
    return table
  for side in (table.sources, table.targets):
    starts = np.concatenate([[0], np.cumsum(side.lengths)])[:-1]
    keep = np.arange(side.values.size) - np.repeat(starts, side.lengths) < max_length - 1  # first max_length-1 ids
    keep[np.cumsum(side.lengths) - 1] = True  # and the EOS
    side.values, side.lengths = side.values[keep], np.minimum(side.lengths, max_length)
  return table


# --- Training batches ------------------------------------------------------------------------

def _schedule_seed(seed: int, stream: int) -> int:
  """The stateless seed of one random stream of a run: 0 draws the shapes, k + 1 shuffles shape k."""
  return (int(seed) % 2 ** 31) * 2 ** 16 + stream


def initial_state(plan: bucketing.BatchPlan, shard: tuple[int, int], seed: int) -> dict:
  """The data state of a fresh stream: step 0, every shape at its first batch."""
  return {'step': 0, 'positions': [0] * len(plan.batch_sizes), 'seed': int(seed), 'shard': list(shard),
          'plan': plan.fingerprint()}


def _shape_stream(sources: tf.RaggedTensor, targets: tf.RaggedTensor, rows: np.ndarray,
                  shape: int, plan: bucketing.BatchPlan, shard_count: int, seed: int, start: int,
                  repeat: bool) -> tf.data.Dataset:
  """This shard's batches of one shape: its rows in a fresh random order every epoch, `batch` at a time."""
  batch = plan.batch_sizes[shape] // shard_count
  source_length, target_length = plan.source_lengths[shape], plan.target_lengths[shape]
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

  def __init__(self, dataset: tf.data.Dataset, state: dict, plan: bucketing.BatchPlan):
    self._iterator = iter(dataset)
    self._state = {**state, 'positions': list(state['positions'])}
    self.plan = plan

  def __iter__(self):
    return self

  def __next__(self) -> dict:
    batch = next(self._iterator)
    self._state['step'] += 1
    self._state['positions'][int(batch['shape'])] = int(batch['position']) + 1
    return {'inputs': batch['inputs'].numpy(), 'targets': batch['targets'].numpy()}

  def state(self) -> dict:
    return {**self._state, 'positions': list(self._state['positions'])}


def train_batches(table: TokenTable, plan: bucketing.BatchPlan, shard: tuple[int, int] = (0, 1), seed: int = 0,
                  state: dict | None = None, repeat: bool = True) -> TrainBatches:
  """This shard's training batches under `plan`: at step t the shape every shard draws, filled from `table`.

  repeat=False gives one epoch of this shard (every pair once, the last batch of each shape padded with
  empty rows) for inspection; its batch count depends on the shard, so only `repeat` runs on many processes.
  """
  state = state or initial_state(plan, shard, seed)
  shapes = bucketing.shape_index(table.sources.lengths, table.targets.lengths, plan.boundaries, plan.mode)
  order = np.argsort(shapes, kind='stable')
  rows = np.split(order, np.searchsorted(shapes[order], np.arange(1, len(plan.batch_sizes))))
  with tf.device('/CPU:0'):
    sources, targets = table.sources.ragged(), table.targets.ragged()
  streams = [_shape_stream(sources, targets, rows[k], k, plan, shard[1], state['seed'],
                           state['positions'][k], repeat) for k in range(len(plan.batch_sizes))]
  thresholds = tf.constant(plan.thresholds, tf.int64)
  schedule_seed = _schedule_seed(state['seed'], 0)

  def draw(step):  # the shape of `step`: the same on every process
    u = tf.random.stateless_uniform([], tf.stack([tf.constant(schedule_seed, tf.int64), step]), minval=0,
                                    maxval=thresholds[-1], dtype=tf.int64)
    return tf.searchsorted(thresholds, u[None], side='right', out_type=tf.int64)[0]

  if repeat:
    dataset = tf.data.Dataset.choose_from_datasets(streams, tf.data.Dataset.counter(state['step']).map(draw))
  else:  # one epoch of this shard: the shapes mixed in proportion to their batches left
    weights = [-(-len(r) // (size // shard[1])) for r, size in zip(rows, plan.batch_sizes)]
    dataset = tf.data.Dataset.sample_from_datasets(streams, [w / sum(weights) for w in weights], seed=state['seed'],
                                                   stop_on_empty_dataset=False)
  options = tf.data.Options()
  options.deterministic = True  # Same seed and state, same batch sequence (exact resume depends on it).
  return TrainBatches(dataset.with_options(options).prefetch(tf.data.AUTOTUNE), state, plan)


def train_table(config, vocab_path: str, shard: tuple[int, int] = (0, 1)) -> TokenTable:
  """One shard of the training split, tokenised; a shard with no usable pair is a one-line error."""
  table = token_table(text_pairs(config, 'train', shard), vocab_path, config.max_length)
  if not len(table):
    raise DataError(f'training data shard {shard[0]} of {shard[1]} holds no sentence pair of at most '
                    f'config.max_length={config.max_length} tokens ({table.dropped} longer ones dropped); '
                    f'use a larger training split or fewer data shards, or raise config.max_length')
  return table


def train_plan(config, histogram: np.ndarray, dropped: int, data_parallel_size: int = 1) -> bucketing.BatchPlan:
  """The batch plan of a global length histogram; global batch sizes are multiples of data-parallel × k."""
  return bucketing.make_plan(histogram, dropped, config.num_bucket_boundaries, config.tokens_per_batch,
                             data_parallel_size * config.gradient_accumulation_steps, config.bucket_shapes)


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


def process_train_batches(config, vocab_path: str, shard: tuple[int, int], data_parallel_size: int,
                          seed: int, state: dict | None = None) -> TrainBatches:
  """This process's training batches in a run of any number of processes (collective: call on all)."""
  table, error = None, None
  try:
    table = train_table(config, vocab_path, shard)
  except UserError as raised:  # a shard without usable data, a file only this process cannot read...
    error = raised
  cluster.agree('training data', error)  # every process stops on it, before the collective below
  size = config.max_length + 1
  totals = _sum_over_shards(np.concatenate([[table.dropped], table.histogram(config.max_length).ravel()]), shard)
  plan = train_plan(config, totals[1:].reshape(size, size), int(totals[0]), data_parallel_size)
  if jax.process_count() > 1:  # every process must hold the same plan, or the batch shapes differ
    from jax.experimental import multihost_utils
    fingerprint = np.frombuffer(bytes.fromhex(plan.fingerprint()), np.int32)
    if not (np.asarray(multihost_utils.process_allgather(fingerprint)) == fingerprint).all():
      raise DataError('the processes computed different batch plans; run every process with the same config, '
                      'data and vocabulary')
  if state is not None and (state.get('shard') != list(shard) or state.get('plan') != plan.fingerprint()):
    raise DataError(f'the saved data-iterator state belongs to data shard {state.get("shard")} of another batch plan '
                    f'or mesh (this process: shard {list(shard)}); rerun with --config.restore_data_state=false '
                    f'to restart the data stream')
  return train_batches(table, plan, shard, seed, state)


# --- Evaluation batches ------------------------------------------------------------------------

def eval_batches(config, vocab_path: str, split: str = 'eval', data_parallel_size: int = 1) -> list[dict]:
  """Every sentence pair of `split`, in order, as global batches {'inputs': [B, S], 'targets': [B, T]}.

  B is fixed (a multiple of the data-parallel size); each side is padded to the bucket of its longest
  row, the last batch with empty rows. Sentences over `config.eval_max_length` tokens are truncated
  (keeping the EOS). Every process builds the same list.
  """
  max_length = config.eval_max_length
  table = token_table(text_pairs(config, split), vocab_path, max_length, truncate=True)
  longer = np.maximum(table.sources.lengths, table.targets.lengths)
  boundaries = bucketing.bucket_boundaries(np.bincount(longer, minlength=max_length + 1),
                                           config.num_bucket_boundaries)
  batch_size = max(data_parallel_size, config.eval_tokens_per_batch // max_length
                   // data_parallel_size * data_parallel_size)
  batches = []
  for start in range(0, len(table), batch_size):
    rows = np.arange(start, min(start + batch_size, len(table)))
    batch = {}
    for name, side in (('inputs', table.sources), ('targets', table.targets)):
      length = boundaries[int(np.searchsorted(boundaries, side.lengths[rows].max()))]
      padded = np.zeros((batch_size, length), np.int32)
      padded[:len(rows)] = side.padded(rows, length)
      batch[name] = padded
    batches.append(batch)
  return batches


# --- Inspection ------------------------------------------------------------------------------

def _fill(batches) -> tuple[int, int]:
  real = sum(int((b['inputs'] > 0).sum() + (b['targets'] > 0).sum()) for b in batches)
  return real, sum(b['inputs'].size + b['targets'].size for b in batches)


def inspect(config, vocab_path: str) -> dict:
  """One epoch of training batches (no repeat) on one process: counts, shapes, budget, table-build and
  batch-serving throughput; then the fill of the repeated stream over as many batches."""
  start = time.perf_counter()
  table = train_table(config, vocab_path)
  table_seconds = time.perf_counter() - start
  plan = train_plan(config, table.histogram(config.max_length), table.dropped)
  start = time.perf_counter()
  epoch = list(train_batches(table, plan, repeat=False, seed=config.seed))
  seconds = time.perf_counter() - start
  shapes = sorted({(b['inputs'].shape[0], b['inputs'].shape[1], b['targets'].shape[1]) for b in epoch})
  tokens = [int((b['targets'] > 0).sum()) for b in epoch]
  stream = train_batches(table, plan, seed=config.seed)
  real, padded = _fill([next(stream) for _ in epoch])
  epoch_real, epoch_padded = _fill(epoch)
  table_tokens = int(table.sources.lengths.sum() + table.targets.lengths.sum())
  return {'examples': sum(int((b['targets'] > 0).any(1).sum()) for b in epoch), 'batches': len(epoch),
          'shapes': len(shapes), 'shape_list': shapes, 'boundaries': list(plan.boundaries),
          'tokens_per_batch': {'min': min(tokens), 'median': float(np.median(tokens)), 'max': max(tokens),
                               'budget': config.tokens_per_batch},
          'non_padding_fraction': round(real / padded, 4),
          'epoch_non_padding_fraction': round(epoch_real / epoch_padded, 4),
          'dropped_too_long': plan.dropped,
          'table_tokens_per_second': round(table_tokens / table_seconds, 1),
          'tokens_per_second': round(sum(tokens) / seconds, 1)}


def main(argv):
  del argv
  from absl import flags
  from flax_transformer import tokenizer
  from flax_transformer.commands import config_flag
  try:
    config = config_flag(flags.FLAGS)
    _, vocab_path = tokenizer.train_or_load(config, flags.FLAGS.workdir, lambda: python_pairs(config))
    print(json.dumps(inspect(config, vocab_path)))
  except UserError as error:
    print(f'error: {error}', file=sys.stderr)
    sys.exit(1)


if __name__ == '__main__':
  from absl import app, flags
  from ml_collections import config_flags
  tf.config.set_visible_devices([], 'GPU')
  config_flags.DEFINE_config_file('config', None, 'Run configuration file.', lock_config=True)
  flags.DEFINE_string('workdir', '/tmp/flax_transformer_inspect', 'Where the vocabulary is trained or found.')
  flags.mark_flags_as_required(['config'])
  app.run(main)
