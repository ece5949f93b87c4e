"""The benchmarks run end to end at tiny sizes: the prepared accelerator benchmark (one JSON line at the end) and
the fault soak, both in the accelerator job (bench/gpu.sh); the CPU suite checks what they measure elsewhere."""

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import subprocess_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.accelerator  # bench/gpu.sh's own job: a minute of CPU that no CPU test needs
def test_gpu_benchmark_smoke_run():
  env = subprocess_env(None)  # one device, as on the GPU machine
  # One dtype keeps it to about a minute on 2 cores (each tiny step compiles in ~8 s, three times).
  result = subprocess.run(['bash', 'bench/gpu.sh', '--smoke', '--dtypes=bfloat16'], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=480)
  assert result.returncode == 0, result.stderr[-3000:]
  print(result.stdout)
  summary = json.loads(result.stdout.strip().splitlines()[-1])
  train = [run for run in summary['runs'] if 'step_seconds' in run]
  assert [run['dtype'] for run in train] == ['bfloat16']
  for run in train:  # the measurement and the plan's prediction side by side
    assert run['step_seconds'] > 0 and run['planned_step_seconds'] > 0
    assert run['device_bytes'] > 0 and run['planned_bytes'] > 0
  assert any('beam4_sentences_per_second' in run for run in summary['runs'])
  engine = [run for run in summary['runs'] if 'engine_sentences_per_second' in run]
  assert engine and all(run['engine_target_tokens_per_second'] > run['engine_sentences_per_second'] > 0 for run in engine)


@pytest.mark.accelerator  # in the accelerator job: test_exact_resume_after_sigkill checks the same on the CPU
def test_fault_soak_smoke_run(tmp_path):
  """bench/soak.py end to end on its cheapest run: one fault (kill -9 or SIGTERM) of a local one-process run,
  restarted, every logged loss equal to the uninterrupted run's."""
  if not os.path.isdir(os.path.join(os.path.dirname(ROOT), 'shared', 'data', 'multi30k')):
    pytest.skip('the soak trains on ../shared/data/multi30k, which is not beside this repository')
  result = subprocess.run([sys.executable, 'bench/soak.py', '--faults=1', '--steps=100', '--scenarios=local',
                           f'--work={tmp_path}'], cwd=ROOT, env=subprocess_env(), capture_output=True, text=True,
                          timeout=900)
  assert result.returncode == 0, (result.stdout[-3000:], result.stderr[-3000:])
  row = next(line for line in result.stdout.splitlines() if line.startswith('| local |'))
  cells = [cell.strip() for cell in row.split('|')[1:-1]]
  assert cells[4] == '100 / 100' and cells[5] == 'yes' and cells[6:] == ['0', '0', '0'], row
