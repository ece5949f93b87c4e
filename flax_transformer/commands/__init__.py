"""The command-line programs, one module each: train, translate, serve, average, export, plan, inspect_batches,
prepare.

Installed as flax-transformer-train, -translate, -serve, -average, -export, -plan, -inspect and -prepare; also
run as `python -m flax_transformer PROGRAM` (flax_transformer/__main__.py), train.py and translate.py. Every program goes through `run_program`: its own flags
parsed from its own argv (so a program can be called in-process, as the tests do), and every way it can end
turned into one exit status:

  0    done
  1    an input that cannot be used (a UserError, a config file that does not load): one line `error: ...` on
       stderr naming the problem and the fix
  2    a command line that cannot be parsed (an unknown flag or config field, a value of the wrong type)
  130  interrupted (Ctrl-C) outside the training loop, which saves a checkpoint on its own

The library below never imports this package.
"""

import difflib
import os
import sys
from collections.abc import Callable

from flax_transformer.errors import UserError

EXIT_ERROR, EXIT_USAGE, EXIT_INTERRUPTED = 1, 2, 130


def argv_value(argv: list[str], name: str) -> str | None:
  """The value of --name=VALUE or --name VALUE in `argv`, for the flags needed before the flags are parsed."""
  for i, arg in enumerate(argv):
    if arg.startswith(f'--{name}='):
      return arg.split('=', 1)[1]
    if arg == f'--{name}' and i + 1 < len(argv):
      return argv[i + 1]
  return None


def define_weights(flag_values, best: bool = False) -> None:
  """The flags that choose a model's weights, alike in every program that reads a trained model: --weights
  (the trained weights, or their moving average) and --checkpoint (the newest, averaged, or the best by
  validation metric); with `best`, --best=K instead (average's K best)."""
  from absl import flags
  flags.DEFINE_enum('weights', 'params', ['params', 'ema'], "'params': the trained weights; 'ema': their moving "
                    'average (a run with config.ema_decay > 0).', flag_values=flag_values)
  if best:
    flags.DEFINE_integer('best', None, "Average the K best checkpoints by the run's validation metric "
                         '(config.best_metric; a run with config.keep_best) instead of the last.',
                         flag_values=flag_values)
  else:
    flags.DEFINE_enum('checkpoint', 'last', ['last', 'best'], "'last': the newest checkpoints, averaged as the run "
                      "says (or --step, --average_last); 'best': the best one by the run's validation metric "
                      '(config.best_metric; a run with config.keep_best).', flag_values=flag_values)


def define_cluster(flag_values) -> None:
  """The flags of a program that runs on several processes without a run config (translate): one per field of
  cluster.ClusterSettings, of its name, type, description and default."""
  import dataclasses
  from absl import flags
  from flax_transformer.cluster import ClusterSettings
  for field in dataclasses.fields(ClusterSettings):
    kind = {str: flags.DEFINE_string, int: flags.DEFINE_integer}[field.type]
    kind(field.name, field.default, field.metadata['doc'], flag_values=flag_values)


def check_cluster(f) -> None:
  """define_cluster's flags checked as a run config's fields are: one line naming the flag."""
  import dataclasses
  from flax_transformer import settings_fields
  from flax_transformer.cluster import ClusterSettings
  names = [field.name for field in dataclasses.fields(ClusterSettings)]
  settings_fields.check_values(ClusterSettings, {name: getattr(f, name) for name in names}, lambda name: f'--{name}')
  if f.coordinator_address and not f.process_id < f.num_processes:
    raise UserError(f'--process_id={f.process_id} is outside 0..{f.num_processes - 1} (--num_processes='
                    f'{f.num_processes}); give each process its own id')


def error_line(message: str) -> int:
  """Prints `error: message` (one line) on stderr after whatever stdout holds; returns the error status."""
  sys.stdout.flush()
  print(f'error: {" ".join(str(message).split(chr(10)))}', file=sys.stderr, flush=True)
  return EXIT_ERROR


def importable_configs(argv: list[str], name: str = 'config') -> None:
  """Lets a config file import its siblings (`from configs import base`) when the program runs as an installed
  command, whose sys.path holds neither the working directory nor the repository: the folder above the
  config file's folder goes on sys.path, as `python train.py` from the repository puts the repository."""
  value = argv_value(argv, name)
  if value:
    root = os.path.dirname(os.path.dirname(os.path.abspath(value.split(':', 1)[0])))
    if root not in sys.path:
      sys.path.insert(0, root)


def _first_line(error: BaseException) -> str:
  lines = [line.strip() for line in str(error).splitlines() if line.strip()]
  errno = next((line for line in lines if line.startswith('[Errno')), None)
  return errno or (lines[0] if lines else type(error).__name__)


