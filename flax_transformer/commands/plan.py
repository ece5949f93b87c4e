"""A capacity plan without the devices: python -m flax_transformer plan --config=configs/big.py --devices=8 \\
    [--mesh='(1,8,1)'] [--peak_tflops=989 --mfu=0.4] [--device_memory_gb=80] [--target=gpu]

Compiles the real train step for --devices fake CPU devices on the config's mesh (or --mesh) and prints what
each device holds, the FLOPs of a step and, given a peak and an MFU, the training time (flax_transformer/plan.py
says how); the last line is one JSON object. Installed as `flax-transformer-plan`.
"""

import ast
import json
import os
import sys


def _devices_flag(argv: list[str]) -> int:
  """--devices must be known before JAX starts: it sets the number of fake CPU devices (a bad value is left to
  check_flags; JAX then starts with 1)."""
  from flax_transformer.commands import argv_value
  value = argv_value(argv, 'devices')
  if value is None:
    return 8
  return int(value) if value.strip().isdigit() and int(value) > 0 else 1


def start_cpu_devices(argv: list[str]) -> None:
  """Fake CPU devices, as many as --devices says, for JAX to start with (before it is imported)."""
  os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') +
                             f' --xla_force_host_platform_device_count={_devices_flag(argv)}')
  os.environ['JAX_PLATFORMS'] = 'cpu'
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')


def parse_mesh(text: str) -> tuple[int, int, int]:
  """'(data, fsdp, model)' -> three sizes, each positive or one of them -1 (the remaining devices)."""
  try:
    mesh = ast.literal_eval(text)
  except (ValueError, SyntaxError):
    mesh = None
  if not (isinstance(mesh, tuple) and len(mesh) == 3 and all(isinstance(n, int) and (n >= 1 or n == -1) for n in mesh)
          and mesh.count(-1) <= 1):
    raise ValueError(f"--mesh={text} is not three sizes (data, fsdp, model), each positive or one of them -1 (the "
                     f"remaining devices); write e.g. --mesh='(1,8,1)'")
  return mesh


def check_flags(f) -> None:
  """The flags' values, before anything is compiled."""
  from flax_transformer.errors import ConfigError
  if not f.devices >= 1:
    raise ConfigError(f'--devices={f.devices} must be at least 1: the devices to plan for')
  if not 0 < f.mfu <= 1:
    raise ConfigError(f'--mfu={f.mfu} must be in (0, 1]: the fraction of peak FLOP/s a step achieves (e.g. 0.4)')
  if f.peak_tflops < 0:
    raise ConfigError(f'--peak_tflops={f.peak_tflops} must be 0 (no timing) or the device\'s peak TFLOP/s')
  if f.device_memory_gb is not None and f.device_memory_gb <= 0:
    raise ConfigError(f'--device_memory_gb={f.device_memory_gb} must be positive (or left out)')
  if f.mesh:
    try:
      parse_mesh(f.mesh)
    except ValueError as error:
      raise ConfigError(str(error)) from None


def define(flag_values, argv) -> None:
  from absl import flags
  from flax_transformer.commands import define_config_flag
  define_config_flag(flag_values, argv)
  define = lambda kind, name, default, help_string, **kw: getattr(flags, f'DEFINE_{kind}')(
      name, default, help_string, flag_values=flag_values, **kw)
  define('integer', 'devices', 8, 'Devices to plan for (fake CPU devices are created).')
  define('string', 'mesh', '', "(data, fsdp, model), e.g. '(1,8,1)'; default: the config's mesh_shape.")
  define('float', 'peak_tflops', 0.0, 'Peak TFLOP/s of one device in the compute dtype (0: no timing).')
  define('float', 'mfu', 0.4, 'Model FLOPs utilisation assumed for the step time.')
  define('float', 'device_memory_gb', None, 'Memory of one device; the plan says whether the step fits.')
  flags.DEFINE_enum('target', 'gpu', ['cpu', 'gpu', 'tpu'], "The platform whose 'auto' choices are planned.",
                    flag_values=flag_values)


def report(f) -> None:
  from flax_transformer import plan, settings
  check_flags(f)
  s = settings.resolve(f.config, f.target)  # the choices of the platform planned for, made once
  mesh = parse_mesh(f.mesh) if f.mesh else s.training.mesh_shape
  figures = plan.plan(s, f.devices, mesh, f.peak_tflops, f.mfu, f.device_memory_gb)
  print(f'capacity plan for {f.target}, computed by compiling the train step on {f.devices} fake CPU devices '
        f'(not measured)')
  print(plan.table(figures, f.peak_tflops, f.mfu, f.device_memory_gb))
  if figures['fits'] is False:
    fix = figures['fix']
    print(f'does not fit {f.device_memory_gb:g} GB per device; ' +
          (f'fits with {fix["flags"]} ({fix["total_bytes_per_device"] / plan.GIB:.2f} GiB per device)' if fix
           else 'no mesh or accumulation tried fits: use more devices'))
  print(json.dumps(figures))


def main(argv: list[str]) -> int:
  """The program on `argv` (in a process whose JAX started with --devices devices); returns its exit status."""
  from flax_transformer import commands
  return commands.run_program(argv, define, report, __doc__, required=('config',), config_flag='config')


def console():
  """`flax-transformer-plan` and python -m flax_transformer plan."""
  start_cpu_devices(sys.argv)
  import jax
  jax.config.update('jax_platforms', 'cpu')  # in case JAX was imported before the environment was set
  from flax_transformer import commands
  commands.console(main)


if __name__ == '__main__':
  console()
