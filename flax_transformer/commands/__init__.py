"""The command-line programs (installed as flax-transformer-train and -translate; run as train.py, translate.py)."""

import sys

from flax_transformer.errors import ConfigError


def argv_value(argv: list[str], name: str) -> str | None:
  """The value of --name=VALUE or --name VALUE in `argv`, for the flags needed before absl parses them."""
  for i, arg in enumerate(argv):
    if arg.startswith(f'--{name}='):
      return arg.split('=', 1)[1]
    if arg == f'--{name}' and i + 1 < len(argv):
      return argv[i + 1]
  return None


def config_flag(flag_values, name: str = 'config'):
  """The ConfigDict of a `config_flags` flag, or a one-line error when its file cannot be loaded."""
  value = getattr(flag_values, name)
  try:  # a file that failed to load gives a stand-in that raises on first use
    value.get('model')
    return value
  except (OSError, SyntaxError, AttributeError, ImportError) as error:
    given = argv_value(sys.argv, name)
    cause = getattr(value, '_error', error)
    reason = next((line.strip() for line in str(cause).splitlines() if line.strip().startswith('[Errno')),
                  str(cause).splitlines()[0] if str(cause) else type(cause).__name__)
    raise ConfigError(f'--{name}={given} cannot be loaded ({reason}); give a config file such as configs/base.py, '
                      f'with :ARGUMENT after it if the file takes one') from None


def importable_configs(argv: list[str], name: str = 'config') -> None:
  """Lets a config file import its siblings (`from configs import base`) when the program runs as an installed
  command, whose sys.path holds neither the working directory nor the repository: the folder above the
  config file's folder goes on sys.path, as `python train.py` from the repository puts the repository."""
  import os
  value = argv_value(argv, name)
  if value:
    root = os.path.dirname(os.path.dirname(os.path.abspath(value.split(':', 1)[0])))
    if root not in sys.path:
      sys.path.insert(0, root)
