"""§6.1 checkpoint averaging: python -m flax_transformer average --workdir=DIR --output=OUT [--last=K | --best=K]

Averages the parameters of the last K checkpoints of a run (default: the run's config.average_last), or of its
K best by validation metric (--best=K; a run with config.keep_best), or their moving averages (--weights=ema), into
OUT, a workdir translate.py reads directly (python translate.py --workdir=OUT). OUT may not be, hold or sit
inside DIR; it is written beside and swapped in when complete. Installed as `flax-transformer-average`.
"""



def define(flag_values, argv) -> None:
  from absl import flags
  flags.DEFINE_string('workdir', None, 'Training workdir.', flag_values=flag_values)
  flags.DEFINE_integer('last', None, 'How many of the latest checkpoints to average (default: config.average_last).',
                       flag_values=flag_values)
  flags.DEFINE_string('output', None, 'Directory for the averaged model (a workdir translate.py reads).',
                      flag_values=flag_values)
  flags.DEFINE_bool('overwrite', False, 'Replace a non-empty --output (only once the new average is written).',
                    flag_values=flag_values)
  from flax_transformer import commands
  commands.define_weights(flag_values, best=True)


def average(f) -> None:
  from flax_transformer import tensorflow_setup
  tensorflow_setup.import_quietly()
  from flax_transformer import average as averaging, storage
  from flax_transformer.errors import UserError
  if f.best is not None and f.last is not None:
    raise UserError(f'--last={f.last} and --best={f.best} choose different checkpoints; give one of them')
  chosen = averaging.write_averaged_workdir(f.workdir, f.output, f.last, f.overwrite, f.best, f.weights)
  print(f'averaged steps {chosen} into {storage.path(storage.resolved(f.output))}; translate with: '
        f'python translate.py --workdir={f.output}')


def main(argv: list[str]) -> int:
  """The program on `argv`; returns its exit status (flax_transformer.commands)."""
  from flax_transformer import commands
  return commands.run_program(argv, define, average, __doc__, required=('workdir', 'output'))


def console():
  from flax_transformer import commands
  commands.console(main)


if __name__ == '__main__':
  console()
