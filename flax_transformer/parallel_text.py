"""The pipeline's first stage: parallel text from files or tfds, as (source, target) pairs.

Two sources behind one interface: a tfds dataset (`config.dataset='wmt14_translate/de-en'`) or plain/.gz
text files, one sentence a line (`config.dataset='files'`), streamed line by line from both files at once.
Bad input (a missing or damaged file, files of different lengths, a line that is not UTF-8, an unprepared
tfds dataset) is a one-line `DataError` naming the fix.
"""

import dataclasses
import gzip
import itertools
import os
import zlib


from flax_transformer import bucketing, corpora, storage
from flax_transformer.errors import UserError
from flax_transformer.fields import setting
from flax_transformer.tokenizer import VOCAB_TYPES


@dataclasses.dataclass(frozen=True)
class DataSettings:
  """The data stages' settings (parallel text, vocabulary, token table, batches), config fields of these names."""
  dataset: str = setting("A tfds name (e.g. 'wmt14_translate/de-en'), or 'files' for the *_source/*_target paths.")
  source_lang: str = setting('The source language (a tfds feature name).')
  target_lang: str = setting('The target language.')
  data_dir: str = setting("The tfds data directory; '' means $TFDS_DATA_DIR or ~/tensorflow_datasets.")
  train_split: str = setting('The tfds training split.')
  eval_split: str = setting('The tfds validation split (newstest2013 for WMT14).')
  test_split: str = setting('The tfds test split (newstest2014 for WMT14).')
  train_source: str = setting("Training source file, plain or .gz, one sentence a line (dataset='files').", read=True)
  train_target: str = setting('Training target file, line for line with the source.', read=True)
  eval_source: str = setting('Validation source file.', read=True)
  eval_target: str = setting('Validation target file.', read=True)
  test_source: str = setting('Test source file.', read=True)
  test_target: str = setting('Test target file.', read=True)
  download_url: str = setting("Where missing data files are fetched from ({name}: a file's name); '': nowhere.",
                              before='')
  vocab_path: str = setting("An existing SentencePiece model; '' trains one into the workdir.", read=True)
  vocab_type: str = setting('The SentencePiece model type (§5.1: byte-pair encoding).', choices=VOCAB_TYPES)
  vocab_size: int = setting('Pieces of the vocabulary (config.model.vocab_size).', derived=True)
  vocab_sample_sentences: int = setting('Sentences the vocabulary is trained on, drawn from the whole split.',
                                        minimum=1, before=4_000_000)
  max_train_length: int = setting('Training pairs with a longer side (tokens) are dropped and counted.', minimum=1)
  token_cache: str = setting("Where the training split's token ids are cached (a folder or URL, shared between runs); "
                             "'': WORKDIR/token_cache.", before='')
  token_cache_block_pairs: int = setting('Sentence pairs a block of the token cache holds: the unit in which it is '
                                         'built in parallel and resumed.', minimum=1, before=131_072)
  max_eval_length: int = setting('Longest validation sentence kept whole; longer ones are truncated.', minimum=1)
  tokens_per_batch: int = setting('Source (and target) tokens of a global training batch (§5.1: ~25,000).',
                                  minimum=1)
  eval_tokens_per_batch: int = setting('= config.eval_tokens_per_batch (DecodeSettings).', derived=True)
  num_bucket_boundaries: int = setting('Length buckets: a bounded number of compiled shapes.', minimum=1)
  bucket_shapes: str = setting("'pairs': 3 shapes a bucket, each side padded to its own; 'longer_side': 1.",
                               check=bucketing.check_bucket_shapes, before='pairs')
  gradient_accumulation_steps: int = setting('Micro-batches summed into one update; global batch sizes are '
                                             'multiples of it.', minimum=1)
  seed: int = setting('= config.seed (LoopSettings): the data stream starts from it.', derived=True)


class DataError(UserError):
  """Input data that cannot be used; the message says what and how to fix it."""


# --- Sources -------------------------------------------------------------------------------

def read_lines(path: str) -> list[str]:
  """Lines of a plain or gzipped UTF-8 file, without newlines."""
  check_file(path)
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


def check_file(path: str, name: str = '') -> None:
  """A one-line DataError unless `path` is a file that exists; `name` is how the user gave it (a flag or
  config field), '' for a data file in general."""
  if not path:
    raise DataError(f'{name or "a data file path"} is empty; give the path of a text file (plain or .gz)')
  location = storage.path(path)
  if not location.exists():
    raise DataError(f'{f"{name} file" if name else "data file"} {path} does not exist; check the '
                    f'{name or "path (override with --config.<field>=PATH)"}{" path" if name else ""}')
  if location.is_dir():
    raise DataError(f'{name or "data file"} {path} is a folder; give the path of a text file (plain or .gz) in it')


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


