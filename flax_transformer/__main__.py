"""python -m flax_transformer PROGRAM [flags]: every program by its name, the same as the installed
flax-transformer-PROGRAM commands (flax_transformer/commands/: train, translate, serve, average, export, plan,
inspect, prepare). Imports nothing before the program's module, so a program that must set up its devices before
JAX starts (plan) still can."""

import importlib
import sys

PROGRAMS = {'train': 'train', 'translate': 'translate', 'serve': 'serve', 'average': 'average', 'export': 'export',
            'plan': 'plan', 'inspect': 'inspect_batches', 'prepare': 'prepare'}  # program name -> commands module
USAGE = f'python -m flax_transformer {{{",".join(PROGRAMS)}}} [flags]; each program\'s --help lists its flags'


def main() -> None:
  name = sys.argv[1] if len(sys.argv) > 1 else ''
  if name in ('-h', '--help', 'help'):
    print(f'{__doc__.strip()}\n\nusage: {USAGE}')
    sys.exit(0)
  if name not in PROGRAMS:
    said = f'{name!r} is not a program' if name else 'no program named'
    print(f'error: {said}; usage: {USAGE}', file=sys.stderr)
    sys.exit(2)
  sys.argv = [f'flax-transformer-{name}', *sys.argv[2:]]
  importlib.import_module(f'flax_transformer.commands.{PROGRAMS[name]}').console()


def moved(module: str, program: str) -> None:
  """What a library module says when run as a program: the program's spelling now (one line, exit 2)."""
  print(f'error: python -m flax_transformer.{module} is now python -m flax_transformer {program} (or '
        f'flax-transformer-{program}); the same flags', file=sys.stderr)
  sys.exit(2)


if __name__ == '__main__':
  main()
