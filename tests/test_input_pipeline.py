"""Training batches and their batching: the tfds WMT14 path (mocked), text files, one global stream that every
process layout reads its rows of, resumption on another layout."""

import json
import os

import numpy as np
import tensorflow as tf
import pytest
import tensorflow_datasets as tfds

from flax_transformer import bucketing, input_pipeline, parallel_text, settings, token_cache, token_table, tokenizer
from tests.helpers.corpus import read_parallel_files, write_corpus


def _table(config, vocab_path):
  data = settings.resolve(config).data
  return token_cache.train_table(data, vocab_path, os.path.join(os.path.dirname(vocab_path), 'run'))


def one_process_batches(config, vocab_path, data_parallel_size=1, **kwargs):
  """The training batches of a one-process run."""
  table = _table(config, vocab_path)
  batching = input_pipeline.train_batching(settings.resolve(config).data, table.histogram(config.max_train_length),
                                           table.dropped, data_parallel_size)
  return input_pipeline.train_batches(table, batching, **kwargs)


def one_epoch(config, vocab_path, data_parallel_size=1):
  table = _table(config, vocab_path)
  batching = input_pipeline.train_batching(settings.resolve(config).data, table.histogram(config.max_train_length),
                                           table.dropped, data_parallel_size)
  return batching, input_pipeline.epoch_batches(table, batching, seed=3)


@pytest.mark.parametrize('mode', ['pairs', 'longer_side'])
def test_epoch_has_every_example_once_within_budget(files_config, vocab, mode):
  _, path = vocab
  files_config.max_train_length = 64  # keep everything
  files_config.bucket_shapes = mode
  batching, batches = one_epoch(files_config, path, data_parallel_size=4)
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
  assert batching.dropped == 0
  shapes = {(b['inputs'].shape, b['targets'].shape) for b in batches}
  boundaries = batching.boundaries
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
  batching, batches = one_epoch(files_config, path)
  kept = sum(int(b['targets'].any(1).sum()) for b in batches)
  processor = tokenizer.load(path)
  too_long = sum(1 for s, t in parallel_text.python_pairs(settings.resolve(files_config).data)
                 if max(len(processor.encode(s)), len(processor.encode(t))) + 1 > 6)
  assert batching.dropped == too_long > 0
  assert kept == 300 - too_long
  assert all(b['inputs'].shape[1] <= 6 and b['targets'].shape[1] <= 6 for b in batches)


def test_same_seed_same_batches_other_seed_other_order(files_config, vocab):
  _, path = vocab
  take = lambda seed: [next(stream)['inputs'] for stream in [one_process_batches(files_config, path, seed=seed)]
                       for _ in range(6)]
  first, again, other = take(1), take(1), take(2)
  assert len(first) == 6 and all(np.array_equal(a, b) for a, b in zip(first, again))
  assert not all(a.shape == b.shape and np.array_equal(a, b) for a, b in zip(first, other))
  # Not only the order of the shapes: within each shape, the rows come in a seed-dependent order too.
  table = _table(files_config, path)
  batching = input_pipeline.train_batching(settings.resolve(files_config).data,
                                           table.histogram(files_config.max_train_length), table.dropped, 1)
  by_shape = lambda seed: {b['inputs'].shape: b['inputs'] for b in reversed(
      input_pipeline.epoch_batches(table, batching, seed=seed))}  # each shape's first batch
  seeded = [by_shape(seed) for seed in (1, 2)]
  shared = [shape for shape in seeded[0] if shape in seeded[1] and shape[0] > 1]
  assert shared and all(not np.array_equal(seeded[0][shape], seeded[1][shape]) for shape in shared)


def test_wmt14_through_tfds(tiny_config, tmp_path):
  tiny_config.dataset = 'wmt14_translate/de-en'
  with tfds.testing.mock_data(num_examples=40):
    processor, path = tokenizer.train_or_load(settings.resolve(tiny_config).data, str(tmp_path),
                                              lambda: parallel_text.python_pairs(settings.resolve(tiny_config).data))
    batch = next(one_process_batches(tiny_config, path))
    eval_rows = sum(int(b['targets'].any(1).sum()) for b in token_table.eval_batches(settings.resolve(tiny_config).data, path))
  assert batch['inputs'].ndim == 2 and batch['inputs'].dtype == np.int32
  assert eval_rows == 40


def _layouts_batches(table, batching, steps, state=None):
  """What each process of three layouts of 8 data-parallel blocks reads at `steps` steps: {layout: [steps of
  the per-block rows, reassembled into the global batch]}."""
  layouts = {'1 process': [tuple(range(8))], '2 processes': [(0, 1, 2, 3), (4, 5, 6, 7)],
             '4 processes, interleaved': [(0, 4), (1, 5), (2, 6), (3, 7)]}
  out = {}
  for name, processes in layouts.items():
    streams = [input_pipeline.train_batches(table, batching, seed=5, state=state, blocks=blocks, data_parallel=8)
               for blocks in processes]
    out[name] = []
    for _ in range(steps):
      held = {}
      for blocks, stream in zip(processes, streams):
        batch = next(stream)
        rows = batch['inputs'].shape[0] // len(blocks)
        for i, block in enumerate(blocks):
          held[block] = {k: v[i * rows:(i + 1) * rows] for k, v in batch.items()}
      out[name].append({k: np.concatenate([held[b][k] for b in range(8)]) for k in ('inputs', 'targets')})
  return out, streams[0]


