"""Train a Transformer: python train.py --config=configs/base.py --workdir=DIR [--config.field=value ...]

The program is flax_transformer/commands/train.py (installed as `flax-transformer-train`).
"""

from flax_transformer.commands.train import console

if __name__ == '__main__':
  console()
