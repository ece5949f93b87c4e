"""The pipeline's third stage: the training split's token table, built once into a cache on any storage.

Tokenising WMT14's 4.5M pairs takes minutes; a run does it once, and every later start, resume or run on the
same data and vocabulary reads the ids instead (as fairseq-preprocess, sockeye-prepare-data and levanter's
cache do). `python -m flax_transformer prepare` builds it ahead of a run, on a CPU machine.

A cache lives at config.token_cache (default WORKDIR/token_cache), one folder per fingerprint of everything
that determines it — the data's identity (files' paths, sizes and modification times, or the tfds name,
version and split), the vocabulary's SHA-256, max_train_length and the block size — so a cache built from
other data or another vocabulary is never read:

  <token_cache>/<fingerprint>/
    identity.json       what the fingerprint covers, for people
    block-00000.npz     pairs [b·P, (b+1)·P) of the split (P = config.token_cache_block_pairs), tokenised and
                        filtered: source and target ids (uint16 where the vocabulary allows) and lengths
    block-00000.json    that file's size and CRC-32, its rows, tokens, lines and dropped pairs; written after
                        the .npz, so a block without it is unfinished
    cache.json          every block's record and the totals: written last, once every block is there

Blocks are fixed line ranges, so a cache is the same whatever number of processes built it. Process i of n
builds the blocks b with b % n == i, each written as soon as its lines are tokenised: a build killed at any
point continues from the blocks already written. Every process then reads the whole table into arrays
allocated once at its final size (uint16 ids: 2 bytes a token), checking each block's bytes against its
record as it reads them; a block that differs is rebuilt, never read as data. A cache built beside another
one (other data, another vocabulary) says which of the fingerprint's values differ.
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
from flax_transformer.parallel_text import DataError, DataSettings, source_for, text_pairs
from flax_transformer.token_table import Side, TokenTable, token_table

FORMAT = 2  # the layout above; a change makes a new fingerprint
MANIFEST = 'cache.json'
ARRAYS = ('source_values', 'source_lengths', 'target_values', 'target_lengths')


def identity(data: DataSettings, vocab_path: str) -> dict:
  """Everything the cached table depends on, as JSON values."""
  source = source_for(data).identity()
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
  storage.write_atomic(record, json.dumps({
      'bytes': len(data), 'crc32': zlib.crc32(data), 'rows': len(table), 'lines': lines, 'dropped': table.dropped,
      'source_tokens': len(table.sources.values), 'target_tokens': len(table.targets.values),
      'dtype': table.sources.values.dtype.name}))


def _read_record(directory, block: int) -> dict | None:
  try:
    record = json.loads(_block_paths(directory, block)[1].read_text())
  except (FileNotFoundError, ValueError, UnicodeDecodeError):
    return None
  return record if isinstance(record, dict) else None


def read_block(directory, block: int, record: dict | None = None) -> dict[str, np.ndarray] | None:
  """The block's arrays (ARRAYS), or None if it is missing, unfinished or damaged (its bytes differ from
  `record`, by default the one written with it)."""
  record = record or _read_record(directory, block)
  try:
    data = _block_paths(directory, block)[0].read_bytes() if record else b''
  except FileNotFoundError:
    return None
  if not record or len(data) != record.get('bytes') or zlib.crc32(data) != record.get('crc32'):
    return None
  with np.load(io.BytesIO(data), allow_pickle=False) as loaded:
    return {name: loaded[name] for name in ARRAYS}


# --- The cache -------------------------------------------------------------------------------

def build(data: DataSettings, vocab_path: str, directory, shard: tuple[int, int] = (0, 1),
          damaged: set[int] | None = None) -> int:
  """Writes this process's blocks (b % count == index of shard = (index, count)) that are missing or damaged
  — each checked here, or, after a read of the complete cache, those in `damaged` — and returns the split's
  line count. Reads the split once; tokenises only the blocks it writes."""
  directory.mkdir(parents=True, exist_ok=True)
  storage.write_atomic(directory / 'identity.json', json.dumps(identity(data, vocab_path), indent=1))
  block_pairs, lines = data.token_cache_block_pairs, 0
  numbered = enumerate(text_pairs(data, 'train'))
  for block, group in itertools.groupby(numbered, key=lambda item: item[0] // block_pairs):
    sound = block not in damaged if damaged is not None else read_block(directory, block) is not None
    if block % shard[1] != shard[0] or sound:
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
  """The manifest of a cache whose blocks are all written (process 0, after every process built its own),
  from the blocks' records (or the previous manifest's, for a block not rebuilt); their bytes are checked as
  they are read."""
  blocks = -(-lines // block_pairs)
  previous = (_read_manifest(directory) or {}).get('records', [])
  records = [_read_record(directory, b) or (previous[b] if b < len(previous) else None) for b in range(blocks)]
  missing = [b for b, r in enumerate(records) if r is None]
  if missing:
    raise DataError(f'the token cache {directory} lacks blocks {missing[:5]} after every process built its own; '
                    f'start the run again to rebuild them')
  manifest = {'format': FORMAT, 'blocks': blocks, 'lines': lines, 'records': records,
              'rows': sum(r['rows'] for r in records), 'dropped': sum(r['dropped'] for r in records)}
  storage.write_atomic(directory / MANIFEST, json.dumps(manifest))
  return manifest


def _read(directory, manifest: dict) -> tuple[TokenTable, list[int]]:
  """The whole table, read block by block into arrays allocated once, and the blocks whose bytes differ
  from their records (left as zeros: never data)."""
  records = manifest['records']
  dtype = np.dtype(records[0]['dtype']) if records else np.uint16
  sides = {side: Side(np.zeros(sum(r[f'{side}_tokens'] for r in records), dtype),
                      np.zeros(manifest['rows'], np.int64)) for side in ('source', 'target')}
  damaged, row, token = [], 0, {'source': 0, 'target': 0}
  for block, record in enumerate(records):
    arrays = read_block(directory, block, record)
    if arrays is None or any(len(arrays[f'{side}_values']) != record[f'{side}_tokens'] for side in token):
      damaged.append(block)
    else:
      for side, into in sides.items():
        into.values[token[side]:token[side] + record[f'{side}_tokens']] = arrays[f'{side}_values']
        into.lengths[row:row + record['rows']] = arrays[f'{side}_lengths']
    row += record['rows']
    for side in token:
      token[side] += record[f'{side}_tokens']
  return TokenTable(sides['source'], sides['target'], dropped=manifest['dropped']), damaged


def load(directory) -> TokenTable:
  """The whole cached table, every block checked against its record."""
  manifest = _read_manifest(directory)
  if manifest is None:
    raise DataError(f'the token cache {directory} is not complete (no {MANIFEST}); build it with '
                    f'python -m flax_transformer prepare or start the run')
  table, damaged = _read(directory, manifest)
  if damaged:
    raise DataError(f'blocks {damaged[:5]} of the token cache {directory} are damaged; start the run again '
                    f'to rebuild them')
  return table


def _flat(value, prefix: str = '') -> dict:
  if isinstance(value, dict):
    return {k: v for key, item in value.items() for k, v in _flat(item, f'{prefix}{key}.').items()}
  return {prefix[:-1]: value}


def differences(directory, identity_: dict) -> str:
  """How the caches beside `directory` differ from `identity_` (the nearest one: fewest values differing),
  in words, or '' where there is none."""
  wanted, nearest = _flat(identity_), None
  try:
    siblings = [p for p in directory.parent.iterdir() if p.name != directory.name]
  except (FileNotFoundError, NotADirectoryError):
    return ''
  for sibling in sorted(siblings, key=lambda p: p.name):
    try:
      other = _flat(json.loads((sibling / 'identity.json').read_text()))
    except (FileNotFoundError, NotADirectoryError, ValueError, UnicodeDecodeError):
      continue
    keys = [k for k in sorted(set(wanted) | set(other)) if wanted.get(k) != other.get(k)]
    if nearest is None or len(keys) < len(nearest[1]):
      nearest = sibling, keys, other
  if nearest is None:
    return ''
  sibling, keys, other = nearest
  said = '; '.join(f'{k} {other.get(k)!r} there, {wanted.get(k)!r} here' for k in keys[:3])
  return f'the cache {sibling.name} beside it was built from other values ({said})'


def train_table(data: DataSettings, vocab_path: str, workdir, shard: tuple[int, int] = (0, 1)) -> TokenTable:
  """The training split's table from its cache, which the processes first build together where it is
  missing or damaged (collective: call on every process; shard = (this process's index, the process count)).
  A complete cache is read once, checking each block as it comes."""
  identity_ = identity(data, vocab_path)
  directory = storage.path(location(data, workdir)) / fingerprint(identity_)
  start = time.perf_counter()
  manifest = _read_manifest(directory)
  table, damaged = _read(directory, manifest) if manifest else (None, None)
  # every process reads the same storage; any that found no manifest or a damaged block makes all rebuild
  found = [json.loads(v) for v in cluster.agree('token cache read', None, json.dumps(damaged))]
  if all(f == [] for f in found):
    return _checked(table, data, directory, start, shard)
  table, damaged = None, sorted(set().union(*found)) if None not in found else None
  error, lines = None, 0
  try:
    if damaged:
      print(f'token cache: blocks {damaged[:5]} of {directory} are damaged; rebuilding them', flush=True)
    elif shard[0] == 0 and (said := differences(directory, identity_)):
      print(f'token cache: building {directory.name} at {directory.parent}: {said}', flush=True)
    _check_writable(directory, identity_)
    lines = build(data, vocab_path, directory, shard, set(damaged) if damaged else None)
    print(f'token cache: the blocks of process {shard[0]} of {shard[1]} written to {directory} in '
          f'{time.perf_counter() - start:.1f} s', flush=True)
  except (DataError, storage.StorageError) as raised:
    error = raised
  lines = max(int(v) for v in cluster.agree('token cache blocks', error, str(lines)))
  error = None
  try:
    if shard[0] == 0:
      _finish(directory, lines, data.token_cache_block_pairs)
  except (DataError, storage.StorageError) as raised:
    error = raised
  cluster.agree('token cache', error)
  start = time.perf_counter()
  return _checked(load(directory), data, directory, start, shard)


def _check_writable(directory, identity_: dict) -> None:
  try:
    storage.check_writable(directory, 'the token cache', 'set config.token_cache to a folder this run can write')
  except storage.StorageError:
    said = differences(directory, identity_)
    if said:
      raise storage.StorageError(f'the token cache {directory} must be built and cannot be written: {said}; '
                                 f'set config.token_cache to a folder this run can write') from None
    raise


def _checked(table: TokenTable, data: DataSettings, directory, start: float, shard: tuple[int, int]) -> TokenTable:
  if shard[0] == 0:
    print(f'token cache: {len(table):,} pairs read from {directory} in {time.perf_counter() - start:.1f} s', flush=True)
  if not len(table):
    raise DataError(f'the training split holds no sentence pair of at most config.max_train_length='
                    f'{data.max_train_length} tokens ({table.dropped} longer ones dropped); raise '
                    f'config.max_train_length')
  return table
