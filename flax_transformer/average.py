"""§6.1 checkpoint averaging: the mean parameters of a run's last K checkpoints, and the averaged workdir.

`averaged_params` is what translation, export and the averaged workdir read: the last K checkpoints that can be
read (a damaged one is passed over with a line on stderr, and left as it is). `write_averaged_workdir` lays the
average out as a workdir translate.py reads directly: its config.json (with average_last=1), its vocabulary,
and checkpoints/<last step>/params. The program: python -m flax_transformer.average (commands/average.py).
"""

if __name__ == '__main__':  # python -m flax_transformer.average: the program, before anything imports TensorFlow
  from flax_transformer.commands.average import console
  console()

import sys  # noqa: E402

import jax  # noqa: E402

from flax_transformer import checkpointing, partitioning, storage, tokenizer, workdirs  # noqa: E402
from flax_transformer.errors import WorkdirError  # noqa: E402
from flax_transformer.model import TransformerConfig  # noqa: E402


def last_steps(steps: list[int], count: int, where: str) -> list[int]:
  """The last `count` of the checkpoint `steps` of `where` (a one-line error if there are not that many)."""
  if not steps:
    raise WorkdirError(f'{where} holds no checkpoint; point it at a run train.py has saved checkpoints in, or '
                       f'train first')
  if count < 1 or count > len(steps):
    raise WorkdirError(f'cannot average the last {count} checkpoints: {where} keeps {len(steps)} '
                       f'(steps {steps}); use a number from 1 to {len(steps)}')
  return steps[-count:]


def averaged_params(directory: str, count: int, model_config: TransformerConfig, where: str | None = None):
  """(mean parameters of the last `count` readable checkpoints of `directory` (a workdir or a checkpoints/
  folder) as numpy arrays, the steps averaged). A damaged checkpoint is passed over, with a line on stderr,
  for the one before it; `where` names `directory` in messages (default: itself)."""
  import flax.linen as nn
  where = where or directory
  abstract = nn.meta.unbox(partitioning.abstract_params(model_config))
  steps, trees = checkpointing.available_steps(directory), {}
  while True:
    chosen = last_steps(steps, count, where)
    for step in chosen:
      if step in trees:
        continue
      try:
        trees[step] = checkpointing.readable_params(directory, step, abstract, where)
      except checkpointing.CheckpointUnreadable as error:
        print(f'warning: {error}; it is left as it is and passed over for the one before', file=sys.stderr,
              flush=True)
        steps.remove(step)
        break
    else:
      params = [jax.device_get(trees[step]) for step in chosen]
      return (params[0] if len(params) == 1 else checkpointing.average_params(params)), chosen


def write_averaged_workdir(workdir: str, output: str, count: int | None = None, overwrite: bool = False) -> list[int]:
  """Averages the last `count` checkpoints of `workdir` into the workdir `output`; returns the steps averaged.

  `output` may not be, hold or sit inside `workdir`; the average is written beside it and swapped in when
  complete (storage.staged_directory), so a failure leaves `output` as it was.
  """
  storage.check_output(f'--output={output}', output, {'the workdir': workdir})
  run = workdirs.read_settings(workdir)
  count = run.loop.average_last if count is None else count
  storage.check_replaceable('--output', output, overwrite)
  params, chosen = averaged_params(workdir, count, run.model)
  with storage.staged_directory(output) as staging:
    if not run.data.vocab_path:  # the vocabulary trained into the workdir travels with the model
      (staging / tokenizer.VOCAB_FILENAME).write_bytes((storage.path(workdir) / tokenizer.VOCAB_FILENAME).read_bytes())
    checkpointing.save_params(checkpointing.checkpoint_dir(staging), chosen[-1], params, averaged_steps=chosen)
    workdirs.copy_config(workdir, staging, average_last=1)  # the output holds one checkpoint: the average
  return chosen

