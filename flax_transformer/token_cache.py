"""The pipeline's third stage: the training split's token table, built once into a cache on any storage.

Tokenising WMT14's 4.5M pairs takes minutes; a run does it once, and every later start, resume or run on the
same data and vocabulary reads the ids instead (as fairseq-preprocess, sockeye-prepare-data and levanter's
cache do). `python -m flax_transformer.prepare` builds it ahead of a run, on a CPU machine.

A cache lives at config.token_cache (default WORKDIR/token_cache), one folder per fingerprint of everything
that determines it — the data's identity (files' paths, sizes and modification times, or the tfds name,
version and split), the vocabulary's SHA-256, max_train_length and the block size — so a cache built from
other data or another vocabulary is never read:

  <token_cache>/<fingerprint>/
    identity.json       what the fingerprint covers, for people
    block-00000.npz     pairs [b·P, (b+1)·P) of the split (P = config.token_cache_block_pairs), tokenised and
                        filtered: source and target ids (uint16 where the vocabulary allows) and lengths
    block-00000.json    that file's size and CRC-32, its rows, lines and dropped pairs; written after the
                        .npz, so a block without it is unfinished
    cache.json          the block count, lines, rows and dropped pairs: written last, once every block is there

Blocks are fixed line ranges, so a cache is the same whatever number of processes built it. Process i of n
builds the blocks b with b % n == i, each written as soon as its lines are tokenised: a build killed at any
point continues from the blocks already written. A block whose size or CRC differs from its record is
rebuilt, never read as data. Every process then reads the whole table (uint16 ids: 2 bytes a token).
"""

import hashlib
import io
import itertools
import json
import time
import zipfile
import zlib

import numpy as np

from flax_transformer import cluster, storage
from flax_transformer.parallel_text import DataError, DataSettings, text_pairs
from flax_transformer.token_table import Side, TokenTable, token_table

FORMAT = 1  # the layout above; a change makes a new fingerprint
MANIFEST = 'cache.json'
ARRAYS = ('source_values', 'source_lengths', 'target_values', 'target_lengths')


def identity(data: DataSettings, vocab_path: str) -> dict:
  """Everything the cached table depends on, as JSON values."""
  if data.dataset == 'files':
    source = {}
    for side in ('source', 'target'):
      location = getattr(data, f'train_{side}')
      stat = storage.path(location).stat()
      source[side] = {'path': storage.resolved(location), 'bytes': int(stat.length), 'mtime': int(stat.mtime)}
  else:
    from flax_transformer.parallel_text import _tfds_builder
    builder = _tfds_builder(data)
    source = {'tfds': data.dataset, 'version': str(builder.version), 'split': data.train_split,
              'data_dir': storage.resolved(builder.data_dir), 'languages': [data.source_lang, data.target_lang]}
  vocabulary = hashlib.sha256(storage.path(vocab_path).read_bytes()).hexdigest()
  return {'format': FORMAT, 'data': source, 'vocabulary_sha256': vocabulary,
          'max_train_length': data.max_train_length, 'block_pairs': data.token_cache_block_pairs}


def fingerprint(identity_: dict) -> str:
  return hashlib.sha256(json.dumps(identity_, sort_keys=True).encode()).hexdigest()[:16]


def location(data: DataSettings, workdir) -> str:
  """The folder of caches: config.token_cache, or the workdir's."""
  return data.token_cache or str(storage.path(workdir) / 'token_cache')


# --- One block -------------------------------------------------------------------------------

def _npz(arrays: dict) -> bytes:
  """An .npz (np.load reads it) whose bytes depend on the arrays alone: a fixed timestamp in the zip."""
  buffer = io.BytesIO()
  with zipfile.ZipFile(buffer, 'w', zipfile.ZIP_STORED) as archive:
    for name, array in arrays.items():
      with archive.open(zipfile.ZipInfo(f'{name}.npy', date_time=(1980, 1, 1, 0, 0, 0)), 'w',
                        force_zip64=True) as member:
        np.lib.format.write_array(member, np.ascontiguousarray(array), allow_pickle=False)
  return buffer.getvalue()


def _block_paths(directory, block: int):
  return directory / f'block-{block:05d}.npz', directory / f'block-{block:05d}.json'


def write_block(directory, block: int, table: TokenTable, lines: int) -> None:
  """The block's arrays, then its record (size, CRC-32, counts): the record marks it complete."""
  data = _npz({'source_values': table.sources.values, 'source_lengths': table.sources.lengths,
               'target_values': table.targets.values, 'target_lengths': table.targets.lengths})
  arrays, record = _block_paths(directory, block)
  storage.write_atomic(arrays, data)
  storage.write_atomic(record, json.dumps({'bytes': len(data), 'crc32': zlib.crc32(data), 'rows': len(table),
                                           'lines': lines, 'dropped': table.dropped}))


