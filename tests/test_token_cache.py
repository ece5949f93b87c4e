"""The token cache: the training split tokenised once, the same whatever number of processes built it, a
killed build continued, a damaged block rebuilt and never read, another data or vocabulary another cache."""

import os

import numpy as np
import pytest

from flax_transformer import parallel_text, settings, storage, token_cache, token_table


def _reference(data, vocab_path):
  """The split tokenised directly, in one table (the cache's independent reference)."""
  return token_table.token_table(parallel_text.text_pairs(data, 'train'), vocab_path, data.max_train_length)


def _equal(a, b):
  return all(np.array_equal(getattr(a, side).values, getattr(b, side).values)
             and np.array_equal(getattr(a, side).lengths, getattr(b, side).lengths)
             for side in ('sources', 'targets')) and a.dropped == b.dropped


@pytest.fixture
def data(files_config):
  files_config.token_cache_block_pairs = 64  # 300 pairs: 5 blocks, the last of 44
  files_config.max_train_length = 10  # some pairs dropped
  return settings.resolve(files_config).data


@pytest.fixture
def tokenised(monkeypatch):
  """The first line of each block the cache tokenises, in order."""
  blocks, original = [], token_cache.token_table

  def counting(pairs, *args, **kwargs):
    pairs = iter(pairs)
    first = next(pairs)
    blocks.append(first[0].decode())
    return original(iter([first, *pairs]), *args, **kwargs)
  monkeypatch.setattr(token_cache, 'token_table', counting)
  return blocks


def _directory(data, vocab_path, workdir):
  return storage.path(token_cache.location(data, workdir)) / token_cache.fingerprint(token_cache.identity(data, vocab_path))


def test_built_once_then_read(data, vocab, tmp_path, tokenised):
  table = token_cache.train_table(data, vocab[1], tmp_path / 'run')
  assert len(tokenised) == 5
  expected = _reference(data, vocab[1])
  assert _equal(table, expected) and 0 < table.dropped and len(table) + table.dropped == 300
  assert table.sources.values.dtype == np.uint16  # 2 bytes a token
  again = token_cache.train_table(data, vocab[1], tmp_path / 'run')
  assert len(tokenised) == 5 and _equal(again, expected)  # the second start tokenises nothing


def test_the_same_cache_whatever_number_of_processes_built_it(data, vocab, tmp_path):
  one = tmp_path / 'one'
  token_cache.train_table(data, vocab[1], one)
  directory = _directory(data, vocab[1], tmp_path / 'three')
  counts = [token_cache.build(data, vocab[1], directory, (i, 3)) for i in (2, 0, 1)]  # each its blocks, any order
  assert counts == [300, 300, 300] and not (directory / token_cache.MANIFEST).exists()
  token_cache._finish(directory, 300, 64)
  built = {p.name: p.read_bytes() for p in directory.iterdir()}
  assert built == {p.name: p.read_bytes() for p in _directory(data, vocab[1], one).iterdir()}  # byte for byte


def test_a_killed_build_continues_from_the_blocks_written(data, vocab, tmp_path, tokenised, monkeypatch):
  original = token_cache.write_block

  def killed_after_two(directory, block, *args):
    if block == 2:
      raise KeyboardInterrupt  # the process dies while tokenising block 2
    original(directory, block, *args)
  monkeypatch.setattr(token_cache, 'write_block', killed_after_two)
  with pytest.raises(KeyboardInterrupt):
    token_cache.train_table(data, vocab[1], tmp_path)
  monkeypatch.setattr(token_cache, 'write_block', original)
  del tokenised[:]
  table = token_cache.train_table(data, vocab[1], tmp_path)
  lines = parallel_text.read_lines(data.train_source)
  assert tokenised == [lines[128], lines[192], lines[256]]  # blocks 2, 3, 4 only
  assert _equal(table, _reference(data, vocab[1]))


def test_a_damaged_block_is_rebuilt_never_read(data, vocab, tmp_path, tokenised):
  token_cache.train_table(data, vocab[1], tmp_path)
  directory = _directory(data, vocab[1], tmp_path)
  truncated, flipped = directory / 'block-00001.npz', directory / 'block-00003.npz'
  truncated.write_bytes(truncated.read_bytes()[:-100])
  data_bytes = bytearray(flipped.read_bytes())
  data_bytes[-3] ^= 0xFF  # a token id changed, the size the same
  flipped.write_bytes(bytes(data_bytes))
  (directory / 'block-00004.npz').unlink()  # a lost block
  del tokenised[:]
  table = token_cache.train_table(data, vocab[1], tmp_path)
  lines = parallel_text.read_lines(data.train_source)
  assert tokenised == [lines[64], lines[192], lines[256]]
  assert _equal(table, _reference(data, vocab[1]))