def _unknown_override(argv: list[str], name: str, define_config) -> str:
  """The message for a --name.FIELD=VALUE override naming no field: which one, and the nearest names."""
  from absl import flags
  plain = [arg for arg in argv[1:] if not arg.startswith(f'--{name}.')]
  flag_values = flags.FlagValues()
  define_config(flag_values, [argv[0], *plain])
  try:
    flag_values([argv[0], *plain], known_only=True)
    config = getattr(flag_values, name)
  except Exception:  # the file itself does not load: reported as such by the caller
    return ''
  for arg in argv[1:]:
    if not arg.startswith(f'--{name}.'):
      continue
    path = arg[len(name) + 3:].split('=', 1)[0]
    holder, parts = config, path.split('.')
    for depth, part in enumerate(parts):
      keys = list(holder.keys()) if hasattr(holder, 'keys') else []
      if part not in keys:
        parent = '.'.join([name] + parts[:depth])
        near = difflib.get_close_matches(part, keys, n=3)
        hint = f'did you mean {" or ".join(f"--{parent}.{k}" for k in near)}? ' if near else ''
        return (f'{arg.split("=", 1)[0]}: the config has no field {".".join(parts[:depth + 1])!r}; {hint}'
                f'configs/base.py lists every field')
      holder = holder[part]
  return ''


def define_config_flag(flag_values, argv: list[str], name: str = 'config') -> None:
  """The run-config flag: a configs/*.py file (with :ARGUMENT if it takes one), overridden by --config.FIELD=VALUE."""
  from ml_collections import config_flags
  config_flags.DEFINE_config_file(name, None, 'Run configuration file (configs/*.py).', flag_values=flag_values,
                                  lock_config=True, sys_argv=argv)


def _parse(flag_values, argv: list[str], config_flag: str | None) -> tuple[str, int]:
  """Parses `argv` into `flag_values`: ('', 0), or the one-line reason it cannot be parsed and its exit status."""
  from absl import flags
  try:
    rest = flag_values(argv)
    if config_flag and getattr(flag_values, config_flag) is not None:
      getattr(flag_values, config_flag).keys  # a file that failed to load gives a stand-in raising on any use
  except flags.Error as error:
    return f'{_first_line(error)}; see --help', EXIT_USAGE
  except (AttributeError, KeyError) as error:  # a --config.FIELD override naming no field
    found = _unknown_override(argv, config_flag, define_config_flag) if config_flag else ''
    return found or f'the command line cannot be parsed ({_first_line(error)}); see --help', EXIT_USAGE
  except (OSError, SyntaxError, ImportError, TypeError, ValueError) as error:  # the config file does not load
    given = argv_value(argv, config_flag) if config_flag else None
    reason = _first_line(error)
    if isinstance(error, SyntaxError):
      reason = f'SyntaxError at line {error.lineno}: {error.msg}'
    return (f'--{config_flag}={given} cannot be loaded ({reason}); give a config file such as configs/base.py, '
            f'with :ARGUMENT after it if the file takes one'), EXIT_ERROR
  if len(rest) > 1:
    return f'unexpected arguments {rest[1:]}: every flag is written --name=value; see --help', EXIT_USAGE
  return '', 0


def console(main: Callable[[list[str]], int], hard_exit: bool = False) -> None:
  """Runs `main` on sys.argv and exits with its status. Errors no code can catch (a failed read's other pending
  reads, collected at exit) are not printed: the one line `main` wrote says what failed. `hard_exit`: an error
  ends the process at once (os._exit), not waiting for threads that may never finish (a failed checkpoint
  write's)."""
  importable_configs(sys.argv)
  sys.unraisablehook = lambda unraisable: None
  status = main(sys.argv)
  if status and hard_exit:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
  sys.exit(status)


def _not_orbax_errors(record) -> bool:
  return not (record.levelno >= 40 and f'{os.sep}orbax{os.sep}' in record.pathname)


def run_program(argv: list[str], define: Callable, main: Callable, doc: str, required: tuple[str, ...] = (),
        config_flag: str | None = None) -> int:
  """Runs one program on `argv` (argv[0] its name): `define(flag_values, argv)` defines its flags, `main(flag_values)`
  does its work; the flags named in `required` must be given, `config_flag` names its run-config flag. Returns
  the exit status (see the module docstring); never raises for bad input."""
  from absl import flags, logging
  if any(arg in ('-h', '--help', '--helpfull', '-help') for arg in argv[1:]):
    flag_values = flags.FlagValues()
    define(flag_values, argv)
    print(doc.strip() + '\n\nflags:\n' + flag_values.get_help(), flush=True)
    return 0
  flag_values = flags.FlagValues()
  flags.DEFINE_integer('verbosity', -1, 'Logging verbosity: 0 shows the libraries\' INFO lines (Orbax saves...); '
                       '-1 (default) shows warnings and errors only.', flag_values=flag_values)
  define(flag_values, argv)
  problem, status = _parse(flag_values, argv, config_flag)
  if problem:
    error_line(problem)
    return status
  missing = [name for name in required if flag_values[name].value is None]
  if missing:
    error_line(f'--{missing[0]} is required; see --help')
    return EXIT_USAGE
  logging.set_verbosity(logging.INFO if flag_values.verbosity >= 0 else logging.WARNING)
  if flag_values.verbosity < 0 and _not_orbax_errors not in logging.get_absl_logger().filters:
    logging.get_absl_logger().addFilter(_not_orbax_errors)  # a failed save's traceback, which Orbax logs from its
    # own thread: the program says what failed in one line
  try:
    main(flag_values)
  except UserError as error:
    return error_line(str(error))
  except KeyboardInterrupt:
    error_line('interrupted (Ctrl-C); nothing is left half-written: rerun the same command to start again')
    return EXIT_INTERRUPTED
  return 0
