"""The model in CTranslate2's format: python -m flax_transformer export --workdir=DIR --output=CT2DIR

Writes the parameters (averaged as translate.py would take them, or --step, --checkpoint=best; the trained
weights or, with --weights=ema, their moving average) through CTranslate2's own model
specification (flax_transformer/export.py says how the network maps), with the vocabulary. CT2DIR may not
be, hold or sit inside DIR; it is written beside and swapped in when complete. Installed as
`flax-transformer-export`; needs the `serve` extra: pip install '.[serve]'.
"""

import os


def define(flag_values, argv) -> None:
  from absl import flags
  from flax_transformer.export import QUANTIZATIONS
  flags.DEFINE_string('workdir', None, 'Training (or averaged) workdir.', flag_values=flag_values)
  flags.DEFINE_string('output', None, 'Folder for the CTranslate2 model.', flag_values=flag_values)
  flags.DEFINE_string('quantization', 'float32', f'Weight type: {", ".join(QUANTIZATIONS)}.', flag_values=flag_values)
  flags.DEFINE_integer('step', None, 'Export this checkpoint step alone.', flag_values=flag_values)
  flags.DEFINE_integer('average_last', None, 'Average the last K checkpoints (default: the config\'s average_last).',
                       flag_values=flag_values)
  flags.DEFINE_bool('overwrite', False, 'Replace a non-empty --output (once the new model is written).',
                    flag_values=flag_values)
  from flax_transformer import commands
  commands.define_weights(flag_values)


def export(f) -> None:
  from flax_transformer import tensorflow_setup
  tensorflow_setup.import_quietly()
  from flax_transformer import export as exporting
  steps = exporting.export(f.workdir, f.output, f.quantization, f.step, f.average_last, f.overwrite,
                           checkpoint=f.checkpoint, weights=f.weights)
  print(f'exported checkpoint(s) {steps} of {f.workdir} to {os.path.abspath(f.output)} ({f.quantization})')


def main(argv: list[str]) -> int:
  """The program on `argv`; returns its exit status (flax_transformer.commands)."""
  from flax_transformer import commands
  return commands.run_program(argv, define, export, __doc__, required=('workdir', 'output'))


def console():
  from flax_transformer import commands
  commands.console(main)


if __name__ == '__main__':
  console()
