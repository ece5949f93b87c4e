"""A small Transformer on Multi30k EN→DE (raw, cased text): the whole pipeline in under an hour on 2 CPU cores.

Data: ../shared/data/multi30k beside the repository, or any directory holding the six files:
  python tools/get_multi30k.py --dir=data/multi30k
  python train.py --config=configs/multi30k.py:data/multi30k --workdir=runs/m30k
The alternatives tried for each value, with their val/test figures, are in docs/results.md.
"""

import os

from configs import base

MULTI30K_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', '..', 'shared', 'data', 'multi30k')


def get_config(data_dir: str | None = None, suffix: str = '{lang}.gz'):
  data_dir = data_dir or MULTI30K_DIR
  config = base.get_config()
  config.dataset = 'files'
  for split, name in (('train', 'train'), ('eval', 'val'), ('test', 'test_2016_flickr')):
    config[f'{split}_source'] = os.path.join(data_dir, name + '.' + suffix.format(lang='en'))
    config[f'{split}_target'] = os.path.join(data_dir, name + '.' + suffix.format(lang='de'))

  config.model.vocab_size = 6000  # Joint BPE; 29k short sentences want few pieces (4k and 8k scored lower).
  config.model.d_model = 128  # The literature's width for this corpus (~2.6M-parameter models).
  config.model.num_heads = 4
  config.model.d_ff = 512
  config.model.num_encoder_layers = 3  # 4+2 learned slower per step.
  config.model.num_decoder_layers = 3
  config.model.dropout_rate = 0.15  # Best of 0.1 / 0.15 / 0.2 / 0.25 on val.
  config.model.max_len = 256
  config.model.pre_norm = True  # A switch (the paper is Post-LN): at this size Pre-LN learns far faster.
  config.model.scan_unroll = 3  # All layers unrolled: faster steps, longer compiles (worth it for an hour's run).
  config.max_length = 100
  config.eval_max_length = 128
  config.vocab_sample_sentences = 100_000  # The whole corpus (58k sentences).
  config.tokens_per_batch = 2048  # More, smaller steps: progress per step hardly depends on batch size here.
  config.eval_tokens_per_batch = 8192
  config.bucket_shapes = 'longer_side'  # 12 shapes at 90.0% real tokens, against 22 at 91.3% with 'pairs'.
  config.num_bucket_boundaries = 12
  config.warmup_steps = 150
  config.lr_decay = 'constant'  # Warmup-hold-cooldown for a fixed-length run (not in the paper).
  config.learning_rate_factor = 0.5  # The held peak: 0.5 · 128^-0.5 · 150^-0.5 = 3.6e-3.
  config.num_train_steps = 7200  # About an hour on 2 CPU cores (README: Configs).
  config.cooldown_steps = 1800  # The last quarter ramps the rate linearly to 0.
  config.checkpoint_every_steps = 250
  config.keep_checkpoints = 10
  config.eval_every_steps = 500  # Sparse enough that the hour goes to training.
  config.log_every_steps = 50
  config.num_eval_bleu_sentences = 100
  config.average_last = 10  # Better than 5 on val.
  config.beam_size = 4  # The paper's; 5 and 6 were no better on val.
  config.length_penalty_alpha = 1.0  # Chosen on val among 0.6 / 1.0 / 1.4.
  return config
