"""§5.1 shared source-target vocabulary: train or load one SentencePiece model; text <-> ids.

Reserved ids, used the same way by the model, the loss and decoding:
  0 <pad> (also the decoder's start symbol), 1 </s> (end of sentence), 2 <unk>. No BOS.
"""

from collections.abc import Iterable
import os
import tempfile
import time

import sentencepiece as spm

from flax_transformer import storage
from flax_transformer.constants import EOS_ID, PAD_ID, UNK_ID
from flax_transformer.errors import UserError

VOCAB_FILENAME = 'sentencepiece.model'
VOCAB_TYPES = ('bpe', 'unigram')  # SentencePiece model types (config.vocab_type)


class VocabularyError(UserError):
  """A vocabulary that cannot be used with this run's configuration."""


def _sentences(pairs: Iterable[tuple[str, str]], errors: list):
  """Both sides of every pair, for SentencePiece to sample from. An error met while reading them (a DataError
  naming the file and line) ends the sentences and is kept in `errors`: SentencePiece would report it as a
  failure of its own."""
  try:
    for source, target in pairs:
      for text in (source, target):
        if text:
          yield text
  except UserError as error:
    errors.append(error)


def train_sentencepiece(pairs: Iterable[tuple[str, str]], path: str, vocab_size: int, model_type: str = 'bpe',
                        sample_sentences: int = 4_000_000) -> str:
  """Trains one model on both languages and writes it atomically to `path`: SentencePiece reads every
  sentence of `pairs` and trains on a uniform sample of `sample_sentences` of them (all, if fewer)."""
  if model_type not in VOCAB_TYPES:
    raise VocabularyError(f"config.vocab_type={model_type!r}: use 'bpe' or 'unigram'")
  storage.path(path).parent.mkdir(parents=True, exist_ok=True)
  with tempfile.TemporaryDirectory() as scratch:
    prefix, errors = os.path.join(scratch, 'spm'), []
    try:
      spm.SentencePieceTrainer.train(
          sentence_iterator=_sentences(pairs, errors), model_prefix=prefix,
          vocab_size=vocab_size, model_type=model_type, character_coverage=1.0,
          pad_id=PAD_ID, eos_id=EOS_ID, unk_id=UNK_ID, bos_id=-1, num_threads=os.cpu_count() or 1,
          shuffle_input_sentence=True, input_sentence_size=sample_sentences, minloglevel=2)
    except RuntimeError as error:
      if errors:  # the data's own error is the cause
        raise errors[0] from None
      first_line = str(error).strip().splitlines()[-1]
      raise VocabularyError(f'cannot train a {vocab_size}-piece vocabulary on this corpus ({first_line}); '
                            f'lower config.model.vocab_size') from None
    if errors:
      raise errors[0]
    with open(prefix + '.model', 'rb') as f:
      storage.write_atomic(path, f.read())
  return path


def load(path: str, expected_vocab_size: int | None = None) -> spm.SentencePieceProcessor:
  """Loads a model and checks it against the model config's vocabulary size."""
  if not storage.path(path).exists():
    raise VocabularyError(f'vocabulary file {path} does not exist; fix config.vocab_path or leave it empty to train one')
  try:
    processor = spm.SentencePieceProcessor(model_proto=storage.path(path).read_bytes())
  except RuntimeError:  # SentencePiece's own message names only its parser
    raise VocabularyError(f'vocabulary file {path} is damaged (not a SentencePiece model); restore it from a copy: '
                          f'a run\'s checkpoints belong to the vocabulary they were trained with') from None
  if expected_vocab_size is not None and processor.get_piece_size() != expected_vocab_size:
    raise VocabularyError(f'vocabulary {path} has {processor.get_piece_size()} pieces but '
                          f'config.model.vocab_size={expected_vocab_size}; set them equal')
  if processor.pad_id() != PAD_ID or processor.eos_id() != EOS_ID:
    raise VocabularyError(f'vocabulary {path} must reserve id 0 for <pad> and 1 for </s> '
                          f'(it has pad={processor.pad_id()}, eos={processor.eos_id()})')
  return processor


def train_or_load(data, workdir: str, pairs_fn) -> tuple[spm.SentencePieceProcessor, str]:
  """`config.vocab_path` if set; else the workdir's model (reused on restart); else a newly trained one.

  `pairs_fn()` yields (source, target) training sentences; it is only called when training.
  Returns (processor, path).
  """
  vocab_size = data.vocab_size
  if data.vocab_path:
    return load(data.vocab_path, vocab_size), data.vocab_path
  path = storage.path(workdir) / VOCAB_FILENAME
  if not path.exists():
    print(f'training a {vocab_size:,}-piece {data.vocab_type} vocabulary on a sample of up to '
          f'{data.vocab_sample_sentences:,} sentences drawn across the training split (once per workdir)...',
          flush=True)
    start = time.perf_counter()
    train_sentencepiece(pairs_fn(), path, vocab_size, data.vocab_type, data.vocab_sample_sentences)
    print(f'vocabulary trained in {time.perf_counter() - start:.0f} s: {path}', flush=True)
  return load(path, vocab_size), os.fspath(path)


def decode_ids(processor: spm.SentencePieceProcessor, ids) -> str:
  """Token ids (stopping at the first </s>, padding ignored) -> text."""
  ids = [int(i) for i in ids]
  if EOS_ID in ids:
    ids = ids[:ids.index(EOS_ID)]
  return processor.decode([i for i in ids if i not in (PAD_ID, EOS_ID)])
