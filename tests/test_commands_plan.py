"""The plan program (commands/plan.py): python -m flax_transformer plan on the tiny config, and its flags."""

import json
import subprocess
import sys

import pytest

from flax_transformer.commands import plan as plan_command
from tests.conftest import ROOT, subprocess_env

KEYS = ('param_bytes_per_device', 'optimizer_bytes_per_device', 'temp_bytes_per_device', 'flops_per_step',
        'analytic_flops_per_step', 'step_seconds', 'hours_to_num_train_steps')


def run_plan(*flags):
  env = subprocess_env(None)  # the plan creates its own fake devices
  return subprocess.run([sys.executable, '-m', 'flax_transformer', 'plan', '--config=configs/tiny.py', *flags],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_plan_of_the_tiny_config():
  # The config's own mesh, its -1 filled with the remaining devices (no --mesh): (2, 2, 1) on 4 devices.
  result = run_plan('--devices=4', "--config.mesh_shape=(2,-1,1)", '--peak_tflops=1', '--mfu=0.5',
                    '--device_memory_gb=16')
  assert result.returncode == 0, result.stderr[-2000:]
  print(result.stdout)
  figures = json.loads(result.stdout.strip().splitlines()[-1])
  assert all(figures[key] is not None for key in KEYS)
  assert figures['mesh'] == {'data': 2, 'fsdp': 2, 'model': 1} and figures['fits'] is True
  full_bytes = figures['param_count'] * 4
  # FSDP over 2 devices halves the kernels; biases and norms of odd axes may stay whole.
  assert full_bytes / 2 <= figures['param_bytes_per_device'] < full_bytes
  # Adam: two moments per parameter (and a step count).
  assert abs(figures['optimizer_bytes_per_device'] - 2 * figures['param_bytes_per_device']) < 64
  assert figures['temp_bytes_per_device'] > 0
  # XLA counts every op of the step, the analytic count only the products: never far below. At d_model 16
  # the elementwise ops are a large share (here ~2.6x); for base and big the two agree within 3%.
  assert 0.9 <= figures['flops_per_step'] / figures['analytic_flops_per_step'] <= 4
  expected_seconds = figures['analytic_flops_per_step'] / (4 * 1e12 * 0.5)
  assert figures['step_seconds'] == pytest.approx(expected_seconds)
  assert figures['hours_to_num_train_steps'] == pytest.approx(expected_seconds * 20 / 3600)
  assert figures['rows'] == 256 // 32 and figures['source_length'] == figures['target_length'] == 32


@pytest.mark.slow
def test_a_mesh_that_does_not_match_the_devices_is_a_one_line_error():
  result = run_plan('--devices=4', "--mesh=(2,4,1)")
  assert result.returncode == 1
  assert result.stderr.strip().splitlines()[-1].startswith('error: config.mesh_shape=(2, 4, 1) needs 8 devices')


@pytest.mark.parametrize('flags,message', [
    ({'devices': 0}, '--devices=0 must be at least 1'),
    ({'devices': -4}, '--devices=-4 must be at least 1'),
    ({'mfu': 0.0}, '--mfu=0.0 must be in (0, 1]'),
    ({'peak_tflops': -1.0}, '--peak_tflops=-1.0 must be 0'),
    ({'mesh': 'banana'}, "--mesh=banana is not three sizes"),
    ({'mesh': '(1, 0, 1)'}, 'is not three sizes (data, fsdp, model), each positive or one of them -1'),
    ({'mesh': '(-1, -1, 1)'}, 'is not three sizes'),
])
def test_bad_flags_are_refused_before_compiling(flags, message):
  import types
  from flax_transformer.errors import ConfigError
  values = types.SimpleNamespace(**{'devices': 8, 'mfu': 0.4, 'peak_tflops': 0.0, 'device_memory_gb': None,
                                    'mesh': '', **flags})
  with pytest.raises(ConfigError, match=message.replace('(', r'\(').replace(')', r'\)').replace(']', r'\]')):
    plan_command.check_flags(values)
  assert plan_command._devices_flag(['--devices=-4']) == 1 and plan_command._devices_flag(['--devices', '16']) == 16
  assert plan_command.parse_mesh('(-1, 8, 1)') == (-1, 8, 1)
