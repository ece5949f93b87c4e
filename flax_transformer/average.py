"""§6.1 checkpoint averaging: python -m flax_transformer.average --workdir=DIR --last=K --output=OUT

Averages the parameters of the last K checkpoints of a run into a new Orbax checkpoint (parameters only).
"""

import sys

import jax
from absl import app, flags

from flax_transformer import checkpointing, partitioning
from flax_transformer.errors import UserError, WorkdirError
from flax_transformer.model import TransformerConfig


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


def main(argv):
  del argv
  f = flags.FLAGS
  try:
    config = checkpointing.read_config(f.workdir)
    params, chosen = averaged_params(f.workdir, f.last, TransformerConfig.from_config(config))
    checkpointing.save_params(f.output, chosen[-1], params)
  except UserError as error:
    print(f'error: {error}', file=sys.stderr)
    sys.exit(1)
  print(f'averaged steps {chosen} into {f.output}/{chosen[-1]}')


if __name__ == '__main__':
  flags.DEFINE_string('workdir', None, 'Training workdir.')
  flags.DEFINE_integer('last', 5, 'How many of the latest checkpoints to average.')
  flags.DEFINE_string('output', None, 'Directory for the averaged checkpoint.')
  flags.mark_flags_as_required(['workdir', 'output'])
  app.run(main)
