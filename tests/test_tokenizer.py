"""The SentencePiece vocabulary: trained once per workdir on both languages, reserved ids, size checked."""

import os

import pytest

from flax_transformer import settings, tokenizer


def test_vocabulary_is_trained_once_and_reserves_ids(files_config, vocab, tmp_path):
  processor, path = vocab
  assert processor.get_piece_size() == files_config.model.vocab_size
  assert (processor.pad_id(), processor.eos_id(), processor.unk_id()) == (0, 1, 2)
  mtime = os.path.getmtime(path)
  tokenizer.train_or_load(settings.resolve(files_config).data, str(tmp_path / 'work'), lambda: pytest.fail('must reuse the saved model'))
  assert os.path.getmtime(path) == mtime
  files_config.model.vocab_size = 128
  with pytest.raises(tokenizer.VocabularyError, match='has 64 pieces but config.model.vocab_size=128'):
    tokenizer.train_or_load(settings.resolve(files_config).data, str(tmp_path / 'work'), None)
