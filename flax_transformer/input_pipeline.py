"""Parallel text -> SentencePiece ids -> length-bucketed token batches (§5.1), with tf.data.

Two sources behind one interface: a tfds dataset (`config.dataset='wmt14_translate/de-en'`) or
plain/.gz text files, one sentence a line (`config.dataset='files'`).

Training batches: pairs are grouped by length bucket (`config.bucket_shapes`: 'pairs' pads each side
to its own bucket, 3 shapes per bucket of the longer side; 'longer_side' pads both sides to the longer
side's bucket, 1 shape per bucket: more padding, a third of the compilations); each group's batch size is
the largest multiple of the data-parallel size that keeps `batch × padded length` within this
host's share of `tokens_per_batch` on *both* sides, so every batch fits the budget and the set of
shapes (each one an XLA compilation) is small and fixed. Evaluation batches keep every sentence,
in order; the last batch is filled with all-padding rows (weight 0).

Inspect: python -m flax_transformer.input_pipeline --config=configs/multi30k.py
"""

import gzip
import json
import os
import time

import jax
import numpy as np
import tensorflow as tf

from flax_transformer.errors import UserError

PAD_ID, EOS_ID = 0, 1


class DataError(UserError):
  """Input data that cannot be used; the message says what and how to fix it."""


# --- Sources -------------------------------------------------------------------------------

def read_lines(path: str) -> list[str]:
  """Lines of a plain or gzipped UTF-8 file, without newlines."""
  if not path:
    raise DataError('a data file path is empty; set the config.*_source / config.*_target paths')
  if not tf.io.gfile.exists(path):
    raise DataError(f'data file {path} does not exist; check the path (override with --config.<field>=PATH)')
  with tf.io.gfile.GFile(path, 'rb') as raw:
    data = raw.read()
  if path.endswith('.gz'):
    data = gzip.decompress(data)
  return decode_lines(data, path)


def decode_lines(data: bytes, name: str) -> list[str]:
  """UTF-8 bytes -> lines without newlines; a bad line is a one-line error naming `name` and its number."""
  lines = data.split(b'\n')
  if lines and lines[-1] == b'':
    lines.pop()
  out = []
  for number, line in enumerate(lines, 1):
    try:
      out.append(line.decode('utf-8').rstrip('\r'))
    except UnicodeDecodeError as error:
      raise DataError(f'{name}: line {number} is not valid UTF-8 ({error.reason} at byte {error.start}); '
                      f're-encode the file as UTF-8') from None
  return out


def read_parallel_files(source_path: str, target_path: str) -> tuple[list[str], list[str]]:
  sources, targets = read_lines(source_path), read_lines(target_path)
  if len(sources) != len(targets):
    raise DataError(f'{source_path} has {len(sources)} lines but {target_path} has {len(targets)}; '
                    f'parallel files must have one sentence per line, line for line')
  if not sources:
    raise DataError(f'{source_path} is empty; a corpus needs at least one sentence pair')
  return sources, targets


def _split_paths(config, split: str) -> tuple[str, str]:
  return {'train': (config.train_source, config.train_target),
          'eval': (config.eval_source, config.eval_target),
          'test': (config.test_source, config.test_target)}[split]


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


def text_pairs(config, split: str, shard: bool = True) -> tf.data.Dataset:
  """(source, target) string pairs of `split` ('train', 'eval' or 'test'), in file order.

  With `shard`, each process reads its own 1/process_count of the split (multi-host).
  """
  if config.dataset == 'files':
    sources, targets = read_parallel_files(*_split_paths(config, split))
    dataset = tf.data.Dataset.from_tensor_slices((sources, targets))
    if shard and jax.process_count() > 1:
      dataset = dataset.shard(jax.process_count(), jax.process_index())
    return dataset
  import tensorflow_datasets as tfds
  builder = _tfds_builder(config)
  tfds_split = _tfds_split(config, split)
  if shard and jax.process_count() > 1:
    tfds_split = tfds.split_for_jax_process(tfds_split)
  try:
    dataset = builder.as_dataset(split=tfds_split, shuffle_files=False)
  except (AssertionError, FileNotFoundError, tf.errors.NotFoundError):
    raise _not_prepared(config, builder) from None
  return dataset.map(lambda ex: (ex[config.source_lang], ex[config.target_lang]),
                     num_parallel_calls=tf.data.AUTOTUNE)


def python_pairs(config, split: str = 'train'):
  """Iterator of (source, target) Python strings, e.g. to train the vocabulary."""
  for source, target in text_pairs(config, split, shard=False).as_numpy_iterator():
    yield source.decode('utf-8'), target.decode('utf-8')