def read_block(directory, block: int) -> tuple[TokenTable, dict] | None:
  """The block's table and record, or None if it is missing, unfinished or damaged (its bytes differ from
  the record written with it)."""
  arrays, record_path = _block_paths(directory, block)
  try:
    record = json.loads(record_path.read_text())
    data = arrays.read_bytes()
  except (FileNotFoundError, ValueError, UnicodeDecodeError):
    return None
  if not isinstance(record, dict) or len(data) != record.get('bytes') or zlib.crc32(data) != record.get('crc32'):
    return None
  with np.load(io.BytesIO(data), allow_pickle=False) as loaded:
    values = {name: loaded[name] for name in ARRAYS}
  table = TokenTable(Side(values['source_values'], values['source_lengths']),
                     Side(values['target_values'], values['target_lengths']), record['dropped'])
  return table, record


# --- The cache -------------------------------------------------------------------------------

def build(data: DataSettings, vocab_path: str, directory, shard: tuple[int, int] = (0, 1)) -> int | None:
  """Writes this process's missing or damaged blocks (b % count == index of shard = (index, count)) and
  returns the split's line count, or None when the cache is complete and this process's blocks are sound.
  Reads the split once; tokenises only the blocks it writes."""
  manifest = _read_manifest(directory)
  if manifest and all(read_block(directory, b) is not None for b in range(shard[0], manifest['blocks'], shard[1])):
    return None
  directory.mkdir(parents=True, exist_ok=True)
  storage.write_atomic(directory / 'identity.json', json.dumps(identity(data, vocab_path), indent=1))
  block_pairs, lines = data.token_cache_block_pairs, 0
  numbered = enumerate(text_pairs(data, 'train'))
  for block, group in itertools.groupby(numbered, key=lambda item: item[0] // block_pairs):
    if block % shard[1] != shard[0] or read_block(directory, block) is not None:
      lines = block * block_pairs + sum(1 for _ in group)  # read (and checked) but not tokenised
      continue
    counted = [0]

    def pairs(group=group, counted=counted):
      for _, pair in group:
        counted[0] += 1
        yield pair
    table = token_table(pairs(), vocab_path, data.max_train_length)
    write_block(directory, block, table, counted[0])
    lines = block * block_pairs + counted[0]
  return lines


def _read_manifest(directory) -> dict | None:
  try:
    manifest = json.loads((directory / MANIFEST).read_text())
  except (FileNotFoundError, ValueError, UnicodeDecodeError):
    return None
  return manifest if isinstance(manifest, dict) and manifest.get('format') == FORMAT else None


def _finish(directory, lines: int, block_pairs: int) -> dict:
  """The manifest of a cache whose blocks are all written (process 0, after every process built its own)."""
  blocks = -(-lines // block_pairs)
  records = [read_block(directory, b) for b in range(blocks)]
  missing = [b for b, r in enumerate(records) if r is None]
  if missing:
    raise DataError(f'the token cache {directory} lacks blocks {missing[:5]} after every process built its own; '
                    f'start the run again to rebuild them')
  manifest = {'format': FORMAT, 'blocks': blocks, 'lines': lines,
              'rows': sum(r[1]['rows'] for r in records), 'dropped': sum(r[1]['dropped'] for r in records)}
  storage.write_atomic(directory / MANIFEST, json.dumps(manifest))
  return manifest


def load(directory) -> TokenTable:
  """The whole cached table, every block checked against its record."""
  manifest = _read_manifest(directory)
  if manifest is None:
    raise DataError(f'the token cache {directory} is not complete (no {MANIFEST}); build it with '
                    f'python -m flax_transformer.prepare or start the run')
  tables = []
  for block in range(manifest['blocks']):
    read = read_block(directory, block)
    if read is None:
      raise DataError(f'block {block} of the token cache {directory} is damaged or missing; start the run again '
                      f'to rebuild it')
    tables.append(read[0])
  return TokenTable(*(Side(np.concatenate([getattr(t, side).values for t in tables]),
                           np.concatenate([getattr(t, side).lengths for t in tables]))
                      for side in ('sources', 'targets')), dropped=sum(t.dropped for t in tables))


def train_table(data: DataSettings, vocab_path: str, workdir, shard: tuple[int, int] = (0, 1)) -> TokenTable:
  """The training split's table from its cache, which the processes first build together where it is
  missing (collective: call on every process; shard = (this process's index, the process count))."""
  directory = storage.path(location(data, workdir)) / fingerprint(identity(data, vocab_path))
  error, lines, start = None, None, time.perf_counter()
  try:
    lines = build(data, vocab_path, directory, shard)
    if lines is not None:
      print(f'token cache: the blocks of process {shard[0]} of {shard[1]} written to {directory} in '
            f'{time.perf_counter() - start:.1f} s', flush=True)
  except (DataError, storage.StorageError) as raised:
    error = raised
  lines = max(int(v) for v in cluster.agree('token cache blocks', error, str(lines or 0)))
  error = None
  try:
    if shard[0] == 0 and lines and _read_manifest(directory) is None:
      _finish(directory, lines, data.token_cache_block_pairs)
  except (DataError, storage.StorageError) as raised:
    error = raised
  cluster.agree('token cache', error)
  start = time.perf_counter()
  table = load(directory)
  if shard[0] == 0:
    print(f'token cache: {len(table):,} pairs read from {directory} in {time.perf_counter() - start:.1f} s', flush=True)
  if not len(table):
    raise DataError(f'the training split holds no sentence pair of at most config.max_train_length='
                    f'{data.max_train_length} tokens ({table.dropped} longer ones dropped); raise '
                    f'config.max_train_length')
  return table
