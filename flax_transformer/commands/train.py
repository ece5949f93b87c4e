"""Train a Transformer: python train.py --config=configs/base.py --workdir=DIR [--config.field=value ...]

Installed as `flax-transformer-train` (the same program).
"""

import os

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')  # TensorFlow's C++ start-up chatter


def define(flag_values, argv) -> None:
  from absl import flags
  from flax_transformer.commands import define_config_flag
  define_config_flag(flag_values, argv)
  flags.DEFINE_string('workdir', None, 'Directory for checkpoints, vocabulary, config and TensorBoard logs.',
                      flag_values=flag_values)


def train(f) -> None:
  from flax_transformer import tensorflow_setup
  tensorflow_setup.import_quietly()  # before anything else imports it
  from flax_transformer import cluster, train_loop
  cluster.together(lambda: train_loop.train_and_evaluate(f.config, f.workdir))  # one error stops every process


def main(argv: list[str]) -> int:
  """The program on `argv`; returns its exit status (flax_transformer.commands)."""
  from flax_transformer import commands
  return commands.run_program(argv, define, train, __doc__, required=('config', 'workdir'), config_flag='config')


def console():
  from flax_transformer import commands
  commands.console(main, hard_exit=True)


if __name__ == '__main__':
  console()