# --- Tokenisation and bucketing --------------------------------------------------------------

def tokenize(dataset: tf.data.Dataset, vocab_path: str) -> tf.data.Dataset:
  """String pairs -> {'inputs', 'targets'} int32 id vectors ending in EOS, with tensorflow-text's op."""
  import tensorflow_text as tf_text
  model = tf.io.gfile.GFile(vocab_path, 'rb').read()
  tokenizer = tf_text.SentencepieceTokenizer(model=model, add_eos=True)

  def encode(source, target):
    return {'inputs': tokenizer.tokenize(source), 'targets': tokenizer.tokenize(target)}

  # Batched so one op call encodes many sentences; parallel across cores.
  dense = lambda example: {k: v.to_tensor() if isinstance(v, tf.RaggedTensor) else v for k, v in example.items()}
  return (dataset.batch(256).map(encode, num_parallel_calls=tf.data.AUTOTUNE)
          .unbatch().map(dense))


def bucket_boundaries(lengths: np.ndarray, count: int, max_length: int) -> list[int]:
  """`count` padded lengths that minimise the padding of the sampled `lengths`, plus `max_length`.

  Dynamic programming over the length histogram: cost[k][b] is the least padding of all lengths <= b
  with k boundaries, the last at b. Boundaries land where the data is dense, so few shapes pad little.
  The DP ends at the longest sampled length; when that is below `max_length`, `max_length` is appended
  as a catch-all bucket for rarer, longer pairs the sample missed (compiled only if such a batch comes):
  Multi30k's longest pair is ~55 tokens, and padding its tail to max_length=100 wasted ~5% of a step.
  """
  if count < 1:
    raise DataError(f'config.num_bucket_boundaries={count}: must be at least 1')
  longest = int(min(max_length, max(1, np.max(lengths, initial=1))))
  if longest < max_length:
    return bucket_boundaries(lengths, count, longest) + [max_length]
  histogram = np.bincount(np.minimum(np.asarray(lengths, np.int64), max_length), minlength=max_length + 1)
  n_upto = np.cumsum(histogram)  # examples of length <= b
  sum_upto = np.cumsum(histogram * np.arange(max_length + 1))  # total length of those
  def padding(a, b):  # pad lengths in (a, b] up to b
    return b * (n_upto[b] - n_upto[a]) - (sum_upto[b] - sum_upto[a])
  inf = float('inf')
  cost = [[inf] * (max_length + 1) for _ in range(count + 1)]
  parent = [[0] * (max_length + 1) for _ in range(count + 1)]
  cost[0][0] = 0.0
  for k in range(1, count + 1):
    for b in range(1, max_length + 1):
      for a in range(0, b):
        if cost[k - 1][a] < inf:
          c = cost[k - 1][a] + padding(a, b)
          if c < cost[k][b]:
            cost[k][b], parent[k][b] = c, a
  k = min(range(1, count + 1), key=lambda k: (cost[k][max_length], k))
  boundaries, b = [], max_length
  while k > 0 and b > 0:
    boundaries.append(b)
    b, k = parent[k][b], k - 1
  return sorted(set(boundaries))


BUCKET_SHAPES = ('pairs', 'longer_side')


def _check_bucket_shapes(mode: str) -> None:
  if mode not in BUCKET_SHAPES:
    raise DataError(f"config.bucket_shapes={mode!r} is not one of {', '.join(BUCKET_SHAPES)}")


