"""A run's workdir before and after training: the checks that it can be written and holds no other run, and
its config.json (written at start-up, read back by translation, averaging, export and fine-tuning)."""

import dataclasses
import json

import ml_collections

from flax_transformer import checkpointing, parallel_text, settings, settings_fields, storage, tokenizer
from flax_transformer.errors import ConfigError, WorkdirError

CONFIG_FILENAME = 'config.json'
# config.model fields a resumed run may change: regularisation and how the same network is computed.
COMPUTE_CHOICES = ('dropout_rate', 'attention_dropout_rate', 'dropout_masks', 'attention', 'dtype', 'scan_unroll')


def check(workdir: str, s: 'settings.Settings') -> None:
  """Refuses a workdir that cannot be written, that holds a run of a different model or vocabulary than the
  resolved settings `s`, or whose newest checkpoint is not a training state of that model."""
  try:  # one probe per process: the processes of a multi-host run check the same (shared) workdir at once
    storage.check_writable(workdir, 'workdir', 'choose another --workdir')
    storage.check_writable(checkpointing.checkpoints_folder(workdir), 'the checkpoints folder of workdir',
                           'make it writable or choose another --workdir')
  except storage.StorageError as error:
    raise WorkdirError(str(error)) from None
  saved = None
  if (storage.path(workdir) / CONFIG_FILENAME).exists():
    saved = read_settings(workdir, platform=s.platform)
    for stage, keys, prefix in (('model', [f.name for f in dataclasses.fields(s.model) if f.name not in COMPUTE_CHOICES],
                                 'model.'), ('data', ('vocab_path', 'vocab_type', 'source_lang', 'target_lang'), '')):
      for key in keys:
        before, now = getattr(getattr(saved, stage), key), getattr(getattr(s, stage), key)
        if before != now:
          raise WorkdirError(f'workdir {workdir} holds a run with {prefix}{key}={before!r} but this config has '
                             f'{now!r}; use a new --workdir (the existing run is left untouched)')
  steps = checkpointing.available_steps(workdir)
  if steps and saved and saved.training.seed != s.training.seed:
    raise WorkdirError(f'workdir {workdir} holds a run trained with config.seed={saved.training.seed} (checkpoint '
                       f'{steps[-1]}) but this config has {s.training.seed}; a resumed run keeps its seed '
                       f'(initialisation, dropout and data order): drop --config.seed, or use a new --workdir for '
                       f'another seed')
  if steps:
    import flax.linen as nn
    from flax_transformer import partitioning
    abstract = nn.meta.unbox(partitioning.abstract_params(s.model))
    checkpointing.check_kind(checkpointing.checkpoints_folder(workdir) / str(steps[-1]), abstract, True, workdir)


# What training writes into its workdir (beside the vocabulary when it trains one).
WRITTEN = (CONFIG_FILENAME, checkpointing.CHECKPOINT_DIR, 'tensorboard', 'train_metrics.jsonl', 'translations',
           'run.lock', 'token_cache')


def check_inputs(workdir, data: 'parallel_text.DataSettings', init_from: str = '') -> None:
  """Refuses a run whose writes would land on what it reads: the workdir may not be, hold or sit inside the
  run it fine-tunes from (`init_from`, a workdir), and none of the files training writes into it may be,
  hold or sit inside a file the settings read (every field declared `read`: the data files, the vocabulary)."""
  storage.check_output(f'--workdir={workdir}', workdir, {'the run of --config.init_from': init_from},
                       'give the fine-tuning run a workdir of its own')
  reads = settings_fields.files_read(data)
  for name in WRITTEN + (() if data.vocab_path else (tokenizer.VOCAB_FILENAME,)):
    written = storage.path(workdir) / name
    storage.check_output(f'{written}, which training writes,', written, reads, 'choose another --workdir')
  if data.token_cache:
    storage.check_output(f'config.token_cache={data.token_cache}', data.token_cache, reads,
                         'give the token cache a folder of its own')
    cache = storage.path(data.token_cache)
    if cache.exists() and not cache.is_dir():
      raise WorkdirError(f'config.token_cache={data.token_cache} is a file; give a folder for the token caches (a new '
                         f'one, or one an earlier run filled), the file is left as it is')


def write_config(workdir: str, text: str) -> None:
  """Writes the run's config.json (settings.to_json's text), whole or not at all."""
  storage.write_atomic(storage.path(workdir) / CONFIG_FILENAME, text)


def copy_config(workdir: str, target: str, **changes) -> None:
  """The config.json of `workdir` into the workdir `target`, with `changes` made (e.g. average_last=1)."""
  write_config(target, settings.to_json(read_config(workdir), **changes))


def read_settings(workdir: str, flag: str = '--workdir', platform: str | None = None) -> 'settings.Settings':
  """The settings of the run saved in `workdir`, resolved for `platform` (default: the one JAX runs on)."""
  return settings.resolve(read_config(workdir, flag), platform)


def read_config(workdir: str, flag: str = '--workdir') -> ml_collections.ConfigDict:
  """The run config saved in `workdir` (older config.json files through settings.saved), checked as a run config
  is; a missing or damaged one is a one-line error naming `flag`, the flag that gave `workdir`."""
  storage.check_reachable(workdir, flag)
  path = storage.path(workdir) / CONFIG_FILENAME
  if not storage.path(workdir).is_dir():
    raise WorkdirError(f'{flag}={workdir} is not a folder; point {flag} at a directory written by train.py')
  if not path.exists():
    raise WorkdirError(f'{workdir} has no {CONFIG_FILENAME}; point {flag} at a directory written by train.py')
  fix = 'restore it from a copy, or rewrite it with the run\'s config (train.py writes it at start-up)'
  try:
    text = path.read_bytes().decode('utf-8')
    values = json.loads(text)
  except UnicodeDecodeError as error:
    raise WorkdirError(f'{path} is damaged (not UTF-8 text: {error.reason} at byte {error.start}); {fix}') from None
  except json.JSONDecodeError as error:
    raise WorkdirError(f'{path} is damaged ({error.msg} at line {error.lineno}); {fix}') from None
  if not isinstance(values, dict) or not isinstance(values.get('model'), dict):
    raise WorkdirError(f'{path} is damaged (it holds JSON that is not a run config: no "model" object); {fix}')
  try:
    config = settings.saved(text)
    settings.check(config)
  except (ConfigError, TypeError, ValueError, AttributeError) as error:
    raise WorkdirError(f'{path} is damaged or not a run config ({str(error).split(";")[0]}); {fix}') from None
  return config
