"""Train a Transformer: python train.py --config=configs/base.py --workdir=DIR [--config.field=value ...]"""

import os
import sys

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')  # TensorFlow's C++ start-up chatter

from absl import app, flags, logging
from ml_collections import config_flags

config_flags.DEFINE_config_file('config', None, 'Run configuration file (configs/*.py).', lock_config=True)
flags.DEFINE_string('workdir', None, 'Directory for checkpoints, vocabulary, config and TensorBoard logs.')
flags.mark_flags_as_required(['config', 'workdir'])


def main(argv):
  if not flags.FLAGS['verbosity'].present:  # Orbax logs every save at INFO; --verbosity=0 shows it
    logging.set_verbosity(logging.WARNING)
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  from flax_transformer import platforms
  platforms.import_tensorflow_quietly()  # before anything else imports it
  from flax_transformer import train_loop
  from flax_transformer.errors import UserError
  try:
    train_loop.train_and_evaluate(flags.FLAGS.config, flags.FLAGS.workdir)
  except train_loop.CheckpointSaveFailed as error:
    print(f'error: {error}', file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(1)  # not sys.exit: the checkpointer's background threads may never finish after a failed write
  except UserError as error:
    print(f'error: {error}', file=sys.stderr)
    sys.exit(1)


if __name__ == '__main__':
  app.run(main)
