"""Prepare a run's data ahead of it: python -m flax_transformer prepare --config=configs/base.py --workdir=DIR

Trains the vocabulary into --workdir (or reads config.vocab_path) and tokenises the training split into the
token cache (WORKDIR/token_cache, or config.token_cache to share it between runs), on a CPU machine, as
fairseq-preprocess does; `train.py` with the same config and workdir then starts in seconds. A prepare killed
at any point continues from the cache blocks already written. Installed as `flax-transformer-prepare`.
"""

import json
import os

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')


def define(flag_values, argv) -> None:
  from absl import flags
  from flax_transformer.commands import define_config_flag
  define_config_flag(flag_values, argv)
  flags.DEFINE_string('workdir', None, 'The run directory: the vocabulary and (by default) the token cache go here.',
                      flag_values=flag_values)


def prepare(f) -> None:
  from flax_transformer import tensorflow_setup
  tensorflow_setup.import_quietly()
  import time
  from flax_transformer import parallel_text, run_lock, settings, storage, token_cache, tokenizer, workdirs
  settings.check(f.config)
  data = settings.resolve(f.config, checked=True).data
  workdir = storage.path(f.workdir)
  storage.check_reachable(workdir, '--workdir')
  parallel_text.check_split(data, 'train')
  workdirs.check_inputs(workdir, data)
  storage.check_writable(workdir, 'workdir', 'choose another --workdir')
  lock = run_lock.RunLock(workdir).acquire()  # not while a run of this workdir trains
  try:
    start = time.perf_counter()
    _, vocab_path = tokenizer.train_or_load(data, workdir, lambda: parallel_text.python_pairs(data))
    table = token_cache.train_table(data, vocab_path, workdir)
    print(json.dumps({'vocabulary': vocab_path, 'token_cache': token_cache.location(data, workdir), 'pairs': len(table),
                      'dropped_too_long': table.dropped,
                      'tokens': int(table.sources.lengths.sum() + table.targets.lengths.sum()),
                      'seconds': round(time.perf_counter() - start, 1)}))
  finally:
    lock.release()


def main(argv: list[str]) -> int:
  """The program on `argv`; returns its exit status (flax_transformer.commands)."""
  from flax_transformer import commands
  return commands.run_program(argv, define, prepare, __doc__, required=('config', 'workdir'), config_flag='config')


def console():
  from flax_transformer import commands
  commands.console(main)


if __name__ == '__main__':
  console()
