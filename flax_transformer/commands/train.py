"""Train a Transformer: python train.py --config=configs/base.py --workdir=DIR [--config.field=value ...]

Installed as `flax-transformer-train` (the same program).
"""

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
  from flax_transformer import tensorflow_setup
  tensorflow_setup.import_quietly()  # before anything else imports it
  import jax
  from flax_transformer import cluster, train_loop
  from flax_transformer.errors import UserError
  from flax_transformer.commands import config_flag
  try:
    train_loop.train_and_evaluate(config_flag(flags.FLAGS), flags.FLAGS.workdir)
  except cluster.ProcessError as error:  # every process raised it: nothing to tell the others
    print(f'error: {error}', file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(1)
  except UserError as error:
    if jax.distributed.is_initialized():  # the others stop too, with this cause (or the peer that died, if one did)
      cluster.stop_all_after_failure(error)
    print(f'error: {error}', file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(1)  # not sys.exit: the checkpointer's background threads may never finish after a failed write
  except Exception as error:
    if jax.distributed.is_initialized():
      cluster.stop_all_after_failure(error)
    raise


def console():
  from flax_transformer.commands import importable_configs
  importable_configs(sys.argv)
  app.run(main)


if __name__ == '__main__':
  console()
