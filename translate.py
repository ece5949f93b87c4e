"""Translate with a trained model: python translate.py --workdir=DIR --input=FILE|- [--output=FILE] [...]

The program is flax_transformer/commands/translate.py (installed as `flax-transformer-translate`).
"""

from flax_transformer.commands.translate import console

if __name__ == '__main__':
  console()
