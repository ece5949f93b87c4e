"""The prepared accelerator benchmark runs end to end (tiny sizes on the CPU) and ends with one JSON line."""

import json
import os
import subprocess

import pytest

from tests.conftest import subprocess_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
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
