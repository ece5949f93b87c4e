"""The training batches of a config, inspected: python -m flax_transformer inspect --config=configs/multi30k.py

One epoch of length-bucketed batches on one process: counts, shapes, tokens per batch, padding, and the
table-build and batch-serving throughput, printed as one JSON line. The vocabulary is trained into --workdir
(or found there, or at config.vocab_path), the token cache built there (or at config.token_cache). Installed as `flax-transformer-inspect`.
"""

import json


def define(flag_values, argv) -> None:
  from absl import flags
  from flax_transformer.commands import define_config_flag
  define_config_flag(flag_values, argv)
  flags.DEFINE_string('workdir', '/tmp/flax_transformer_inspect', 'Where the vocabulary is trained or found.',
                      flag_values=flag_values)


def inspect(f) -> None:
  from flax_transformer import tensorflow_setup
  tensorflow_setup.import_quietly()
  from flax_transformer import input_pipeline, parallel_text, settings, tokenizer
  data = settings.resolve(f.config).data
  _, vocab_path = tokenizer.train_or_load(data, f.workdir, lambda: parallel_text.python_pairs(data))
  print(json.dumps(input_pipeline.inspect(data, vocab_path, f.workdir)))


def main(argv: list[str]) -> int:
  """The program on `argv`; returns its exit status (flax_transformer.commands)."""
  from flax_transformer import commands
  return commands.run_program(argv, define, inspect, __doc__, required=('config',), config_flag='config')


def console():
  from flax_transformer import commands
  commands.console(main)


if __name__ == '__main__':
  console()