def _wmt_from(sources: list[str], targets: list[str]):
  """A tfds `_as_dataset` serving these pairs as wmt14_translate/de-en's split."""
  def as_dataset(self, split, decoders=None, read_config=None, **kwargs):
    return tf.data.Dataset.from_tensor_slices({'en': sources, 'de': targets})
  return as_dataset


@pytest.mark.parametrize('source', ['files', 'tfds'])
@pytest.mark.parametrize('mode', ['pairs', 'longer_side'])
def test_every_process_layout_reads_its_rows_of_one_global_batch(files_config, tmp_path, source, mode):
  config = files_config
  config.bucket_shapes, config.num_bucket_boundaries, config.max_train_length = mode, 8, 64
  config.tokens_per_batch, config.gradient_accumulation_steps = 1024, 2
  paths, _, _ = write_corpus(str(tmp_path), 900, 3, 'long')
  config.train_source, config.train_target = paths
  mock = tfds.testing.mock_data(as_dataset_fn=_wmt_from(*read_parallel_files(*paths)))
  if source == 'tfds':
    config.dataset = 'wmt14_translate/de-en'
    mock.__enter__()
  try:
    _, path = tokenizer.train_or_load(settings.resolve(config).data, str(tmp_path / source), lambda: parallel_text.python_pairs(settings.resolve(config).data))
    table = _table(config, path)
  finally:
    if source == 'tfds':
      mock.__exit__(None, None, None)
  batching = input_pipeline.train_batching(settings.resolve(config).data, table.histogram(64), table.dropped, 8 * 2)
  layouts, _ = _layouts_batches(table, batching, 60)
  assert len(batching.boundaries) >= 8 and len(batching.used_shapes) >= 8
  reference = layouts.pop('1 process')
  for name, steps in layouts.items():  # the same global batch at every step, whoever reads which rows
    assert all(np.array_equal(a[k], b[k]) for a, b in zip(reference, steps) for k in a), name
  shapes = [(b['inputs'].shape, b['targets'].shape) for b in reference]
  assert len(set(shapes)) >= 6  # the steps move through the buckets
  for batch in reference:  # a multiple of 8 devices x 2 micro-batches, within the budget, real rows
    assert batch['inputs'].shape[0] % 16 == 0
    assert batch['inputs'].size <= config.tokens_per_batch and batch['targets'].size <= config.tokens_per_batch
    assert batch['targets'].any(1).all()
  # The pairs of the split, as the text says them (an independent reading of the files).
  processor = tokenizer.load(path)
  pairs = set(zip(*read_parallel_files(*paths)))
  assert all((tokenizer.decode_ids(processor, s), tokenizer.decode_ids(processor, t)) in pairs
             for s, t in zip(reference[0]['inputs'], reference[0]['targets']))


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


def test_a_saved_state_resumes_the_stream_on_any_layout(files_config, vocab):
  _, path = vocab
  files_config.max_train_length, files_config.tokens_per_batch = 64, 1024
  table = _table(files_config, path)
  batching = input_pipeline.train_batching(settings.resolve(files_config).data, table.histogram(64), table.dropped, 8)
  uninterrupted, _ = _layouts_batches(table, batching, 40)
  stream = input_pipeline.train_batches(table, batching, seed=5, blocks=(0, 1, 2, 3), data_parallel=8)
  for _ in range(30):  # past the first epoch of every shape
    next(stream)
  saved = json.loads(json.dumps(stream.state()))  # as the checkpoint stores it
  assert saved == {'step': 30, 'seed': 5, 'batching': batching.fingerprint(), 'multiple': 8}
  resumed, last = _layouts_batches(table, batching, 10, state=saved)
  expected = uninterrupted['1 process'][30:]
  for name, steps in resumed.items():
    assert all(np.array_equal(a[k], b[k]) for a, b in zip(expected, steps) for k in a), name
  assert sorted(last.hashes) == list(range(31, 41))


def test_a_mesh_of_another_data_parallel_size_keeps_the_global_batch(files_config, vocab):
  _, path = vocab
  table = _table(files_config, path)
  data = settings.resolve(files_config).data
  saved = input_pipeline.initial_state(input_pipeline.train_batching(data, table.histogram(12), table.dropped, 8), 5, 8)
  batching = input_pipeline._resumed_batching(data, table, saved, 4)  # 8 devices -> 4
  assert batching.fingerprint() == saved['batching'] and all(b % 8 == 0 for b in batching.batch_sizes)
  with pytest.raises(parallel_text.DataError, match='hold multiples of 8 rows, which this mesh cannot split into '
                                                    'data-parallel x accumulation = 3 equal parts'):
    input_pipeline._resumed_batching(data, table, saved, 3)
  with pytest.raises(parallel_text.DataError, match='per-process stream of earlier versions'):
    input_pipeline._resumed_batching(data, table, {'step': 3, 'positions': [3], 'shard': [0, 1]}, 8)
  other = settings.resolve(files_config).data.__class__(**{**data.__dict__, 'tokens_per_batch': 512})
  with pytest.raises(parallel_text.DataError, match='belongs to another batching'):
    input_pipeline._resumed_batching(other, table, saved, 8)


def test_a_global_batch_too_small_for_the_devices_is_a_one_line_error(files_config, vocab):
  files_config.tokens_per_batch = 64
  with pytest.raises(bucketing.BatchingError, match='config.tokens_per_batch=64 cannot hold 8 sentences of'):
    one_process_batches(files_config, vocab[1], data_parallel_size=8)
