"""A few-thousand-parameter Transformer for tests: every code path, in seconds on a CPU."""

from configs import base


def get_config():
  config = base.get_config()
  config.model.vocab_size = 64
  config.model.d_model = 16
  config.model.num_heads = 2
  config.model.d_ff = 32
  config.model.num_encoder_layers = 2
  config.model.num_decoder_layers = 2
  config.model.max_positions = 128
  config.max_train_length = 32
  config.max_eval_length = 64
  config.vocab_sample_sentences = 10_000
  config.tokens_per_batch = 256
  config.eval_tokens_per_batch = 256
  config.num_bucket_boundaries = 4
  config.warmup_steps = 10
  config.num_train_steps = 20
  config.checkpoint_every_steps = 10
  config.keep_checkpoints = 3
  config.eval_every_steps = 10
  config.log_every_steps = 5
  config.num_eval_bleu_sentences = 8
  config.average_last = 2
  config.max_extra_length = 10
  return config
