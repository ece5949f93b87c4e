"""Vocabulary and batches: tfds WMT14 path (mocked), text files, Multi30k; bucketing invariants; errors."""

import gzip
import os

import numpy as np
import pytest
import tensorflow_datasets as tfds

from configs import multi30k
from flax_transformer import input_pipeline, tokenizer

WORDS = 'the a cat dog sat on mat runs fast slow red blue house tree big small man woman child ball'.split()


def write_corpus(directory, n=300, seed=0, name='train'):
  rng = np.random.default_rng(seed)
  sources, targets = [], []
  for _ in range(n):
    words = list(rng.choice(WORDS, size=rng.integers(1, 14)))
    sources.append(' '.join(words))
    targets.append(' '.join(w.upper() for w in reversed(words)))
  paths = []
  for lang, lines in (('src', sources), ('tgt', targets)):
    path = os.path.join(directory, f'{name}.{lang}.gz')
    with gzip.open(path, 'wt', encoding='utf-8') as f:
      f.write('\n'.join(lines) + '\n')
    paths.append(path)
  return paths, sources, targets


@pytest.fixture
def files_config(tiny_config, tmp_path):
  (train_src, train_tgt), _, _ = write_corpus(str(tmp_path), 300, 0, 'train')
  (eval_src, eval_tgt), _, _ = write_corpus(str(tmp_path), 37, 1, 'eval')
  config = tiny_config
  config.dataset = 'files'
  config.train_source, config.train_target = train_src, train_tgt
  config.eval_source, config.eval_target = eval_src, eval_tgt
  config.test_source, config.test_target = eval_src, eval_tgt
  config.max_length = 12
  return config


@pytest.fixture
def vocab(files_config, tmp_path):
  processor, path = tokenizer.train_or_load(files_config, str(tmp_path / 'work'),
                                            lambda: input_pipeline.python_pairs(files_config))
  return processor, path


def test_vocabulary_is_trained_once_and_reserves_ids(files_config, vocab, tmp_path):
  processor, path = vocab
  assert processor.get_piece_size() == files_config.model.vocab_size
  assert (processor.pad_id(), processor.eos_id(), processor.unk_id()) == (0, 1, 2)
  mtime = os.path.getmtime(path)
  tokenizer.train_or_load(files_config, str(tmp_path / 'work'), lambda: pytest.fail('must reuse the saved model'))
  assert os.path.getmtime(path) == mtime
  files_config.model.vocab_size = 128
  with pytest.raises(tokenizer.VocabularyError, match='has 64 pieces but config.model.vocab_size=128'):
    tokenizer.train_or_load(files_config, str(tmp_path / 'work'), None)


@pytest.mark.parametrize('mode', ['pairs', 'longer_side'])
def test_epoch_has_every_example_once_within_budget(files_config, vocab, mode):
  _, path = vocab
  files_config.max_length = 64  # keep everything
  files_config.bucket_shapes = mode
  dropped = input_pipeline.DroppedCounter()
  batches = list(input_pipeline.train_batches(files_config, path, data_parallel_size=4, repeat=False,
                                              dropped=dropped).as_numpy_iterator())
  processor = tokenizer.load(path)
  seen = []
  for batch in batches:
    assert batch['inputs'].shape[0] % 4 == 0
    assert batch['inputs'].size <= files_config.tokens_per_batch
    assert batch['targets'].size <= files_config.tokens_per_batch
    for source, target in zip(batch['inputs'], batch['targets']):
      if target.any():
        seen.append((tokenizer.decode_ids(processor, source), tokenizer.decode_ids(processor, target)))
  expected = list(input_pipeline.python_pairs(files_config))
  assert sorted(seen) == sorted(expected)  # nothing lost, nothing duplicated
  assert dropped.value == 0
  shapes = {(b['inputs'].shape, b['targets'].shape) for b in batches}
  boundaries = files_config.num_bucket_boundaries + 1  # the DP's boundaries, plus the catch-all max_length
  if mode == 'pairs':
    assert len(shapes) <= 3 * boundaries
  else:
    assert len(shapes) <= boundaries and all(s[1] == t[1] for s, t in shapes)
    for batch in batches:  # each row's longer side lies in the batch's bucket: longer than the next-smaller one
      longer = np.maximum((batch['inputs'] > 0).sum(1), (batch['targets'] > 0).sum(1))
      smaller = [b for b in {s[1] for s, _ in shapes} if b < batch['inputs'].shape[1]]
      assert (longer[longer > 0] > max(smaller, default=0)).all()


def test_unknown_bucket_shapes_is_a_one_line_error(files_config, vocab):
  files_config.bucket_shapes = 'both'
  with pytest.raises(input_pipeline.DataError, match="config.bucket_shapes='both' is not one of pairs, longer_side"):
    input_pipeline.train_batches(files_config, vocab[1])


def test_too_long_pairs_are_dropped_and_counted(files_config, vocab):
  _, path = vocab
  files_config.max_length = 6
  dropped = input_pipeline.DroppedCounter()
  batches = list(input_pipeline.train_batches(files_config, path, repeat=False, dropped=dropped)
                 .as_numpy_iterator())
  kept = sum(int(b['targets'].any(1).sum()) for b in batches)
  processor = tokenizer.load(path)
  too_long = sum(1 for s, t in input_pipeline.python_pairs(files_config)
                 if max(len(processor.encode(s)), len(processor.encode(t))) + 1 > 6)
  assert dropped.value == too_long > 0
  assert kept == 300 - too_long
  assert all(b['inputs'].shape[1] <= 6 and b['targets'].shape[1] <= 6 for b in batches)


