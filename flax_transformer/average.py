"""§6.1 checkpoint averaging into a workdir: the mean parameters of a run's last K checkpoints (or its K best by
validation metric, or their moving averages), laid out as a workdir translate.py reads directly: its
config.json (with average_last=1), its vocabulary, and checkpoints/<last step>/params. The checkpoints are
chosen and read by `weights.chosen_params`. The program: python -m flax_transformer average
(commands/average.py).
"""

from flax_transformer import checkpointing, storage, tokenizer, weights, workdirs


def write_averaged_workdir(workdir: str, output: str, count: int | None = None, overwrite: bool = False,
                           best: int | None = None, weights_name: str = 'params') -> list[int]:
  """Averages the last `count` checkpoints of `workdir` (or, with `best`, its `best` best by the run's
  config.best_metric; `weights_name` 'ema': their moving averages) into the workdir `output`; returns the steps
  averaged.

  `output` may not be, hold or sit inside `workdir`; the average is written beside it and swapped in when
  complete (storage.staged_directory), so a failure leaves `output` as it was.
  """
  storage.check_output(f'--output={output}', output, {'the workdir': workdir})
  run = workdirs.read_settings(workdir)
  count = best if best is not None else run.training.average_last if count is None else count
  storage.check_replaceable('--output', output, overwrite)
  params, chosen = weights.chosen_params(workdir, run.model, count, best=best is not None,
                                         metric=run.training.best_metric, weights=weights_name)
  with storage.staged_directory(output) as staging:
    if not run.data.vocab_path:  # the vocabulary trained into the workdir travels with the model
      (staging / tokenizer.VOCAB_FILENAME).write_bytes((storage.path(workdir) / tokenizer.VOCAB_FILENAME).read_bytes())
    weights.save_params(checkpointing.checkpoints_folder(staging), chosen[-1], params, averaged_steps=chosen)
    workdirs.copy_config(workdir, staging, average_last=1)  # the output holds one checkpoint: the average
  return chosen


if __name__ == '__main__':  # the program is python -m flax_transformer average
  from flax_transformer.__main__ import moved
  moved('average', 'average')
