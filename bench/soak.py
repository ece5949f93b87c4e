"""A fault soak: a small run trained through kill -9, SIGTERM, storage that stops answering, a disk that fills,
and the loss of one process of a two-process run, restarted after each fault as an operator would; at the end
every logged loss is compared with an uninterrupted run's, bit for bit.

    python bench/soak.py [--faults=30] [--seed=0] [--steps=600] [--work=DIR]

Four runs, each beside an uninterrupted reference of the same config:
  local     a local workdir, one process: kill -9 and SIGTERM of the run
  gs        a gs:// workdir on the local GCS emulator (tests/helpers/gcs_emulator.py), one process: the storage
            server frozen (SIGSTOP) for a while, then thawed; kill -9
  disk      a workdir on its own small tmpfs (needs root to mount; left out otherwise): the disk filled to the
            last byte, then freed
  pod       a local workdir, two processes of one run: kill -9 or SIGTERM of one of them
A fault comes at a time drawn from --seed once the run is past where the previous fault left it. After a fault
the operator waits for every process of the run to end (the others of a pod must stop by themselves), undoes
the fault (thaws the storage, frees the disk) and starts the same command again. The table counts the faults
by kind, the restarts, the seconds each fault cost (from the fault until the restarted run is past the step it
had reached), the steps whose logged loss equals the reference's, the ends that printed a traceback or more than
one error line, and the partial files left in the workdir at the end.
"""

import argparse
import collections
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.synthetic import cpu_model  # noqa: E402
from tests.helpers import gcs_emulator  # noqa: E402

MULTI30K = os.path.join(os.path.dirname(ROOT), 'shared', 'data', 'multi30k')
STEP_LINE = re.compile(r'^step (\d+)/')
PARTIAL = re.compile(r'\.partial\.|\.tmp\.|orbax-checkpoint-tmp|\.part\.|\.write_test|\.replaced\.|^run\.lock$')
# config.storage_timeout_seconds: on gs://, short, so that a frozen storage server stops the run soon (yet
# above what a save on the emulator takes on a loaded machine); elsewhere the default, as a two-process save
# waits for the slower process too
STORAGE_TIMEOUT = {'gs': 30}
KINDS = {  # scenario: the faults it draws from
    'local': ('kill -9', 'SIGTERM'),
    'gs': ('storage frozen', 'storage frozen', 'kill -9'),
    'disk': ('disk full',),
    'pod': ('kill -9 of one process', 'SIGTERM of one process'),
}
SHARE = {'local': 0.3, 'gs': 0.3, 'disk': 0.15, 'pod': 0.25}  # of --faults


def run_command(workdir, steps: int, data: str, processes: int = 1, process_id: int = 0, port: int = 0,
                vocabulary: str = '', storage_timeout: int = 300) -> list:
  """train.py on configs/tiny.py (with a 1,000-piece vocabulary) over `data` (a Multi30k folder): a checkpoint every
  10 steps, a loss line every step, a validation loss at the end; one CPU device per process."""
  command = [sys.executable, os.path.join(ROOT, 'train.py'), f'--config={ROOT}/configs/tiny.py', f'--workdir={workdir}',
             '--config.dataset=files', f'--config.train_source={data}/train.en.gz',
             f'--config.train_target={data}/train.de.gz', f'--config.eval_source={data}/val.en.gz',
             f'--config.eval_target={data}/val.de.gz', f'--config.num_train_steps={steps}',
             '--config.checkpoint_every_steps=10', '--config.log_every_steps=1', f'--config.eval_every_steps={steps}',
             f'--config.storage_timeout_seconds={storage_timeout}', f'--config.mesh_shape=({processes},1,1)',
             '--config.model.vocab_size=1000',  # Multi30k's characters need more than tiny's 64 pieces
             '--config.num_bucket_boundaries=1',  # one batch shape: a restart compiles (or loads) one program
             '--config.num_eval_bleu_sentences=0']  # the last step's evaluation: its loss, no search to compile
  if vocabulary:  # the reference's: SentencePiece's multi-threaded training need not give the same pieces twice
    command.append(f'--config.vocab_path={vocabulary}')
  if processes > 1:
    command += [f'--config.num_processes={processes}', f'--config.process_id={process_id}',
                f'--config.coordinator_address=127.0.0.1:{port}', '--config.initialization_timeout_seconds=60']
  return command