def parallel_lines(source_path: str, target_path: str):
  """(source, target) UTF-8 bytes of every line pair, read line by line from both files at once."""
  for path in (source_path, target_path):
    check_file(path)
  sources, targets, number = _raw_lines(source_path), _raw_lines(target_path), 0
  for number, (source, target) in enumerate(itertools.zip_longest(sources, targets), 1):
    if source is None or target is None:  # one file ended first: count the other's lines for the message
      longer = sum(1 for _ in (targets if source is None else sources)) + number
      lengths = (number - 1, longer) if source is None else (longer, number - 1)
      raise DataError(f'{source_path} has {lengths[0]} lines but {target_path} has {lengths[1]}; '
                      f'parallel files must have one sentence per line, line for line')
    yield _utf8(source, source_path, number), _utf8(target, target_path, number)
  if number == 0:
    raise DataError(f'{source_path} is empty; a corpus needs at least one sentence pair')


def _split_paths(data: DataSettings, split: str) -> tuple[str, str]:
  """The split's (source, target) files; a missing one is a one-line error naming its config field."""
  paths = {f'{split}_{side}': getattr(data, f'{split}_{side}') for side in ('source', 'target')}
  for field, path in paths.items():
    if path and not storage.path(path).exists():
      raise DataError(f'config.{field}={path} does not exist; set the path (--config.{field}=PATH); for '
                      f'Multi30k, python tools/get_multi30k.py --dir=DIR downloads it, then '
                      f'--config=configs/multi30k.py:DIR')
    if path and storage.path(path).is_dir():
      raise DataError(f'config.{field}={path} is a folder; give the path of a text file (plain or .gz) in it')
  return tuple(paths.values())


def check_split(data: DataSettings, split: str) -> None:
  """The split's files exist and are files (dataset 'files'; a tfds split is checked when it is read); missing
  ones are downloaded first where config.download_url says from (corpora.fetch)."""
  if data.dataset != 'files':
    return
  paths = [getattr(data, f'{split}_{side}') for side in ('source', 'target')]
  missing = [p for p in paths if p and not storage.path(p).exists()]
  if missing and data.download_url:
    corpora.fetch(missing, data.download_url)
  _split_paths(data, split)


def _tfds_builder(data: DataSettings):
  import tensorflow_datasets as tfds
  data_dir = data.data_dir or os.environ.get('TFDS_DATA_DIR') or None
  try:
    builder = tfds.builder(data.dataset, data_dir=data_dir)
  except Exception as error:  # tfds raises several types for unknown names / configs
    raise DataError(f'config.dataset={data.dataset!r} is not a tfds dataset ({type(error).__name__}); '
                    f"use e.g. 'wmt14_translate/de-en' or 'files'") from None
  return builder


def _not_prepared(data: DataSettings, builder) -> DataError:
  return DataError(f'tfds dataset {data.dataset} is not prepared in {builder.data_dir} and this run will not '
                   f'download it; on a machine with internet run `tfds build {data.dataset} '
                   f'--data_dir=DIR`, then set TFDS_DATA_DIR=DIR or --config.data_dir=DIR')


def _tfds_split(data: DataSettings, split: str) -> str:
  return {'train': data.train_split, 'eval': data.eval_split, 'test': data.test_split}[split]


def text_pairs(data: DataSettings, split: str):
  """Iterator of (source, target) UTF-8 bytes of `split` ('train', 'eval' or 'test'), in file (or tfds) order."""
  if data.dataset == 'files':
    yield from parallel_lines(*_split_paths(data, split))
    return
  import tensorflow as tf  # here, not at the top: translation reads text without TensorFlow's seconds of import
  builder = _tfds_builder(data)
  name = _tfds_split(data, split)
  try:
    dataset = builder.as_dataset(split=name, shuffle_files=False)
  except (AssertionError, FileNotFoundError, tf.errors.NotFoundError):
    raise _not_prepared(data, builder) from None
  source_lang, target_lang = data.source_lang, data.target_lang
  for example in dataset.map(lambda ex: (ex[source_lang], ex[target_lang])).as_numpy_iterator():
    yield example


def python_pairs(data: DataSettings, split: str = 'train'):
  """Iterator of (source, target) Python strings, e.g. to train the vocabulary."""
  for source, target in text_pairs(data, split):
    yield source.decode('utf-8'), target.decode('utf-8')
