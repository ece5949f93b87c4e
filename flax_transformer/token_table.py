"""The pipeline's second stage: sentence pairs -> SentencePiece ids in an in-memory token table.

Tokenised with tf.data in batches, each batch filtered (pairs too long for `config.max_train_length` dropped
and counted, or cut with `truncate`) and narrowed to uint16 where the vocabulary allows, so a table costs
its final size while it is built. Training tokenises the split block by block into the token cache
(token_cache.py); evaluation reads the whole split on every process and pads it into fixed batches in file
order (`eval_batches`).
"""

import dataclasses
import itertools

import numpy as np
import tensorflow as tf

from flax_transformer import bucketing, storage
from flax_transformer.constants import PAD_ID
from flax_transformer.parallel_text import DataSettings, text_pairs
from flax_transformer.errors import UserError



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

  def starts(self) -> np.ndarray:
    """[rows] where each row begins in `values`."""
    return np.concatenate([[0], np.cumsum(self.lengths)])[:-1]

  def padded(self, rows: np.ndarray, length: int, starts: np.ndarray | None = None) -> np.ndarray:
    """Rows `rows` as a [len(rows), length] int32 array, right-padded with PAD_ID; row -1 is all padding.
    `starts` is self.starts(), for a caller that pads many batches of one table."""
    starts = self.starts() if starts is None else starts
    rows = np.asarray(rows, np.int64)
    columns = np.arange(length)
    lengths = np.where(rows >= 0, self.lengths[rows], 0)  # [R]
    index = starts[rows][:, None] + columns  # [R, length]
    inside = columns < lengths[:, None]
    return np.where(inside, self.values[np.minimum(index, max(self.values.size - 1, 0))], PAD_ID).astype(np.int32)


@dataclasses.dataclass
class TokenTable:
  """Sentence pairs as ids (EOS included), held in memory."""
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


def eval_batches(data: DataSettings, vocab_path: str, split: str = 'eval', data_parallel_size: int = 1) -> list[dict]:
  """Every sentence pair of `split`, in order, as global batches {'inputs': [B, S], 'targets': [B, T]}.

  B is fixed (a multiple of the data-parallel size); each side is padded to the bucket of its longest
  row, the last batch with empty rows. Sentences over `config.max_eval_length` tokens are truncated
  (keeping the EOS). Every process builds the same list.
  """
  max_length = data.max_eval_length
  table = token_table(text_pairs(data, split), vocab_path, max_length, truncate=True)
  longer = np.maximum(table.sources.lengths, table.targets.lengths)
  boundaries = bucketing.bucket_boundaries(np.bincount(longer, minlength=max_length + 1),
                                           data.num_bucket_boundaries)
  batch_size = max(data_parallel_size, data.eval_tokens_per_batch // max_length
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
