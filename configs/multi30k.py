"""A small Transformer on Multi30k EN→DE (raw, cased text): the whole pipeline on a laptop CPU.

Data: ../shared/data/multi30k beside the repository (override any path with --config.train_source=...).
"""

import os

from configs import base

MULTI30K_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', '..', 'shared', 'data', 'multi30k')


def get_config(data_dir: str = MULTI30K_DIR, suffix: str = '{lang}.gz'):
  config = base.get_config()
  config.dataset = 'files'
  for split, name in (('train', 'train'), ('eval', 'val'), ('test', 'test_2016_flickr')):
    config[f'{split}_source'] = os.path.join(data_dir, name + '.' + suffix.format(lang='en'))
    config[f'{split}_target'] = os.path.join(data_dir, name + '.' + suffix.format(lang='de'))

  # Sized for 29k short sentences and 2 CPU cores (the literature uses ~2.6M-parameter, width-128 models).
  config.model.vocab_size = 8000  # Joint BPE; 29k pairs do not support 37k pieces.
  config.model.d_model = 128
  config.model.num_heads = 4
  config.model.d_ff = 512
  config.model.num_encoder_layers = 3
  config.model.num_decoder_layers = 3
  config.model.dropout_rate = 0.3  # Small data overfits quickly.
  config.model.max_len = 256
  config.max_length = 100
  config.eval_max_length = 128
  config.max_corpus_chars = 20_000_000  # The whole corpus.
  config.tokens_per_batch = 4096
  config.eval_tokens_per_batch = 8192
  config.num_bucket_boundaries = 8  # 3 shapes each: at most 24 compilations.
  config.shuffle_buffer_size = 30_000

  config.warmup_steps = 1000
  config.learning_rate_factor = 2.0  # Small models tolerate (and need) a larger step than d^-0.5.
  config.num_train_steps = 6000
  config.checkpoint_every_steps = 250
  config.keep_checkpoints = 10
  config.eval_every_steps = 500
  config.log_every_steps = 50
  config.num_eval_bleu_sentences = 100
  config.average_last = 5
  config.beam_size = 4
  return config
