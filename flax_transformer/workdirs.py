"""A run's workdir before and after training: the checks that it can be written and holds no other run, and
its config.json (written at start-up, read back by translation, averaging, export and fine-tuning)."""

import json

import ml_collections

from flax_transformer import checkpointing, settings, storage
from flax_transformer.errors import WorkdirError

CONFIG_FILENAME = 'config.json'
# config.model fields a resumed run may change: regularisation and how the same network is computed.
COMPUTE_CHOICES = ('dropout_rate', 'attention_dropout_rate', 'dropout_masks', 'attention', 'dtype', 'scan_unroll')


def check(workdir: str, config: ml_collections.ConfigDict) -> None:
  """Refuses a workdir that cannot be written or that holds a run of a different model or vocabulary."""
  try:  # one probe per process: the processes of a multi-host run check the same (shared) workdir at once
    storage.check_writable(workdir, 'workdir', 'choose another --workdir')
    storage.check_writable(checkpointing.checkpoint_dir(workdir), 'the checkpoints folder of workdir',
                           'make it writable or choose another --workdir')
  except storage.StorageError as error:
    raise WorkdirError(str(error)) from None
  path = storage.path(workdir) / CONFIG_FILENAME
  if not path.exists():
    return
  saved = read_config(workdir).to_dict()
  current = json.loads(config.to_json())
  for key in sorted(set(saved.get('model', {})) | set(current['model'])):
    if saved.get('model', {}).get(key) != current['model'].get(key) and key not in COMPUTE_CHOICES:
      raise WorkdirError(f'workdir {workdir} holds a run with model.{key}={saved["model"].get(key)!r} but this config '
                         f'has {current["model"].get(key)!r}; use a new --workdir (the existing run is left untouched)')
  for key in ('vocab_path', 'vocab_type', 'source_lang', 'target_lang'):
    if saved.get(key) != current.get(key):
      raise WorkdirError(f'workdir {workdir} holds a run with {key}={saved.get(key)!r} but this config has '
                         f'{current.get(key)!r}; use a new --workdir (the existing run is left untouched)')


def write_config(workdir: str, config: ml_collections.ConfigDict) -> None:
  storage.write_atomic(storage.path(workdir) / CONFIG_FILENAME, config.to_json_best_effort(indent=2))


def read_config(workdir: str) -> ml_collections.ConfigDict:
  """The run config saved in `workdir` (older config.json files through settings.saved)."""
  path = storage.path(workdir) / CONFIG_FILENAME
  if not path.exists():
    raise WorkdirError(f'{workdir} has no {CONFIG_FILENAME}; point --workdir at a directory written by train.py')
  try:
    return settings.saved(path.read_text())
  except json.JSONDecodeError as error:
    raise WorkdirError(f'{path} is damaged ({error.msg} at line {error.lineno}); restore it from a copy, or '
                       f'rewrite it with the run\'s config (train.py writes it at start-up)') from None