class Start:
  """One start of the run: its processes, each one's output read as it comes (the step each has reached and
  when each step was first seen)."""

  def __init__(self, workdir, steps: int, data: str, processes: int, env: dict, vocabulary: str = '',
               storage_timeout: int = 300):
    port = gcs_emulator.free_port()
    env = dict(env, XLA_FLAGS='--xla_force_host_platform_device_count=1', PYTHONUNBUFFERED='1')
    self.processes = [subprocess.Popen(run_command(workdir, steps, data, processes, i, port, vocabulary,
                                                   storage_timeout), env=env,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                      for i in range(processes)]
    self.step, self.seen, self.stderr, self.hung = 0, {}, ['' for _ in self.processes], False
    self.readers = [threading.Thread(target=self._read, args=(i,), daemon=True) for i in range(processes)]
    self.readers += [threading.Thread(target=self._errors, args=(i,), daemon=True) for i in range(processes)]
    for reader in self.readers:
      reader.start()

  def _read(self, i: int) -> None:
    for line in self.processes[i].stdout:
      found = STEP_LINE.match(line)
      if found and i == 0:
        self.step = int(found.group(1))
        self.seen.setdefault(self.step, time.monotonic())

  def _errors(self, i: int) -> None:
    self.stderr[i] = self.processes[i].stderr.read()

  def running(self) -> bool:
    return any(p.poll() is None for p in self.processes)

  def wait(self, timeout: float = 300) -> list[int]:
    deadline = time.monotonic() + timeout
    for process in self.processes:
      try:
        process.wait(max(deadline - time.monotonic(), 1))
      except subprocess.TimeoutExpired:  # a hang: the soak's worst finding
        self.hung = True
        process.kill()
        process.wait()
    for reader in self.readers:
      reader.join(10)
    return [p.returncode for p in self.processes]

  def until_past(self, step: int, timeout: float = 300) -> float | None:
    """When the run first printed a step after `step` (None: it ended or `timeout` passed first)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
      later = [t for s, t in self.seen.items() if s > step]
      if later:
        return min(later)
      if not self.running():
        return None
      time.sleep(0.05)
    return None

  def badly_ended(self) -> list[str]:
    """The stderr of each process that holds a traceback (Python's, or a C++ check failure's), or more than one
    error line."""
    return [e[-3000:] for e in self.stderr if 'Traceback' in e or 'Check failure' in e or
            sum(line.startswith('error: ') for line in e.splitlines()) > 1]


def logged_losses(workdir, env: dict) -> dict[int, float]:
  """{step: loss} from the run's train_metrics.jsonl (the last record of a step wins: a resumed run logs the
  steps after its checkpoint again)."""
  if str(workdir).startswith('gs://'):
    os.environ.update(env)
    from flax_transformer import storage
    text = storage.path(f'{workdir}/train_metrics.jsonl').read_text()
  else:
    with open(os.path.join(workdir, 'train_metrics.jsonl')) as f:
      text = f.read()
  losses = {}
  for line in text.splitlines():
    record = json.loads(line)
    if record.get('split') == 'train_steps':
      for i, loss in enumerate(record['losses']):
        losses[record['step'] - len(record['losses']) + 1 + i] = loss
  return losses


def left_behind(workdir, env: dict) -> list[str]:
  """Partial or temporary files in the workdir once the run has ended, and checkpoints that lack an item the
  newest one has (a deletion of an old checkpoint cut short)."""
  if str(workdir).startswith('gs://'):
    os.environ.update(env)
    import fsspec
    filesystem = fsspec.core.url_to_fs(str(workdir))[0]
    names = [n.split('/', 1)[1] for n in filesystem.find(str(workdir))]  # bucket/run/... -> run/...
    names = [os.path.relpath(n, str(workdir).split('/', 3)[3]) for n in names]
  else:
    names = [os.path.relpath(os.path.join(d, n), workdir) for d, folders, files in os.walk(workdir)
             for n in files + folders]
  partial = [n for n in names if any(PARTIAL.search(part) for part in n.split('/'))]
  items = collections.defaultdict(set)  # step -> its items
  for name in names:
    parts = name.split('/')
    if len(parts) >= 3 and parts[0] == 'checkpoints' and parts[1].isdigit():
      items[int(parts[1])].add(parts[2])
  newest = items[max(items)] if items else set()
  return partial + [f'checkpoints/{step} (no {", ".join(sorted(newest - found))})' for step, found in items.items()
                    if newest - found]


class Scenario:
  """One run trained through its faults, and what they cost."""

  def __init__(self, name: str, faults: int, args, rng: random.Random, work: str):
    self.name, self.faults, self.args, self.rng = name, faults, args, rng
    self.processes = 2 if name == 'pod' else 1
    self.env, self.emulator, self.mount, self.filler = dict(os.environ), None, None, None
    folder = os.path.join(work, name)
    os.makedirs(folder, exist_ok=True)
    if name == 'gs':
      self.emulator, variables = gcs_emulator.start(os.path.join(folder, 'gcs'))
      self.env.update(variables)
      self.workdir = 'gs://bucket/run'
    elif name == 'disk':
      self.mount = os.path.join(folder, 'disk')
      os.makedirs(self.mount, exist_ok=True)
      subprocess.run(['mount', '-t', 'tmpfs', '-o', 'size=48m', 'tmpfs', self.mount], check=True, capture_output=True)
      self.workdir, self.filler = os.path.join(self.mount, 'run'), os.path.join(self.mount, 'filler')
    else:
      self.workdir = os.path.join(folder, 'run')
    self.reference = os.path.join(folder, 'reference')
    self.injected, self.lost, self.restarts, self.bad_ends, self.hangs = collections.Counter(), [], 0, [], 0

  def start(self) -> Start:
    return Start(self.workdir, self.args.steps, self.args.data, self.processes, self.env,
                 os.path.join(self.reference, 'sentencepiece.model'), STORAGE_TIMEOUT.get(self.name, 300))

  def inject(self, kind: str, start: Start) -> None:
    victim = start.processes[self.rng.randrange(len(start.processes))]
    if kind.startswith('kill -9'):
      victim.kill()
    elif kind.startswith('SIGTERM'):
      victim.send_signal(signal.SIGTERM)
    elif kind == 'storage frozen':
      self.emulator.send_signal(signal.SIGSTOP)
    elif kind == 'disk full':
      descriptor = os.open(self.filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
      try:
        while True:
          os.write(descriptor, b'\0' * (1 << 16))
      except OSError:  # ENOSPC: the disk is full to the last block
        pass
      finally:
        os.close(descriptor)

  def undo(self, kind: str) -> None:
    if kind == 'storage frozen':
      time.sleep(self.rng.uniform(0, 3))  # the storage stays away a while after the run has stopped
      self.emulator.send_signal(signal.SIGCONT)
    elif kind == 'disk full':
      os.remove(self.filler)

  def soak(self) -> dict:
    reference = Start(self.reference, self.args.steps, self.args.data, self.processes, dict(os.environ))
    reference.wait(1800)
    start, left = self.start(), self.faults
    while left:
      if start.until_past(0) is None:  # ended before its first step: finished, or a start that fails by itself
        start.wait()
        if start.processes[0].returncode == 0:
          break  # finished: the faults left were not needed
        raise SystemExit(f'{self.name}: the run fails without a fault: {start.stderr[0].strip()[-2000:]}')
      time.sleep(self.rng.uniform(0.2, 2.0))
      if not start.running():  # it ended before the fault came: finished (the faults left are not needed), or not
        start.wait()
        if start.processes[0].returncode == 0:
          break
        raise SystemExit(f'{self.name}: the run fails without a fault: {start.stderr[0].strip()[-2000:]}')
      kind, reached, at = self.rng.choice(KINDS[self.name]), start.step, time.monotonic()
      self.inject(kind, start)
      start.wait(120)
      self.hangs += start.hung
      self.bad_ends += start.badly_ended()
      self.undo(kind)
      self.injected[kind] += 1
      left -= 1
      start, self.restarts = self.start(), self.restarts + 1
      back = start.until_past(reached)
      if back is not None:
        self.lost.append(back - at)
    statuses = start.wait(1800)
    self.hangs += start.hung
    self.bad_ends += start.badly_ended()
    expected, found = logged_losses(self.reference, {}), logged_losses(self.workdir, self.env)
    equal = sum(found.get(step) == loss for step, loss in expected.items())
    finished = statuses == [0] * self.processes and max(found, default=0) == self.args.steps
    return {'scenario': self.name, 'faults': dict(self.injected), 'restarts': self.restarts,
            'seconds_lost': self.lost, 'steps_equal': equal, 'steps': len(expected), 'finished': finished,
            'bad_ends': len(self.bad_ends), 'bad_end_stderr': self.bad_ends, 'hangs': self.hangs,
            'left_behind': left_behind(self.workdir, self.env),
            **({} if finished else {'last_statuses': statuses, 'last_stderr': [e[-1500:] for e in start.stderr]})}

  def close(self) -> None:
    if self.emulator is not None:
      self.emulator.send_signal(signal.SIGCONT)
      self.emulator.kill()
    if self.mount:
      subprocess.run(['umount', self.mount], capture_output=True)


def can_mount(work: str) -> bool:
  probe = tempfile.mkdtemp(dir=work)
  mounted = subprocess.run(['mount', '-t', 'tmpfs', '-o', 'size=1m', 'tmpfs', probe], capture_output=True).returncode == 0
  if mounted:
    subprocess.run(['umount', probe], capture_output=True)
  os.rmdir(probe)
  return mounted


def table(results: list[dict]) -> str:
  lines = ['| run | faults injected | restarts | seconds lost per fault (median, max) | steps equal / total | '
           'finished | ends with a traceback or several errors | hangs | files left behind |',
           '|---|---|---|---|---|---|---|---|---|']
  for r in results:
    faults = ', '.join(f'{kind} {n}' for kind, n in sorted(r['faults'].items()))
    lost = f'{statistics.median(r["seconds_lost"]):.1f}, {max(r["seconds_lost"]):.1f}' if r['seconds_lost'] else '-'
    lines.append(f'| {r["scenario"]} | {faults} | {r["restarts"]} | {lost} | {r["steps_equal"]} / {r["steps"]} | '
                 f'{"yes" if r["finished"] else "NO"} | {r["bad_ends"]} | {r["hangs"]} | {len(r["left_behind"])} |')
  total = collections.Counter()
  for r in results:
    total.update(r['faults'])
  lines.append(f'| all | {sum(total.values())}: ' + ', '.join(f'{k} {n}' for k, n in sorted(total.items())) +
               f' | {sum(r["restarts"] for r in results)} | | {sum(r["steps_equal"] for r in results)} / '
               f'{sum(r["steps"] for r in results)} | | {sum(r["bad_ends"] for r in results)} | '
               f'{sum(r["hangs"] for r in results)} | {sum(len(r["left_behind"]) for r in results)} |')
  return '\n'.join(lines)


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--faults', type=int, default=30, help='faults in all, shared among the runs')
  parser.add_argument('--seed', type=int, default=0, help='draws the faults, their times and their victims')
  parser.add_argument('--steps', type=int, default=600, help='training steps of each run')
  parser.add_argument('--scenarios', default='local,gs,disk,pod', help='which runs, of local, gs, disk, pod')
  parser.add_argument('--data', default=MULTI30K, help='a folder with Multi30k train.{en,de}.gz and val.{en,de}.gz')
  parser.add_argument('--work', default=None, help='where the runs are written (default: a new temporary folder)')
  args = parser.parse_args()
  work = args.work or tempfile.mkdtemp(prefix='soak_')
  os.makedirs(work, exist_ok=True)
  names = [n for n in args.scenarios.split(',') if n]
  if 'disk' in names and not can_mount(work):
    print('the disk run needs root to mount a tmpfs: left out', file=sys.stderr)
    names.remove('disk')
  shares = [SHARE[n] / sum(SHARE[m] for m in names) for n in names]
  counts = [max(1, round(args.faults * s)) for s in shares]
  counts[0] += args.faults - sum(counts)
  rng, results = random.Random(args.seed), []
  print(f'soak: {args.faults} faults over {", ".join(f"{n} {c}" for n, c in zip(names, counts))}; {args.steps} '
        f'steps a run; seed {args.seed}; workdirs under {work}', flush=True)
  started = time.monotonic()
  for name, count in zip(names, counts):
    scenario = Scenario(name, count, args, rng, work)
    try:
      results.append(scenario.soak())
    finally:
      scenario.close()
    print(f'{name}: {json.dumps(results[-1])}', flush=True)
  print(f'\nCPU: {cpu_model()}, {len(os.sched_getaffinity(0))} cores; {time.monotonic() - started:.0f} s in all\n')
  print(table(results))
  ok = all(r['steps_equal'] == r['steps'] and r['finished'] and not r['bad_ends'] and not r['hangs'] and
           not r['left_behind'] for r in results)
  sys.exit(0 if ok else 1)


if __name__ == '__main__':
  main()
