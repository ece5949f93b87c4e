"""Token tables: pairs tokenised into memory (too-long pairs dropped and counted), evaluation batches in order."""

from flax_transformer import parallel_text, settings, token_table, tokenizer


def test_eval_batches_keep_order_and_every_sentence(files_config, vocab):
  processor, path = vocab
  batches = token_table.eval_batches(settings.resolve(files_config).data, path, data_parallel_size=2)
  rows = [(s, t) for b in batches for s, t in zip(b['inputs'], b['targets']) if t.any()]
  expected = list(parallel_text.python_pairs(settings.resolve(files_config).data, 'eval'))
  assert len(rows) == len(expected) == 37
  assert [(tokenizer.decode_ids(processor, s), tokenizer.decode_ids(processor, t)) for s, t in rows] == expected
  assert len({b['inputs'].shape[0] for b in batches}) == 1 and batches[0]['inputs'].shape[0] % 2 == 0