def bucket_shapes(boundaries: list[int], mode: str = 'pairs') -> tuple[np.ndarray, np.ndarray]:
  """Padded (source, target) lengths of the shapes of bucket m of the longer side.

  'pairs', 3 shapes per bucket: shape 3m has both sides in bucket m; 3m+1: target in m, source shorter
  (padded to bucket m-1); 3m+2: source in m, target shorter. 'longer_side': shape m pads both sides to
  bucket m.
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


def bucket_batch_sizes(boundaries: list[int], tokens_per_batch: int, multiple: int, mode: str = 'pairs') -> np.ndarray:
  """Batch size per shape of `bucket_shapes`: the most rows within budget on both sides, a multiple of `multiple`."""
  longer = np.maximum(*bucket_shapes(boundaries, mode))
  sizes = tokens_per_batch // longer // multiple * multiple
  if sizes.min() < multiple:
    raise DataError(f'config.tokens_per_batch={tokens_per_batch} (per host) cannot hold {multiple} sentences of '
                    f'{boundaries[-1]} tokens (the data-parallel size times gradient accumulation steps); '
                    f'raise it to at least {multiple * boundaries[-1]} or lower config.max_length')
  return sizes


def _bucket_index(lengths: tf.Tensor, boundaries: tf.Tensor) -> tf.Tensor:
  return tf.cast(tf.reduce_sum(tf.cast(lengths > boundaries, tf.int32)), tf.int64)


def bucket_by_length(dataset: tf.data.Dataset, boundaries: list[int], batch_sizes: np.ndarray,
                     mode: str = 'pairs') -> tf.data.Dataset:
  """Groups tokenised pairs into fixed-shape padded batches (see `bucket_shapes`)."""
  boundary_tensor = tf.constant(boundaries, tf.int32)
  source_lengths, target_lengths = (tf.constant(x, tf.int32) for x in bucket_shapes(boundaries, mode))
  sizes = tf.constant(batch_sizes, tf.int64)

  def key(example):
    i = _bucket_index(tf.shape(example['inputs'])[0], boundary_tensor)
    j = _bucket_index(tf.shape(example['targets'])[0], boundary_tensor)
    m = tf.maximum(i, j)
    if mode == 'longer_side':
      return m
    return 3 * m + tf.where(i == j, tf.constant(0, tf.int64), tf.where(j > i, tf.constant(1, tf.int64),
                                                                        tf.constant(2, tf.int64)))

  def reduce(shape, window):
    batch = tf.gather(sizes, shape)
    padded = {'inputs': [tf.gather(source_lengths, shape)], 'targets': [tf.gather(target_lengths, shape)]}
    batched = window.padded_batch(batch, padded_shapes=padded)
    # A final partial window (end of an epoch) is filled with padding rows: same shapes, weight 0.
    return batched.map(lambda b: {k: tf.pad(v, [[0, batch - tf.shape(v, out_type=tf.int64)[0]], [0, 0]])
                                  for k, v in b.items()})

  return dataset.group_by_window(key, reduce, window_size_func=lambda shape: tf.gather(sizes, shape))


def sample_lengths(config, vocab_path: str, num_pairs: int = 50_000) -> np.ndarray:
  """max(source, target) token counts of the first `num_pairs` training pairs (the same on every host)."""
  import sentencepiece as spm
  processor = spm.SentencePieceProcessor(model_file=vocab_path)
  sources, targets = [], []
  for source, target in python_pairs(config, 'train'):
    sources.append(source)
    targets.append(target)
    if len(sources) >= num_pairs:
      break
  source_ids = processor.encode(sources, num_threads=os.cpu_count() or 1)
  target_ids = processor.encode(targets, num_threads=os.cpu_count() or 1)
  return np.array([max(len(s), len(t)) + 1 for s, t in zip(source_ids, target_ids)])  # +1: EOS


class DroppedCounter:
  """Counts pairs dropped for length inside the tf.data graph (read with `.value`)."""

  def __init__(self):
    with tf.device('/CPU:0'):
      self.variable = tf.Variable(0, dtype=tf.int64, trainable=False)

  @property
  def value(self) -> int:
    return int(self.variable.numpy())


def train_batches(config, vocab_path: str, data_parallel_size: int = 1, repeat: bool = True,
                  seed: int | None = None, dropped: DroppedCounter | None = None) -> tf.data.Dataset:
  """Shuffled, length-bucketed training batches {'inputs': [B, S], 'targets': [B, T]} int32 of this host.

  Pairs with more than `config.max_length` tokens on either side are dropped and counted in `dropped`.
  """
  seed = config.seed if seed is None else seed
  dropped = dropped or DroppedCounter()
  max_length = config.max_length

  def short_enough(example):
    keep = tf.logical_and(tf.shape(example['inputs'])[0] <= max_length,
                          tf.shape(example['targets'])[0] <= max_length)
    dropped.variable.assign_add(tf.cast(tf.logical_not(keep), tf.int64))
    return keep

  dataset = text_pairs(config, 'train')
  if config.cache_tokenized:  # tokenised once, held in memory; the shuffled order is the same either way
    dataset = tokenize(dataset, vocab_path).cache()
  dataset = dataset.shuffle(config.shuffle_buffer_size, seed=seed, reshuffle_each_iteration=True)
  if repeat:
    dataset = dataset.repeat()
  if not config.cache_tokenized:
    dataset = tokenize(dataset, vocab_path)
  dataset = dataset.filter(short_enough)
  boundaries = bucket_boundaries(sample_lengths(config, vocab_path), config.num_bucket_boundaries, max_length)
  multiple = data_parallel_size * config.gradient_accumulation_steps // jax.process_count() or 1
  host_tokens = config.tokens_per_batch // jax.process_count()
  mode = config.bucket_shapes
  _check_bucket_shapes(mode)
  batches = bucket_by_length(dataset, boundaries, bucket_batch_sizes(boundaries, host_tokens, multiple, mode), mode)
  options = tf.data.Options()
  options.deterministic = True  # Same seed, same batch sequence (exact resume depends on it).
  # The iterator can be checkpointed: the dropped-pairs counter is a statistic, not part of the data state.
  options.experimental_external_state_policy = tf.data.experimental.ExternalStatePolicy.IGNORE
  return batches.with_options(options).prefetch(tf.data.AUTOTUNE)


def eval_batches(config, vocab_path: str, split: str = 'eval', data_parallel_size: int = 1) -> tf.data.Dataset:
  """Every sentence pair of `split`, in order, in batches of fixed size padded to bucket lengths.

  Sentences longer than `config.eval_max_length` tokens are truncated (keeping the EOS).
  """
  max_length = config.eval_max_length
  boundaries = bucket_boundaries(sample_lengths(config, vocab_path, 5000), config.num_bucket_boundaries, max_length)
  batch_size = max(data_parallel_size, config.eval_tokens_per_batch // max_length
                   // data_parallel_size * data_parallel_size)
  boundary_tensor = tf.constant(boundaries, tf.int32)

  def truncate(example):
    return {k: tf.cond(tf.shape(v)[0] > max_length, lambda v=v: tf.concat([v[:max_length - 1], v[-1:]], 0),
                       lambda v=v: v) for k, v in example.items()}

  def pad_to_bucket(batch):
    def pad(v):
      length = tf.gather(boundary_tensor, _bucket_index(tf.shape(v)[1], boundary_tensor))
      return tf.pad(v, [[0, batch_size - tf.shape(v)[0]], [0, length - tf.shape(v)[1]]])
    return {k: pad(v) for k, v in batch.items()}

  dataset = tokenize(text_pairs(config, split), vocab_path).map(truncate)
  dataset = dataset.padded_batch(batch_size, padded_shapes={'inputs': [None], 'targets': [None]})
  return dataset.map(pad_to_bucket).prefetch(tf.data.AUTOTUNE)


# --- Inspection ------------------------------------------------------------------------------

def _fill(batches) -> tuple[int, int]:
  real = sum(int((b['inputs'] > 0).sum() + (b['targets'] > 0).sum()) for b in batches)
  return real, sum(b['inputs'].size + b['targets'].size for b in batches)


def inspect(config, vocab_path: str) -> dict:
  """One epoch of training batches (no repeat): counts, shapes, budget and throughput; then the fill of
  the repeated training stream over as many batches (an epoch's last partial windows, padded with empty
  rows, occur only once per pass and never in the repeated stream the trainer reads)."""
  dropped = DroppedCounter()
  dataset = train_batches(config, vocab_path, repeat=False, dropped=dropped)
  start = time.perf_counter()
  epoch = list(dataset.as_numpy_iterator())
  seconds = time.perf_counter() - start
  shapes = sorted({(b['inputs'].shape[0], b['inputs'].shape[1], b['targets'].shape[1]) for b in epoch})
  tokens = [int((b['targets'] > 0).sum()) for b in epoch]
  stream = train_batches(config, vocab_path, repeat=True).take(len(epoch)).as_numpy_iterator()
  real, padded = _fill(list(stream))
  epoch_real, epoch_padded = _fill(epoch)
  return {'examples': sum(int((b['targets'] > 0).any(1).sum()) for b in epoch), 'batches': len(epoch),
          'shapes': len(shapes), 'shape_list': shapes,
          'tokens_per_batch': {'min': min(tokens), 'median': float(np.median(tokens)), 'max': max(tokens),
                               'budget': config.tokens_per_batch},
          'non_padding_fraction': round(real / padded, 4),
          'epoch_non_padding_fraction': round(epoch_real / epoch_padded, 4),
          'dropped_too_long': dropped.value,
          'tokens_per_second': round(sum(tokens) / seconds, 1)}


def main(argv):
  del argv
  from absl import flags
  from flax_transformer import tokenizer
  config = flags.FLAGS.config
  workdir = flags.FLAGS.workdir
  _, vocab_path = tokenizer.train_or_load(config, workdir, lambda: python_pairs(config))
  print(json.dumps(inspect(config, vocab_path)))


if __name__ == '__main__':
  from absl import app, flags
  from ml_collections import config_flags
  tf.config.set_visible_devices([], 'GPU')
  config_flags.DEFINE_config_file('config', None, 'Run configuration file.', lock_config=True)
  flags.DEFINE_string('workdir', '/tmp/flax_transformer_inspect', 'Where the vocabulary is trained or found.')
  flags.mark_flags_as_required(['config'])
  app.run(main)
