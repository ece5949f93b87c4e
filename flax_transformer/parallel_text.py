"""The pipeline's first stage: parallel text, as (source, target) pairs, from the source config.dataset names.

Each source is one registered class (`Source`: its fields, its check, its reader, its identity): a tfds
dataset (`config.dataset='wmt14_translate/de-en'`) or plain/.gz text files, one sentence a line
(`config.dataset='files'`), streamed line by line from both files at once.
Bad input (a missing or damaged file, files of different lengths, a line that is not UTF-8, an unprepared
tfds dataset) is a one-line `DataError` naming the fix.
"""

import dataclasses
import gzip
import itertools
import os
import zlib


from flax_transformer import bucketing, corpora, storage
from flax_transformer.errors import ConfigError, UserError
from flax_transformer.settings_fields import setting
from flax_transformer.tokenizer import VOCAB_TYPES


@dataclasses.dataclass(frozen=True)
class TfdsFields:
  """The fields of a tfds source (`Tfds` below)."""
  data_dir: str = setting("The tfds data directory; '' means $TFDS_DATA_DIR or ~/tensorflow_datasets.")
  train_split: str = setting('The tfds training split.')
  eval_split: str = setting('The tfds validation split (newstest2013 for WMT14).')
  test_split: str = setting('The tfds test split (newstest2014 for WMT14).')


@dataclasses.dataclass(frozen=True)
class FileFields:
  """The fields of a source of text files (`Files` below)."""
  train_source: str = setting("Training source file, plain or .gz, one sentence a line (dataset='files').", read=True)
  train_target: str = setting('Training target file, line for line with the source.', read=True)
  eval_source: str = setting('Validation source file.', read=True)
  eval_target: str = setting('Validation target file.', read=True)
  test_source: str = setting('Test source file.', read=True)
  test_target: str = setting('Test target file.', read=True)
  download_url: str = setting("Where missing data files are fetched from ({name}: a file's name); '': nowhere.",
                              before='')


@dataclasses.dataclass(frozen=True)
class DataSettings(TfdsFields, FileFields):
  """The data stages' settings (parallel text, vocabulary, token table, batches), config fields of these names;
  each source's own fields come from its bases (a new source adds its fields class here)."""
  dataset: str = setting("A tfds name (e.g. 'wmt14_translate/de-en'), or 'files' for the *_source/*_target paths.")
  source_lang: str = setting('The source language (a tfds feature name).')
  target_lang: str = setting('The target language.')
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
  seed: int = setting('= config.seed (TrainingSettings): the data stream starts from it.', derived=True)


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


def check_file(path: str, name: str = '', missing_fix: str = '') -> None:
  """A one-line DataError unless `path` is a file that exists; `name` is how the user gave it (a flag, or a
  config field: 'config.NAME'), '' for a data file in general; `missing_fix`: what to do when it is missing."""
  if not path:
    raise DataError(f'{name or "a data file path"} is empty; give the path of a text file (plain or .gz)')
  if name.startswith('config.'):
    given, missing = f'{name}={path}', f'{name}={path}'
  else:
    given, missing = f'{name or "data file"} {path}', f'{f"{name} file" if name else "data file"} {path}'
  if not missing_fix:
    missing_fix = f'check the {name} path' if name else 'check the path (override with --config.<field>=PATH)'
  location = storage.path(path)
  if not location.exists():
    raise DataError(f'{missing} does not exist; {missing_fix}')
  if location.is_dir():
    raise DataError(f'{given} is a folder; give the path of a text file (plain or .gz) in it')


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


# --- Sources: each kind of parallel text is one registered class ---------------------------------

class Source:
  """A kind of parallel text, chosen by config.dataset, in one place: `check` of a run config before anything
  runs, `prepare` of a split (fetch and check what it reads), `pairs` of a split, and `identity` of the training
  split (what the token cache depends on); its fields are a dataclass beside it among DataSettings' bases. A new
  source is a subclass registered with `@source('name')` and its fields class added to DataSettings' bases
  (configs/base.py sets their values); `FALLBACK` takes every name no source registered."""

  def __init__(self, data: DataSettings):
    self.data = data

  def check(self) -> None:
    """One-line ConfigErrors for fields this source needs but the settings leave unusable (before any run)."""

  def prepare(self, split: str) -> None:
    """What reading `split` needs is there (missing files fetched where the settings say from)."""

  def pairs(self, split: str):
    """Iterator of (source, target) UTF-8 bytes of `split` ('train', 'eval' or 'test'), in stored order."""
    raise NotImplementedError

  def identity(self) -> dict:
    """JSON values that change whenever the training split's text may have changed."""
    raise NotImplementedError


SOURCES: dict[str, type[Source]] = {}
FALLBACK = 'tfds'  # config.dataset names no registered source: a tfds dataset name


