"""A WMT-scale start, killed and resumed: configs/base.py on 4.5M synthetic WMT-shaped pairs over 8 fake CPU
devices, a few steps, kill -9, then the same command again. Prints each start-up phase's seconds (vocabulary,
token cache, restore, first compile) for both starts, and whether the resumed steps equal the killed run's.

python bench/wmt_rehearsal.py [--pairs=4500000] [--steps_before_kill=4] [--steps=6]

The corpus is bench/input_pipeline.py's (written there if missing, shared with it). What differs from
configs/base.py, because 2 CPU cores must get through the steps, is printed with the table: an 8k vocabulary
trained on 200k sampled sentences (the corpus has 30k words), 2,048 tokens per batch, 4 length buckets, and no
BLEU at evaluation. The phases are read from train.py's own lines as they arrive:
  vocabulary      from the launch (imports included) to 'vocabulary trained' (the first start only)
  token cache     to 'token cache: ... read' (first start: built, then read; second: from the launch, imports
                  and the vocabulary's load included, read and checked)
  to the banner   restore and the global stream's batching
  first step      the first train step: its compilation (the first start, from an empty compilation cache) or
                  its load from the persistent cache (the second), and its run
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

from absl import app, flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench.synthetic import cpu_model, synthetic_corpus  # noqa: E402

flags.DEFINE_integer('pairs', 4_500_000, 'Sentence pairs in the synthetic training split.')
flags.DEFINE_integer('steps_before_kill', 4, 'The first start is killed (SIGKILL) once this step is logged.')
flags.DEFINE_integer('steps', 6, 'The resumed start trains to this step.')
flags.DEFINE_string('corpus_dir', '/tmp/flax_transformer_bench_input', 'Where the synthetic corpus is (or is written).')
flags.DEFINE_string('workdir', '/tmp/flax_transformer_wmt_rehearsal', 'The run directory (removed first).')

PHASES = (('vocabulary', re.compile(r'^vocabulary trained')),
          ('token cache', re.compile(r'^token cache: [\d,]+ pairs read')),
          ('to the banner', re.compile(r'^platform: ')),
          ('first step', re.compile(r'^step \d+/')))
STEP = re.compile(r'^step (\d+)/')


def _corpus(directory: str, pairs: int) -> tuple[str, str]:
  os.makedirs(directory, exist_ok=True)
  return synthetic_corpus(directory, pairs)


def _evaluation_files(paths, directory: str) -> list[str]:
  """The first 64 pairs as a small validation split (evaluation is not what is rehearsed)."""
  import gzip
  out = []
  for path, name in zip(paths, ('valid.en', 'valid.de')):
    with gzip.open(path, 'rt', encoding='utf-8') as f:
      lines = [next(f) for _ in range(64)]
    out.append(os.path.join(directory, name))
    with open(out[-1], 'w', encoding='utf-8') as f:
      f.writelines(lines)
  return out


def command(paths, evaluation, workdir: str, steps: int) -> list[str]:
  return [sys.executable, os.path.join(ROOT, 'train.py'), f'--config={os.path.join(ROOT, "configs", "base.py")}',
          f'--workdir={workdir}', '--config.dataset=files',
          f'--config.train_source={paths[0]}', f'--config.train_target={paths[1]}',
          f'--config.eval_source={evaluation[0]}', f'--config.eval_target={evaluation[1]}',
          '--config.model.vocab_size=8000', '--config.vocab_sample_sentences=200000',
          '--config.tokens_per_batch=2048', '--config.num_bucket_boundaries=4', '--config.num_eval_bleu_sentences=0',
          f'--config.num_train_steps={steps}', '--config.log_every_steps=1', '--config.checkpoint_every_steps=2',
          '--config.eval_every_steps=1000000', '--config.mesh_shape=(-1,1,1)']


def start(argv: list[str], kill_at: int | None) -> dict:
  """Runs one start, timing each phase from its lines; kills it with SIGKILL once step `kill_at` is logged.
  Returns {'phases': {name: seconds}, 'losses': {step: loss}, 'returncode', 'lines'}."""
  env = dict(os.environ, JAX_PLATFORMS='cpu', XLA_FLAGS='--xla_force_host_platform_device_count=8',
             TF_CPP_MIN_LOG_LEVEL='2', PYTHONUNBUFFERED='1',
             JAX_COMPILATION_CACHE_DIR=os.path.join(flags.FLAGS.workdir, 'jax_cache'))  # empty at the first start
  began = time.perf_counter()
  process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
  seen, lines, last = {}, [], began
  for line in process.stdout:
    lines.append(line.rstrip('\n'))
    now = time.perf_counter()
    for name, pattern in PHASES:
      if name not in seen and pattern.search(line):
        seen[name] = now - last
        last = now
    step = STEP.match(line)
    if kill_at is not None and step and int(step.group(1)) >= kill_at:
      process.send_signal(signal.SIGKILL)
      break
  process.wait()
  return {'phases': seen, 'returncode': process.returncode, 'lines': lines, 'seconds': time.perf_counter() - began}


def _losses(workdir: str) -> dict[int, float]:
  from tools import compare_runs
  return compare_runs.read_run(workdir)[0]


def main(argv):
  del argv
  f = flags.FLAGS
  paths = _corpus(f.corpus_dir, f.pairs)
  shutil.rmtree(f.workdir, ignore_errors=True)
  os.makedirs(f.workdir)
  evaluation = _evaluation_files(paths, f.workdir)
  workdir = os.path.join(f.workdir, 'run')
  first = start(command(paths, evaluation, workdir, f.steps), kill_at=f.steps_before_kill)
  killed_losses = _losses(workdir)
  second = start(command(paths, evaluation, workdir, f.steps), kill_at=None)
  resumed = next((l for l in second['lines'] if l.startswith('resumed from step')), 'not resumed')
  if second['returncode'] != 0:
    print('\n'.join(second['lines'][-20:]))
    raise SystemExit(f'error: the resumed start exited {second["returncode"]}')
  losses = _losses(workdir)
  start_step = int(re.search(r'resumed from step (\d+)', resumed).group(1)) if 'resumed' in resumed else 0
  replayed = [s for s in sorted(killed_losses) if s > start_step]
  equal = [s for s in replayed if s in losses and losses[s] == killed_losses[s]]
  print(f'CPU: {cpu_model()}, {len(os.sched_getaffinity(0))} cores; {f.pairs:,} synthetic WMT-shaped pairs; '
        f'configs/base.py (65M parameters) on 8 fake CPU devices, with an 8k vocabulary sampled from 200k '
        f'sentences, 2,048 tokens per batch, 4 length buckets')
  print('| phase | first start (killed with SIGKILL after step '
        f'{f.steps_before_kill}), s | second start ({resumed}), s |')
  print('|---|---|---|')
  for name, _ in PHASES:
    cells = [f'{run["phases"][name]:.1f}' if name in run['phases'] else '-' for run in (first, second)]
    print(f'| {name} | {cells[0]} | {cells[1]} |')
  print(f'| whole start to its first step | {sum(first["phases"].values()):.1f} | '
        f'{sum(second["phases"].values()):.1f} |')
  print(f'steps {replayed} trained again after the resume: {len(equal)} of {len(replayed)} losses bitwise equal '
        f'to the killed run\'s')
  print(json.dumps({'first': first['phases'], 'second': second['phases'], 'resumed': resumed,
                    'replayed': replayed, 'equal': equal}))


if __name__ == '__main__':
  app.run(main)
