"""Transformer (big) on WMT14 EN→DE: Table 3 row "big" (28.4 BLEU in the paper).

Expected meshes (config.mesh_shape = (data, fsdp, model)):
  - one host with 8 GPUs or a TPU v3-8: (-1, 1, 1), plain data parallelism (the paper used 8 P100s);
    with 16 GB devices and bf16 off, (1, 8, 1) (FSDP) leaves more room for the 25k-token batch.
  - a pod slice, e.g. TPU v4-64 (32 chips): (4, 8, 1), or (8, 2, 2) to split heads and FFN as well.
"""

from configs import base


def get_config():
  config = base.get_config()
  config.model.d_model = 1024
  config.model.num_heads = 16
  config.model.d_ff = 4096
  config.model.dropout_rate = 0.3  # Table 3 big, EN→DE (the paper used 0.1 for EN→FR).
  config.num_train_steps = 300_000  # §5.2: 300k steps for big.
  config.keep_checkpoints = 20
  config.average_last = 20  # §6.1: the last 20 checkpoints for big models.
  return config