def source(name: str):
  """Class decorator: registers a Source under `name` (config.dataset=name)."""
  def register(cls: type[Source]) -> type[Source]:
    SOURCES[name] = cls
    return cls
  return register


def source_for(data: DataSettings) -> Source:
  """The source config.dataset names, reading `data`."""
  return SOURCES.get(data.dataset, SOURCES[FALLBACK])(data)


@source('files')
class Files(Source):
  """Plain or .gz text files, one sentence a line, line for line: config.{split}_source / {split}_target,
  fetched from config.download_url when missing (corpora.fetch), streamed from both files at once; its fields:
  FileFields."""

  def check(self) -> None:
    for split in ('train', 'eval'):
      for side in ('source', 'target'):
        if not getattr(self.data, f'{split}_{side}'):
          raise ConfigError(f"config.{split}_{side} is empty but config.dataset='files'; set the path "
                            f'(--config.{split}_{side}=PATH) or a tfds dataset name in config.dataset')

  def paths(self, split: str) -> dict[str, str]:
    return {f'{split}_{side}': getattr(self.data, f'{split}_{side}') for side in ('source', 'target')}

  def prepare(self, split: str) -> None:
    missing = [p for p in self.paths(split).values() if p and not storage.path(p).exists()]
    if missing and self.data.download_url:
      corpora.fetch(missing, self.data.download_url)
    self.checked(split)

  def checked(self, split: str) -> list[str]:
    """The split's (source, target) files; a missing one is a one-line error naming its config field."""
    for field, path in self.paths(split).items():
      if path:
        check_file(path, f'config.{field}', f'set the path (--config.{field}=PATH); for Multi30k, python '
                   f'tools/get_multi30k.py --dir=DIR downloads it, then --config=configs/multi30k.py:DIR')
    return list(self.paths(split).values())

  def pairs(self, split: str):
    yield from parallel_lines(*self.checked(split))

  def identity(self) -> dict:
    files = {}
    for side, location in zip(('source', 'target'), self.paths('train').values()):
      stat = storage.path(location).stat()
      files[side] = {'path': storage.resolved(location), 'bytes': int(stat.length), 'mtime': int(stat.mtime)}
    return files


@source(FALLBACK)
class Tfds(Source):
  """A tfds dataset prepared in config.data_dir (`tfds build NAME`; never downloaded by a run): its
  {split}_split splits, the source_lang / target_lang features; its fields: TfdsFields."""

  def builder(self):
    import tensorflow_datasets as tfds
    data_dir = self.data.data_dir or os.environ.get('TFDS_DATA_DIR') or None
    try:
      return tfds.builder(self.data.dataset, data_dir=data_dir)
    except Exception as error:  # tfds raises several types for unknown names / configs
      raise DataError(f'config.dataset={self.data.dataset!r} is not a tfds dataset ({type(error).__name__}); '
                      f"use e.g. 'wmt14_translate/de-en' or 'files'") from None

  def split(self, split: str) -> str:
    return {'train': self.data.train_split, 'eval': self.data.eval_split, 'test': self.data.test_split}[split]

  def pairs(self, split: str):
    import tensorflow as tf  # here, not at the top: translation reads text without TensorFlow's seconds of import
    builder = self.builder()
    try:
      dataset = builder.as_dataset(split=self.split(split), shuffle_files=False)
    except (AssertionError, FileNotFoundError, tf.errors.NotFoundError):
      raise DataError(f'tfds dataset {self.data.dataset} is not prepared in {builder.data_dir} and this run will '
                      f'not download it; on a machine with internet run `tfds build {self.data.dataset} '
                      f'--data_dir=DIR`, then set TFDS_DATA_DIR=DIR or --config.data_dir=DIR') from None
    source_lang, target_lang = self.data.source_lang, self.data.target_lang
    yield from dataset.map(lambda ex: (ex[source_lang], ex[target_lang])).as_numpy_iterator()

  def identity(self) -> dict:
    builder = self.builder()
    return {'tfds': self.data.dataset, 'version': str(builder.version), 'split': self.data.train_split,
            'data_dir': storage.resolved(builder.data_dir), 'languages': [self.data.source_lang,
                                                                          self.data.target_lang]}


def check_split(data: DataSettings, split: str) -> None:
  """What reading `split` of config.dataset's source needs is there (missing files fetched first)."""
  source_for(data).prepare(split)


def text_pairs(data: DataSettings, split: str):
  """Iterator of (source, target) UTF-8 bytes of `split` ('train', 'eval' or 'test'), in file (or tfds) order."""
  yield from source_for(data).pairs(split)


def python_pairs(data: DataSettings, split: str = 'train'):
  """Iterator of (source, target) Python strings, e.g. to train the vocabulary."""
  for source, target in text_pairs(data, split):
    yield source.decode('utf-8'), target.decode('utf-8')
