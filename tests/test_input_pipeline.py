"""Training batches and their batching: the tfds WMT14 path (mocked), text files, sharding, resumption."""

import json

import numpy as np
import tensorflow as tf
import pytest
import tensorflow_datasets as tfds

from flax_transformer import bucketing, input_pipeline, parallel_text, settings, token_table, tokenizer
from tests.helpers.corpus import write_corpus


def one_process_batches(config, vocab_path, data_parallel_size=1, **kwargs):
  """The training batches of a one-process run: one shard, its own histogram."""
  table = token_table.train_table(settings.resolve(config).data, vocab_path)
  batching = input_pipeline.train_batching(settings.resolve(config).data, table.histogram(config.max_train_length), table.dropped, data_parallel_size)
  return input_pipeline.train_batches(table, batching, **kwargs)


@pytest.mark.parametrize('mode', ['pairs', 'longer_side'])
def test_epoch_has_every_example_once_within_budget(files_config, vocab, mode):
  _, path = vocab
  files_config.max_train_length = 64  # keep everything
  files_config.bucket_shapes = mode
  stream = one_process_batches(files_config, path, data_parallel_size=4, repeat=False)
  batches = list(stream)
  processor = tokenizer.load(path)
  seen = []
  for batch in batches:
    assert batch['inputs'].shape[0] % 4 == 0
    assert batch['inputs'].size <= files_config.tokens_per_batch
    assert batch['targets'].size <= files_config.tokens_per_batch
    for source, target in zip(batch['inputs'], batch['targets']):
      if target.any():
        seen.append((tokenizer.decode_ids(processor, source), tokenizer.decode_ids(processor, target)))
  expected = list(parallel_text.python_pairs(settings.resolve(files_config).data))
  assert len(seen) == len(expected) and sorted(seen) == sorted(expected)  # nothing lost, nothing duplicated
  assert stream.batching.dropped == 0
  shapes = {(b['inputs'].shape, b['targets'].shape) for b in batches}
  boundaries = stream.batching.boundaries
  if mode == 'pairs':
    assert len(shapes) <= 3 * len(boundaries)
  else:
    assert len(shapes) <= len(boundaries) and all(s[1] == t[1] for s, t in shapes)
    for batch in batches:  # each row's longer side lies in the batch's bucket: longer than the next-smaller one
      longer = np.maximum((batch['inputs'] > 0).sum(1), (batch['targets'] > 0).sum(1))
      smaller = [b for b in boundaries if b < batch['inputs'].shape[1]]
      assert (longer[longer > 0] > max(smaller, default=0)).all()


def test_unknown_bucket_shapes_is_a_one_line_error(files_config, vocab):
  files_config.bucket_shapes = 'both'
  with pytest.raises(bucketing.BatchingError, match="config.bucket_shapes='both' is not one of pairs, longer_side"):
    one_process_batches(files_config, vocab[1])


def test_too_long_pairs_are_dropped_and_counted(files_config, vocab):
  _, path = vocab
  files_config.max_train_length = 6
  stream = one_process_batches(files_config, path, repeat=False)
  batches = list(stream)
  kept = sum(int(b['targets'].any(1).sum()) for b in batches)
  processor = tokenizer.load(path)
  too_long = sum(1 for s, t in parallel_text.python_pairs(settings.resolve(files_config).data)
                 if max(len(processor.encode(s)), len(processor.encode(t))) + 1 > 6)
  assert stream.batching.dropped == too_long > 0
  assert kept == 300 - too_long
  assert all(b['inputs'].shape[1] <= 6 and b['targets'].shape[1] <= 6 for b in batches)


def test_same_seed_same_batches_other_seed_other_order(files_config, vocab):
  _, path = vocab
  take = lambda seed: [next(stream)['inputs'] for stream in [one_process_batches(files_config, path, seed=seed)]
                       for _ in range(6)]
  first, again, other = take(1), take(1), take(2)
  assert len(first) == 6 and all(np.array_equal(a, b) for a, b in zip(first, again))
  assert not all(a.shape == b.shape and np.array_equal(a, b) for a, b in zip(first, other))


def test_wmt14_through_tfds(tiny_config, tmp_path):
  tiny_config.dataset = 'wmt14_translate/de-en'
  with tfds.testing.mock_data(num_examples=40):
    processor, path = tokenizer.train_or_load(settings.resolve(tiny_config).data, str(tmp_path),
                                              lambda: parallel_text.python_pairs(settings.resolve(tiny_config).data))
    batch = next(one_process_batches(tiny_config, path))
    eval_rows = sum(int(b['targets'].any(1).sum()) for b in token_table.eval_batches(settings.resolve(tiny_config).data, path))
  assert batch['inputs'].ndim == 2 and batch['inputs'].dtype == np.int32
  assert eval_rows == 40


def _shard_streams(config, path, shards, data_parallel_size):
  """What each of `shards` processes builds: its own table, the summed histogram, one batching each."""
  tables = [token_table.train_table(settings.resolve(config).data, path, (i, shards)) for i in range(shards)]
  histogram = sum(t.histogram(config.max_train_length) for t in tables)
  plans = [input_pipeline.train_batching(settings.resolve(config).data, histogram, sum(t.dropped for t in tables), data_parallel_size)
           for _ in tables]
  return tables, [input_pipeline.train_batches(t, p, (i, shards), seed=5) for i, (t, p) in enumerate(zip(tables, plans))]


