"""Do two training runs agree? Compares the per-step losses and evaluations that each run logged.

python tools/compare_runs.py --workdir=DIR_A --workdir=DIR_B

Reads <workdir>/train_metrics.jsonl (every step's loss, exactly, its global batch's hash, and every
evaluation), compares the steps both runs logged, and prints how many match bitwise, the first that differs,
whether the batches held the same rows, and the last evaluation of each. Exit status 0 when every common step
and evaluation is identical, 1 otherwise.
"""

import json
import os
import sys

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from flax_transformer import storage  # noqa: E402
from flax_transformer.metrics_log import METRICS_FILENAME  # noqa: E402

FLAGS = flags.FLAGS


def read_run(workdir: str) -> tuple[dict[int, float], dict[int, dict], dict[int, str]]:
  """({step: loss}, {step: evaluation record}, {step: the hash of its global batch's rows}) from a run's
  metrics file, read once (a resumed run's last record wins)."""
  path = storage.path(workdir) / METRICS_FILENAME
  if not path.exists():
    raise SystemExit(f'error: {path} does not exist; pass the --workdir of a training run')
  losses, evaluations, batches = {}, {}, {}
  for line in path.read_text().splitlines():
    record = json.loads(line)
    if record['split'] == 'train_steps':
      for name, into in (('losses', losses), ('batches', batches)):
        values = record.get(name) or []
        into.update(zip(range(record['step'] - len(values) + 1, record['step'] + 1), values))
    elif record['split'] == 'eval':
      evaluations[record['step']] = {k: v for k, v in record.items() if k not in ('step', 'split')}
  return losses, evaluations, batches


def compare(workdir_a: str, workdir_b: str) -> dict:
  """Steps and evaluations both runs logged, and those that differ (bitwise; an evaluation on the metrics
  both logged, so a run without sample BLEU still compares on loss and perplexity)."""
  (losses_a, evals_a, batches_a), (losses_b, evals_b, batches_b) = read_run(workdir_a), read_run(workdir_b)
  steps = sorted(set(losses_a) & set(losses_b))
  eval_steps = sorted(set(evals_a) & set(evals_b))
  return {'steps': len(steps), 'last_step': steps[-1] if steps else None,
          'differing_steps': [s for s in steps if losses_a[s] != losses_b[s]],
          'differing_batches': [s for s in sorted(set(batches_a) & set(batches_b)) if batches_a[s] != batches_b[s]],
          'largest_loss_difference': max((abs(losses_a[s] - losses_b[s]) for s in steps), default=0.0),
          'evaluations': len(eval_steps),
          'differing_evaluations': [s for s in eval_steps if any(evals_a[s][k] != evals_b[s][k]
                                                                 for k in evals_a[s].keys() & evals_b[s].keys())],
          'last_evaluation': [evals_a[eval_steps[-1]], evals_b[eval_steps[-1]]] if eval_steps else None}


def main(argv):
  del argv
  if len(FLAGS.workdir) != 2:
    raise SystemExit(f'error: got {len(FLAGS.workdir)} --workdir flags; pass exactly two runs to compare')
  result = compare(*FLAGS.workdir)
  differing = result['differing_steps']
  print(f"{result['steps']} common steps (up to {result['last_step']}): "
        f"{result['steps'] - len(differing)} identical" + (f', first difference at step {differing[0]}' if differing else ''))
  print(f"{len(result['differing_batches'])} steps with other batch rows; largest loss difference "
        f"{result['largest_loss_difference']:.3g}")
  print(f"{result['evaluations']} common evaluations: {len(result['differing_evaluations'])} differ"
        + (f" (steps {result['differing_evaluations'][:5]})" if result['differing_evaluations'] else ''))
  if result['last_evaluation']:
    for workdir, evaluation in zip(FLAGS.workdir, result['last_evaluation']):
      print(f'  {workdir}: ' + ', '.join(f'{k} {v!r}' for k, v in evaluation.items()))
  sys.exit(1 if differing or result['differing_evaluations'] or result['differing_batches'] else 0)


if __name__ == '__main__':  # the flag is the program's: importing this module (tests, benchmarks) defines none
  flags.DEFINE_multi_string('workdir', None, 'The two run directories.', required=True)
  app.run(main)