def test_other_data_vocabulary_or_length_is_another_cache(data, vocab, tmp_path, files_config):
  first = token_cache.fingerprint(token_cache.identity(data, vocab[1]))
  shorter = settings.resolve(files_config).data.__class__(**{**data.__dict__, 'max_train_length': 9})
  assert token_cache.fingerprint(token_cache.identity(shorter, vocab[1])) != first
  stat = os.stat(data.train_target)
  os.utime(data.train_target, (stat.st_atime, stat.st_mtime + 5))  # the file changed
  assert token_cache.fingerprint(token_cache.identity(data, vocab[1])) != first
  other_vocab = tmp_path / 'other.model'
  other_vocab.write_bytes(storage.path(vocab[1]).read_bytes() + b'\0')
  assert token_cache.fingerprint(token_cache.identity(data, str(other_vocab))) != first


def test_a_cache_on_object_storage_shared_by_two_runs(data, vocab, tmp_path, gcs, tokenised):
  shared = data.__class__(**{**data.__dict__, 'token_cache': 'gs://bucket/token-cache'})
  first = token_cache.train_table(shared, vocab[1], tmp_path / 'a')
  second = token_cache.train_table(shared, vocab[1], tmp_path / 'b')
  assert len(tokenised) == 5 and _equal(first, second) and _equal(first, _reference(data, vocab[1]))
  assert not (tmp_path / 'a').exists() and not (tmp_path / 'b').exists()


def test_a_split_without_a_pair_that_fits_is_a_one_line_error(data, vocab, tmp_path):
  short = data.__class__(**{**data.__dict__, 'max_train_length': 1})
  with pytest.raises(parallel_text.DataError) as error:
    token_cache.train_table(short, vocab[1], tmp_path)
  assert 'holds no sentence pair of at most config.max_train_length=1 tokens (300' in str(error.value)
  assert '\n' not in str(error.value)


def test_a_complete_cache_reads_each_block_once(data, vocab, tmp_path, monkeypatch):
  token_cache.train_table(data, vocab[1], tmp_path)
  read, original = [], token_cache.read_block

  def counting(directory, block, *args):
    read.append(block)
    return original(directory, block, *args)
  monkeypatch.setattr(token_cache, 'read_block', counting)
  table = token_cache.train_table(data, vocab[1], tmp_path)
  assert read == [0, 1, 2, 3, 4] and _equal(table, _reference(data, vocab[1]))


def test_a_cache_beside_another_says_what_differs(data, vocab, tmp_path, capsys):
  token_cache.train_table(data, vocab[1], tmp_path)
  shorter = data.__class__(**{**data.__dict__, 'max_train_length': 9})
  token_cache.train_table(shorter, vocab[1], tmp_path)
  line = [l for l in capsys.readouterr().out.splitlines() if 'building' in l]
  assert len(line) == 1 and 'max_train_length 10 there, 9 here' in line[0]


def test_a_shared_cache_that_cannot_be_written_names_the_difference(data, vocab, tmp_path, monkeypatch):
  shared = data.__class__(**{**data.__dict__, 'token_cache': str(tmp_path / 'shared')})
  token_cache.train_table(shared, vocab[1], tmp_path / 'a')

  def read_only(directory, what, fix):  # as storage.check_writable answers for a folder it cannot write
    raise storage.StorageError(f'{what} {directory} cannot be written (PermissionError: denied); {fix}')
  monkeypatch.setattr(storage, 'check_writable', read_only)
  token_cache.train_table(shared, vocab[1], tmp_path / 'a')  # the same data: read, never written
  other = shared.__class__(**{**shared.__dict__, 'max_train_length': 9})
  with pytest.raises(storage.StorageError) as error:
    token_cache.train_table(other, vocab[1], tmp_path / 'b')
  message = str(error.value)
  assert 'cannot be written' in message and 'max_train_length 10 there, 9 here' in message and '\n' not in message