def _wmt_from(sources: list[str], targets: list[str]):
  """A tfds `_as_dataset` serving these pairs as wmt14_translate/de-en's split, and each of
  tfds.even_splits' sub-splits as its contiguous part (as tfds does; tfds' own mock serves every sub-split
  whole)."""
  def as_dataset(self, split, decoders=None, read_config=None, **kwargs):
    rows = np.arange(len(sources))
    if not isinstance(split, str):
      rows = np.array_split(rows, split.count)[split.index]
    return tf.data.Dataset.from_tensor_slices({'en': [sources[i] for i in rows], 'de': [targets[i] for i in rows]})
  return as_dataset


@pytest.mark.parametrize('source', ['files', 'tfds'])
@pytest.mark.parametrize('mode', ['pairs', 'longer_side'])
def test_every_shard_builds_the_same_shape_at_every_step(files_config, tmp_path, source, mode):
  config = files_config
  config.bucket_shapes, config.num_bucket_boundaries, config.max_train_length = mode, 8, 64
  config.tokens_per_batch, config.gradient_accumulation_steps = 1024, 2
  paths, _, _ = write_corpus(str(tmp_path), 900, 3, 'long')
  config.train_source, config.train_target = paths
  mock = tfds.testing.mock_data(as_dataset_fn=_wmt_from(*parallel_text.read_parallel_files(*paths)))
  if source == 'tfds':
    config.dataset = 'wmt14_translate/de-en'
    mock.__enter__()
  try:
    _, path = tokenizer.train_or_load(settings.resolve(config).data, str(tmp_path / source), lambda: parallel_text.python_pairs(settings.resolve(config).data))
    whole = token_table.train_table(settings.resolve(config).data, path)
    tables, streams = _shard_streams(config, path, 2, data_parallel_size=4)
    steps = [[next(stream) for _ in range(60)] for stream in streams]
  finally:
    if source == 'tfds':
      mock.__exit__(None, None, None)
  batching = streams[0].batching
  assert len(batching.boundaries) >= 8 and len(batching.used_shapes) >= 8
  # The shards split the data: together they hold every pair of the split once.
  assert sorted(np.concatenate([t.sources.lengths for t in tables])) == sorted(whole.sources.lengths)
  assert abs(len(tables[0]) - len(tables[1])) <= 1
  shapes = [[(b['inputs'].shape, b['targets'].shape) for b in shard] for shard in steps]
  assert shapes[0] == shapes[1]  # the same shape at every step: one compiled program for the global batch
  assert len(set(shapes[0])) >= 6  # and the steps move through the buckets
  for batch in steps[0]:  # each shard builds its half of a global batch that is a multiple of 4 × 2
    assert (2 * batch['inputs'].shape[0]) % 8 == 0
    assert 2 * batch['inputs'].size <= config.tokens_per_batch and 2 * batch['targets'].size <= config.tokens_per_batch
  real = [sum(int(b['targets'].any(1).sum()) for b in shard) for shard in steps]
  assert min(real) > 0.7 * max(real)  # both shards contribute real rows, not padding


def test_batching_weights_shapes_by_batches_per_epoch(files_config, vocab):
  _, path = vocab
  files_config.max_train_length = 64
  stream = one_process_batches(files_config, path, seed=0)
  batching = stream.batching
  counts = np.zeros(len(batching.batch_sizes))
  for _ in range(400):
    batch = next(stream)
    counts[[k for k in range(len(counts)) if (batching.batch_sizes[k], batching.source_lengths[k], batching.target_lengths[k])
                                          == (batch['inputs'].shape[0], *batch['inputs'].shape[1:],
                                              batch['targets'].shape[1])][0]] += 1
  expected = np.array(batching.pairs) / np.array(batching.batch_sizes)
  expected = expected / expected.sum()
  # 400 draws: each shape's share within 4 binomial standard deviations of its batches-per-epoch share.
  assert np.all(np.abs(counts / 400 - expected) <= 4 * np.sqrt(expected * (1 - expected) / 400) + 1e-9)
  assert counts[expected == 0].sum() == 0


def test_iterator_state_resumes_the_stream(files_config, vocab):
  _, path = vocab
  stream = one_process_batches(files_config, path)
  for _ in range(17):  # past the first epoch of some shapes
    next(stream)
  saved = json.loads(json.dumps(stream.state()))  # as the checkpoint stores it
  expected = [next(stream) for _ in range(10)]
  resumed_stream = one_process_batches(files_config, path, state=saved)
  resumed = [next(resumed_stream) for _ in range(10)]
  assert saved['step'] == 17 and sum(saved['positions']) == 17
  assert all(np.array_equal(a[k], b[k]) for a, b in zip(expected, resumed) for k in ('inputs', 'targets'))


def test_a_global_batch_too_small_for_the_devices_is_a_one_line_error(files_config, vocab):
  files_config.tokens_per_batch = 64
  with pytest.raises(bucketing.BatchingError, match='config.tokens_per_batch=64 cannot hold 8 sentences of'):
    one_process_batches(files_config, vocab[1], data_parallel_size=8)