def test_same_seed_same_batches_other_seed_other_order(files_config, vocab):
  _, path = vocab
  take = lambda seed: [b['inputs'] for b in input_pipeline.train_batches(files_config, path, seed=seed)
                       .take(6).as_numpy_iterator()]
  first, again, other = take(1), take(1), take(2)
  assert all(np.array_equal(a, b) for a, b in zip(first, again))
  assert not all(a.shape == b.shape and np.array_equal(a, b) for a, b in zip(first, other))


def test_eval_batches_keep_order_and_every_sentence(files_config, vocab):
  processor, path = vocab
  batches = list(input_pipeline.eval_batches(files_config, path, data_parallel_size=2).as_numpy_iterator())
  rows = [(s, t) for b in batches for s, t in zip(b['inputs'], b['targets']) if t.any()]
  expected = list(input_pipeline.python_pairs(files_config, 'eval'))
  assert [(tokenizer.decode_ids(processor, s), tokenizer.decode_ids(processor, t)) for s, t in rows] == expected
  assert len({b['inputs'].shape[0] for b in batches}) == 1


def test_wmt14_through_tfds(tiny_config, tmp_path):
  tiny_config.dataset = 'wmt14_translate/de-en'
  with tfds.testing.mock_data(num_examples=40):
    processor, path = tokenizer.train_or_load(tiny_config, str(tmp_path),
                                              lambda: input_pipeline.python_pairs(tiny_config))
    batch = next(input_pipeline.train_batches(tiny_config, path).as_numpy_iterator())
    eval_rows = sum(int(b['targets'].any(1).sum()) for b in
                    input_pipeline.eval_batches(tiny_config, path).as_numpy_iterator())
  assert batch['inputs'].ndim == 2 and batch['inputs'].dtype == np.int32
  assert eval_rows == 40


def test_multi30k_files_by_path(tmp_path):
  config = multi30k.get_config()
  if not os.path.exists(config.train_source):
    pytest.skip('../shared/data/multi30k is not beside this checkout')
  pairs = input_pipeline.python_pairs(config, 'test')
  first = next(pairs)
  assert first[0].startswith('A man') and first[1]
  assert len(input_pipeline.read_lines(config.eval_source)) == 1014


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
  with pytest.raises(input_pipeline.DataError) as error:
    input_pipeline.read_parallel_files(str(good), str(other))
  assert message in str(error.value) and '\n' not in str(error.value)


def test_tfds_errors_say_how_to_fix(tiny_config, tmp_path):
  tiny_config.dataset = 'no_such_dataset_xyz'
  with pytest.raises(input_pipeline.DataError, match='is not a tfds dataset'):
    next(input_pipeline.python_pairs(tiny_config))
  tiny_config.dataset = 'wmt14_translate/de-en'
  tiny_config.data_dir = str(tmp_path)
  with pytest.raises(input_pipeline.DataError, match='tfds build wmt14_translate/de-en'):
    next(input_pipeline.python_pairs(tiny_config))


def test_bucket_boundaries_minimise_padding_and_end_with_a_catch_all():
  rng = np.random.default_rng(0)
  lengths = np.concatenate([rng.integers(5, 12, 500), rng.integers(20, 26, 300), [40]])
  boundaries = input_pipeline.bucket_boundaries(lengths, 3, 100)
  assert boundaries[-2:] == [40, 100]  # the DP ends at the longest sampled pair; 100 catches rarer ones

  def padding(bounds):
    padded = np.asarray(bounds)[np.searchsorted(bounds, lengths)]
    return int((padded - lengths).sum())
  # Exhaustive check of the DP: no other 3 boundaries ending at 40 pad less.
  best = min(padding([a, b, 40]) for a in range(1, 40) for b in range(a + 1, 40))
  assert padding(boundaries[:-1]) == best
  assert input_pipeline.bucket_boundaries(np.array([7, 100, 120]), 2, 100)[-1] == 100  # capped at max_length


def test_cached_tokens_give_the_same_batches(files_config, vocab):
  _, path = vocab
  take = lambda: [b for b in input_pipeline.train_batches(files_config, path).take(40).as_numpy_iterator()]
  plain = take()  # 40 batches: several passes over the 300 pairs, so reshuffled epochs are compared too
  files_config.cache_tokenized = True
  cached = take()
  assert all(np.array_equal(a[k], b[k]) for a, b in zip(plain, cached) for k in ('inputs', 'targets'))


@pytest.mark.parametrize('cache_tokenized', [False, True])
def test_iterator_checkpoint_resumes_the_stream(files_config, vocab, tmp_path, cache_tokenized):
  import tensorflow as tf
  _, path = vocab
  files_config.cache_tokenized = cache_tokenized
  batches = lambda: input_pipeline.train_batches(files_config, path)
  iterator = iter(batches())
  for _ in range(17):  # past the first epoch
    next(iterator)
  saved = tf.train.Checkpoint(iterator=iterator).write(str(tmp_path / 'data'))
  expected = [next(iterator) for _ in range(10)]
  fresh = iter(batches())
  tf.train.Checkpoint(iterator=fresh).read(saved).assert_consumed()
  resumed = [next(fresh) for _ in range(10)]
  assert all(np.array_equal(a[k], b[k]) for a, b in zip(expected, resumed) for k in ('inputs', 'targets'))
