"""§6.1 checkpoint averaging: python -m flax_transformer.average --workdir=DIR --output=OUT [--last=K]

Averages the parameters of the last K checkpoints of a run (default: the run's config.average_last) into
OUT, laid out as a workdir that translate.py reads directly (python translate.py --workdir=OUT): its
config.json (with average_last=1), its vocabulary, and checkpoints/<last step>/params. Installed as
`flax-transformer-average`.
"""

import os
import sys

if __name__ == '__main__':  # before anything imports TensorFlow
  from flax_transformer import tensorflow_setup
  tensorflow_setup.import_quietly()

import jax  # noqa: E402
from absl import app, flags, logging  # noqa: E402

from flax_transformer import checkpointing, partitioning, settings, storage, tokenizer, workdirs  # noqa: E402
from flax_transformer.errors import UserError, WorkdirError  # noqa: E402
from flax_transformer.model import TransformerConfig  # noqa: E402


def last_steps(workdir: str, count: int) -> list[int]:
  steps = checkpointing.available_steps(workdir)
  if not steps:
    raise WorkdirError(f'{workdir} holds no checkpoint; train first (python train.py --workdir={workdir} ...)')
  if count < 1 or count > len(steps):
    raise WorkdirError(f'cannot average the last {count} checkpoints: {workdir} keeps {len(steps)} '
                       f'(steps {steps}); use a number from 1 to {len(steps)}')
  return steps[-count:]


def averaged_params(workdir: str, count: int, model_config: TransformerConfig):
  """(mean parameters of the last `count` checkpoints as numpy arrays, the steps averaged)."""
  import flax.linen as nn
  abstract = nn.meta.unbox(partitioning.abstract_params(model_config))
  chosen = last_steps(workdir, count)
  trees = [jax.device_get(checkpointing.restore_params(workdir, step, abstract)) for step in chosen]
  return (trees[0] if len(trees) == 1 else checkpointing.average_params(trees)), chosen


def _check_output(workdir, output) -> None:
  """Refuses an output that would overwrite, hold or sit inside the run being averaged, or that is a file."""
  source, target = os.fspath(storage.path(workdir)).rstrip('/'), os.fspath(output).rstrip('/')
  if target == source or source.startswith(target + '/') or target.startswith(source + '/'):
    where = ('is' if target == source else 'contains' if source.startswith(target + '/') else 'is inside')
    raise WorkdirError(f'--output={output} {where} the workdir {source}; write the average to a folder outside it')
  if output.exists() and not output.is_dir():
    raise WorkdirError(f'--output={output} is a file; give a folder for the averaged workdir')


def write_averaged_workdir(workdir: str, output: str, count: int | None = None, overwrite: bool = False) -> list[int]:
  """Averages the last `count` checkpoints of `workdir` into the workdir `output`; returns the steps averaged.

  The average is written to a folder beside `output` and moved into place when complete; with `overwrite`
  the previous output is removed only then, so a failure leaves it as it was.
  """
  config = workdirs.read_config(workdir)
  count = config.average_last if count is None else count
  output = storage.path(output)
  _check_output(workdir, output)
  if output.is_dir() and any(output.iterdir()) and not overwrite:
    raise WorkdirError(f'{output} is not empty; choose a new --output or pass --overwrite to replace it')
  params, chosen = averaged_params(workdir, count, settings.model_settings(config))
  staging = output.parent / f'.{output.name}.partial.{os.getpid()}'
  if staging.exists():
    staging.rmtree()
  staging.mkdir(parents=True)
  if not config.vocab_path:  # the vocabulary trained into the workdir travels with the model
    (staging / tokenizer.VOCAB_FILENAME).write_bytes((storage.path(workdir) / tokenizer.VOCAB_FILENAME).read_bytes())
  with config.unlocked():
    config.average_last = 1  # the output holds one checkpoint: the average
  checkpointing.save_params(checkpointing.checkpoint_dir(staging), chosen[-1], params)
  workdirs.write_config(staging, config)
  replaced = output.parent / f'.{output.name}.replaced.{os.getpid()}'
  if output.exists():
    storage.move(output, replaced)
  storage.move(staging, output)
  if replaced.exists():
    replaced.rmtree()
  return chosen


def console():
  """`flax-transformer-average` and `python -m flax_transformer.average`."""
  flags.DEFINE_string('workdir', None, 'Training workdir.')
  flags.DEFINE_integer('last', None, 'How many of the latest checkpoints to average (default: config.average_last).')
  flags.DEFINE_string('output', None, 'Directory for the averaged model (a workdir translate.py reads).')
  flags.DEFINE_bool('overwrite', False, 'Replace a non-empty --output (only once the new average is written).')
  flags.mark_flags_as_required(['workdir', 'output'])
  app.run(main)


def main(argv):
  del argv
  f = flags.FLAGS
  if not f['verbosity'].present:  # Orbax logs every read and write at INFO
    logging.set_verbosity(logging.WARNING)
  try:
    chosen = write_averaged_workdir(f.workdir, f.output, f.last, f.overwrite)
  except UserError as error:
    print(f'error: {error}', file=sys.stderr)
    sys.exit(1)
  print(f'averaged steps {chosen} into {storage.path(f.output)}; translate with: '
        f'python translate.py --workdir={f.output}')


if __name__ == '__main__':
  console()
