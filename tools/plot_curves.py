"""Training curves from a run's TensorBoard event files -> one PNG (train/eval loss, eval perplexity, eval BLEU).

python tools/plot_curves.py --workdir=DIR [--workdir=DIR2 ...] --output=docs/multi30k_tok_curve.png

Reads <workdir>/tensorboard with TensorBoard's EventAccumulator (tf.summary writes scalars as tensors).
The x axis is wall-clock minutes since the run's first logged step, and steps on a second figure row.
"""

import os

from absl import app, flags
import matplotlib

matplotlib.use('Agg')
import matplotlib.pyplot as plt  # noqa: E402
from tensorboard.backend.event_processing import event_accumulator  # noqa: E402
import tensorflow as tf  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_multi_string('workdir', None, 'Run directories (each holds tensorboard/).', required=True)
flags.DEFINE_string('output', None, 'PNG to write.', required=True)
flags.DEFINE_string('title', '', 'Figure title.')


def read_scalars(workdir: str) -> dict[str, list[tuple[float, int, float]]]:
  """{tag: [(wall_time, step, value), ...]} sorted by step."""
  path = os.path.join(workdir, 'tensorboard')
  if not os.path.isdir(path):
    raise SystemExit(f'error: {path} does not exist; pass the --workdir of a training run')
  accumulator = event_accumulator.EventAccumulator(path, size_guidance={event_accumulator.TENSORS: 0})
  accumulator.Reload()
  series = {}
  for tag in accumulator.Tags()['tensors']:
    events = accumulator.Tensors(tag)
    series[tag] = sorted((e.wall_time, e.step, float(tf.make_ndarray(e.tensor_proto))) for e in events)
  return series


def main(argv):
  del argv
  panels = [('loss', ['train/loss', 'eval/loss'], 'label-smoothed loss'), ('ppl', ['eval/perplexity'], 'eval perplexity'),
            ('bleu', ['eval/bleu'], 'eval BLEU (sample)')]
  fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.6))
  for workdir in FLAGS.workdir:
    series = read_scalars(workdir)
    start = min(points[0][0] for points in series.values() if points)
    name = os.path.basename(os.path.normpath(workdir))
    for axis, (_, tags, label) in zip(axes, panels):
      for tag in tags:
        if series.get(tag):
          minutes = [(t - start) / 60 for t, _, _ in series[tag]]
          axis.plot(minutes, [v for _, _, v in series[tag]], marker='.' if tag.startswith('eval') else None,
                    label=f'{name} {tag}')
      axis.set_xlabel('wall-clock minutes')
      axis.set_ylabel(label)
  axes[1].set_yscale('log')
  for axis in axes:
    axis.grid(alpha=0.3)
    axis.legend(fontsize=7)
  if FLAGS.title:
    fig.suptitle(FLAGS.title)
  fig.tight_layout()
  fig.savefig(FLAGS.output, dpi=110)
  print(f'wrote {FLAGS.output}')


if __name__ == '__main__':
  app.run(main)
