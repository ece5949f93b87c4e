"""Token tables: pairs tokenised into memory (too-long pairs dropped and counted), evaluation batches in order."""

import pytest

from flax_transformer import parallel_text, settings, token_table, tokenizer


def test_eval_batches_keep_order_and_every_sentence(files_config, vocab):
  processor, path = vocab
  batches = token_table.eval_batches(settings.resolve(files_config).data, path, data_parallel_size=2)
  rows = [(s, t) for b in batches for s, t in zip(b['inputs'], b['targets']) if t.any()]
  expected = list(parallel_text.python_pairs(settings.resolve(files_config).data, 'eval'))
  assert len(rows) == len(expected) == 37
  assert [(tokenizer.decode_ids(processor, s), tokenizer.decode_ids(processor, t)) for s, t in rows] == expected
  assert len({b['inputs'].shape[0] for b in batches}) == 1 and batches[0]['inputs'].shape[0] % 2 == 0


def test_a_shard_without_data_is_a_one_line_error(files_config, vocab):
  with pytest.raises(parallel_text.DataError) as error:
    token_table.train_table(settings.resolve(files_config).data, vocab[1], (299, 400))  # 300 pairs: shard 299 of 400 is empty
  assert 'shard 299 of 400 holds no sentence pair' in str(error.value) and '\n' not in str(error.value)
