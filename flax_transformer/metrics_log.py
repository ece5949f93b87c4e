"""The run's metrics: TensorBoard scalars, train_metrics.jsonl (every step's loss, exactly) and the console,
written by process 0, each write within the storage timeout."""

import json

import tensorflow as tf

from flax_transformer import storage

METRICS_FILENAME = 'train_metrics.jsonl'


class MetricsLog:
  """TensorBoard scalars, the JSONL of metrics and every step's loss, and the console (process 0 only); each
  write within the storage timeout."""

  def __init__(self, workdir, is_chief: bool, timeout: float):
    self.is_chief, self.writer, self.file, self.timeout = is_chief, None, None, timeout
    self.where = storage.path(workdir)
    if is_chief:
      self.tensorboard = storage.MirroredDirectory(self.where / 'tensorboard')
      self.writer = tf.summary.create_file_writer(self.tensorboard.local)
      self.file = storage.AppendedFile(self.where / METRICS_FILENAME)

  def scalars(self, step: int, scalars: dict, prefix: str) -> None:
    if not self.is_chief:
      return

    def write():
      with self.writer.as_default(step=step):
        for name, value in scalars.items():
          tf.summary.scalar(f'{prefix}/{name}', value)
      self.writer.flush()
      self.tensorboard.sync()
      self.file.write(json.dumps({'step': step, 'split': prefix, **scalars}) + '\n')
      self.file.flush()
    storage.within(self.timeout, f'writing the metrics of step {step} to {self.where}', write)

  def step_losses(self, step: int, losses, batches: list[str]) -> None:
    """Every step's loss, exactly (json floats round-trip), and its global batch's hash (input_pipeline.batch_hash),
    for resume checks and plots: the steps up to `step`."""
    if self.is_chief:
      self.file.write(json.dumps({'step': step, 'split': 'train_steps', 'losses': [float(x) for x in losses],
                                  'batches': batches}) + '\n')

  def say(self, text: str) -> None:
    if self.is_chief:
      print(text, flush=True)

  def close(self) -> None:
    if self.file:
      self.writer.close()
      self.tensorboard.sync()
      self.file.close()


def read_evaluations(workdir, split: str = 'eval', until: int | None = None) -> dict[int, dict]:
  """{step: metrics} of the evaluations logged under `split` in a run's metrics file (the last record of a step
  wins: a resumed run may evaluate a step again), up to step `until`; {} where there is no file."""
  path, found = storage.path(workdir) / METRICS_FILENAME, {}
  if not path.exists():
    return found
  for line in storage.whole_lines(path.read_text()).splitlines():  # not a last line cut short
    record = json.loads(line)
    if record.get('split') == split and (until is None or record['step'] <= until):
      found[record['step']] = {k: v for k, v in record.items() if k not in ('step', 'split')}
  return found
