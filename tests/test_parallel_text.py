"""parallel_text.py: text pairs from files (plain, gzip, by path) and tfds, and their one-line errors."""

import gzip
import os

import pytest

from configs import multi30k
from flax_transformer import parallel_text, settings
from tests.helpers.corpus import read_parallel_files


def test_multi30k_files_by_path(tmp_path):
  config = multi30k.get_config()
  if not os.path.exists(config.train_source):
    pytest.skip('../shared/data/multi30k is not beside this checkout')
  pairs = parallel_text.python_pairs(settings.resolve(config).data, 'test')
  first = next(pairs)
  assert first[0].startswith('A man') and first[1]
  assert len(parallel_text.read_lines(config.eval_source)) == 1014


@pytest.mark.parametrize('case,message', [
    ('missing', 'does not exist'),
    ('counts', 'has 3 lines but'),
    ('empty', 'is empty'),
    ('utf8', 'line 2 is not valid UTF-8'),
])
def test_bad_files_are_one_line_errors(tmp_path, case, message):
  good = tmp_path / 'good.txt'
  good.write_text('a\nb\nc\n')
  other = tmp_path / 'other.txt'
  if case == 'missing':
    other = tmp_path / 'nope.txt'
  elif case == 'counts':
    other.write_text('a\nb\n')
  elif case == 'empty':
    good.write_text('')
    other.write_text('')
  else:
    other.write_bytes(b'ok\n\xff\xfe bad\nc\n')
  with pytest.raises(parallel_text.DataError) as error:
    read_parallel_files(str(good), str(other))
  assert message in str(error.value) and '\n' not in str(error.value)


def test_tfds_errors_say_how_to_fix(tiny_config, tmp_path):
  tiny_config.dataset = 'no_such_dataset_xyz'
  with pytest.raises(parallel_text.DataError, match='is not a tfds dataset'):
    next(parallel_text.python_pairs(settings.resolve(tiny_config).data))
  tiny_config.dataset = 'wmt14_translate/de-en'
  tiny_config.data_dir = str(tmp_path)
  with pytest.raises(parallel_text.DataError, match='tfds build wmt14_translate/de-en'):
    next(parallel_text.python_pairs(settings.resolve(tiny_config).data))


def test_a_damaged_gzip_file_is_a_one_line_error(tmp_path):
  good = gzip.compress(b'one\ntwo\nthree\n')
  (tmp_path / 'cut.gz').write_bytes(good[:-6])  # truncated: EOFError inside gzip
  (tmp_path / 'plain.gz').write_bytes(b'one\ntwo\n')  # not gzip at all: BadGzipFile
  for name in ('cut.gz', 'plain.gz'):
    path = str(tmp_path / name)
    for read in (lambda: parallel_text.read_lines(path), lambda: list(parallel_text.parallel_lines(path, path))):
      with pytest.raises(parallel_text.DataError, match=f'{name} is not a readable gzip file .*download or copy it again'):
        read()


def test_a_new_source_is_one_registered_class_that_every_stage_reads_through(files_config, monkeypatch):
  """A source of JSON lines, registered in one place: the config check, the split's preparation, the pairs
  and the token cache's identity all go through it."""
  import dataclasses
  import json

  from flax_transformer import token_cache
  from flax_transformer.errors import ConfigError

  prepared = []

  class JsonLines(parallel_text.Source):  # {split}_source: a file of {"source": ..., "target": ...} lines
    def check(self):
      if not self.data.train_source.endswith('.jsonl'):
        raise ConfigError(f'config.train_source={self.data.train_source!r}: must be a .jsonl file')

    def prepare(self, split):
      prepared.append(split)

    def pairs(self, split):
      for line in parallel_text.read_lines(getattr(self.data, f'{split}_source')):
        pair = json.loads(line)
        yield pair['source'].encode(), pair['target'].encode()

    def identity(self):
      return {'jsonl': self.data.train_source}

  monkeypatch.setitem(parallel_text.SOURCES, 'jsonl', JsonLines)
  pairs = list(parallel_text.python_pairs(settings.resolve(files_config).data))
  path = files_config.train_source.replace('.gz', '') + '.jsonl'
  with open(path, 'w') as file:
    file.writelines(json.dumps({'source': s, 'target': t}) + '\n' for s, t in pairs)
  files_config.dataset = 'jsonl'
  with pytest.raises(ConfigError, match='must be a .jsonl file'):
    settings.resolve(files_config)
  files_config.train_source = path
  data = settings.resolve(files_config).data
  assert type(parallel_text.source_for(data)) is JsonLines
  assert type(parallel_text.source_for(dataclasses.replace(data, dataset='wmt14_translate/de-en'))) is parallel_text.Tfds
  parallel_text.check_split(data, 'train')
  assert prepared == ['train'] and list(parallel_text.python_pairs(data)) == pairs
  assert token_cache.identity(data, files_config.vocab_path or __file__)['data'] == {'jsonl': path}
