"""The run config, read once: `resolve(config, platform)` checks every field (one-line errors naming the field
and the fix), makes every 'auto' choice for the platform, and hands each stage its own frozen settings; the
ConfigDict goes no further than this module and the loop. `saved(text)` reads a workdir's config.json,
older ones included (keys renamed since, fields added since).

Stage settings are plain frozen dataclasses whose fields keep the config's names:
  Settings.model      model.TransformerConfig (config.model)
  Settings.data       DataSettings: sources, vocabulary, lengths, batches, the data stream's seed
  Settings.optimizer  OptimizerSettings: Adam, the schedule, clipping, skipped steps
  Settings.decode     DecodeSettings: beam search and BLEU
  Settings.loop       LoopSettings: steps, intervals, checkpoints, the loss guard, seeds, the output loss
  Settings.cluster    ClusterSettings: processes and their timeouts
"""

import dataclasses
import json
import typing

import ml_collections

from flax_transformer import bucketing, evaluation, optim, platforms, tokenizer
from flax_transformer.errors import ConfigError
from flax_transformer.model import TransformerConfig

# Saved config.json keys renamed since: old -> new (a dotted key is under config.model).
RENAMED = {
    'max_length': 'max_train_length',
    'eval_max_length': 'max_eval_length',
    'model.max_len': 'model.max_positions',
}
# Fields added since the first config.json files, with the value those runs had.
ADDED = {
    'lr_decay': 'inverse_sqrt', 'cooldown_steps': 0, 'max_skipped_steps': 0, 'loss_spike_factor': 0.0,
    'loss_spike_steps': 20, 'bleu_tokenize': '13a', 'beam_top_k': 'auto', 'output_loss': 'auto', 'init_from': '',
    'vocab_sample_sentences': 4_000_000, 'restore_data_state': True, 'bucket_shapes': 'pairs',
    'dropout_rng_impl': 'rbg', 'num_eval_bleu_sentences': 0, 'platform': '', 'coordinator_address': '',
    'num_processes': 1, 'process_id': 0, 'heartbeat_timeout_seconds': 30, 'shutdown_timeout_seconds': 60,
    'model.dropout_masks': 'auto', 'model.attention': 'auto', 'model.scan_unroll': 1,
    'storage_timeout_seconds': 300, 'initialization_timeout_seconds': 300, 'download_url': '',
}


@dataclasses.dataclass(frozen=True)
class DataSettings:
  dataset: str
  source_lang: str
  target_lang: str
  data_dir: str
  train_split: str
  eval_split: str
  test_split: str
  train_source: str
  train_target: str
  eval_source: str
  eval_target: str
  test_source: str
  test_target: str
  download_url: str  # where missing data files are fetched from, {name} for each file's name ('': nowhere)
  vocab_path: str
  vocab_type: str
  vocab_size: int  # config.model.vocab_size
  vocab_sample_sentences: int
  max_train_length: int
  max_eval_length: int
  tokens_per_batch: int
  eval_tokens_per_batch: int
  num_bucket_boundaries: int
  bucket_shapes: str
  gradient_accumulation_steps: int
  seed: int


@dataclasses.dataclass(frozen=True)
class OptimizerSettings:
  warmup_steps: int
  learning_rate_factor: float
  lr_decay: str
  cooldown_steps: int
  num_train_steps: int
  adam_b1: float
  adam_b2: float
  adam_eps: float
  grad_clip_norm: float
  max_skipped_steps: int


@dataclasses.dataclass(frozen=True)
class DecodeSettings:
  beam_size: int
  length_penalty_alpha: float
  max_extra_length: int
  beam_top_k: str  # resolved: 'two_stage' or 'lax'
  eval_tokens_per_batch: int
  bleu_tokenize: str


@dataclasses.dataclass(frozen=True)
class LoopSettings:
  num_train_steps: int
  checkpoint_every_steps: int
  keep_checkpoints: int
  eval_every_steps: int
  log_every_steps: int
  num_eval_bleu_sentences: int
  average_last: int
  max_skipped_steps: int
  loss_spike_factor: float
  loss_spike_steps: int
  label_smoothing: float
  gradient_accumulation_steps: int
  seed: int
  dropout_rng_impl: str
  restore_data_state: bool
  init_from: str
  platform: str
  mesh_shape: tuple
  fused_output_loss: bool  # config.output_loss resolved
  storage_timeout_seconds: int


@dataclasses.dataclass(frozen=True)
class ClusterSettings:
  coordinator_address: str
  num_processes: int
  process_id: int
  initialization_timeout_seconds: int
  heartbeat_timeout_seconds: int
  shutdown_timeout_seconds: int


@dataclasses.dataclass(frozen=True)
class Settings:
  """Every stage's settings of one run on one platform (`resolve`)."""
  platform: str
  model: TransformerConfig
  data: DataSettings
  optimizer: OptimizerSettings
  decode: DecodeSettings
  loop: LoopSettings
  cluster: ClusterSettings


def _fail(field: str, value, why: str) -> typing.NoReturn:
  raise ConfigError(f'config.{field}={value!r}: {why}')


def _value(field: dataclasses.Field, config: ml_collections.ConfigDict):
  """The config's value of a stage field, checked against the field's type (ints taken as floats, lists as tuples)."""
  value, kind = config[field.name], field.type
  if kind is float and isinstance(value, int) and not isinstance(value, bool):
    value = float(value)
  if kind is tuple and isinstance(value, list):
    value = tuple(value)
  if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
    _fail(field.name, value, f'must be {"an" if kind is int else "a"} {kind.__name__}')
  return value


def _typed(cls, config: ml_collections.ConfigDict, **given):
  """cls built from the config's fields of the same names (`given` first)."""
  return cls(**{f.name: given[f.name] if f.name in given else _value(f, config) for f in dataclasses.fields(cls)})


STAGES = (DataSettings, OptimizerSettings, DecodeSettings, LoopSettings, ClusterSettings)
DERIVED = ('vocab_size', 'fused_output_loss')  # stage fields that are not config fields of that name


def check(config: ml_collections.ConfigDict) -> None:
  """Every field of the run config is there, of its type, and can work (the model's own checks:
  TransformerConfig); nothing here touches JAX, so it runs before a multi-process start."""
  fields = [f for stage in STAGES for f in dataclasses.fields(stage) if f.name not in DERIVED]
  for name in sorted({f.name for f in fields} | {'output_loss', 'model'}):
    if name not in config:
      raise ConfigError(f'config.{name} is missing; add it to the config (configs/base.py sets every field)')
  for field in ('num_train_steps', 'checkpoint_every_steps', 'eval_every_steps', 'log_every_steps',
                'keep_checkpoints', 'gradient_accumulation_steps', 'tokens_per_batch', 'eval_tokens_per_batch',
                'max_train_length', 'max_eval_length', 'num_bucket_boundaries', 'beam_size', 'vocab_sample_sentences',
                'heartbeat_timeout_seconds', 'shutdown_timeout_seconds', 'num_processes', 'storage_timeout_seconds',
                'initialization_timeout_seconds'):
    if not isinstance(config[field], int) or isinstance(config[field], bool) or config[field] < 1:
      _fail(field, config[field], 'must be a positive integer')
  for field in ('warmup_steps', 'max_skipped_steps', 'loss_spike_steps', 'max_extra_length', 'num_eval_bleu_sentences',
                'average_last', 'process_id'):
    if not isinstance(config[field], int) or isinstance(config[field], bool) or config[field] < 0:
      _fail(field, config[field], 'must be a non-negative integer')
  for field in fields:  # the type of every other field, before its value is compared
    _value(field, config)
  if not isinstance(config.cooldown_steps, int) or not 0 <= config.cooldown_steps <= config.num_train_steps:
    _fail('cooldown_steps', config.cooldown_steps,
          f'must be an integer from 0 (no cooldown) to config.num_train_steps={config.num_train_steps}')
  for field, choices in (('lr_decay', optim.LR_DECAYS), ('vocab_type', tokenizer.VOCAB_TYPES),
                         ('output_loss', platforms.OUTPUT_LOSS + ('auto',)),
                         ('beam_top_k', platforms.TOP_K + ('auto',)), ('bleu_tokenize', evaluation.BLEU_TOKENIZERS),
                         ('dropout_rng_impl', ('rbg', 'unsafe_rbg', 'threefry2x32'))):
    if config[field] not in choices:
      _fail(field, config[field], f'must be one of {", ".join(choices)}')
  bucketing.check_bucket_shapes(config.bucket_shapes)
  if config.platform not in ('',) + platforms.PLATFORMS:
    _fail('platform', config.platform, f"unknown value; use '', {', '.join(map(repr, platforms.PLATFORMS))}")
  for field, low, high in (('label_smoothing', 0.0, 1.0), ('adam_b1', 0.0, 1.0), ('adam_b2', 0.0, 1.0),
                           ('length_penalty_alpha', 0.0, float('inf'))):
    if not low <= config[field] < high:
      _fail(field, config[field], f'must be in [{low:g}, {high:g})')
  for field in ('learning_rate_factor', 'adam_eps'):
    if not config[field] > 0:
      _fail(field, config[field], 'must be positive')
  for field in ('grad_clip_norm', 'loss_spike_factor'):
    if not config[field] >= 0:
      _fail(field, config[field], 'must be 0 (off) or positive')
  if config.coordinator_address and not 0 <= config.process_id < config.num_processes:
    raise ConfigError(f'config.process_id={config.process_id} is outside 0..{config.num_processes - 1} '
                      f'(config.num_processes={config.num_processes}); give each process its own id')
  if config.keep_checkpoints < config.average_last:
    raise ConfigError(f'config.keep_checkpoints={config.keep_checkpoints} is below config.average_last='
                      f'{config.average_last}; keep at least as many checkpoints as are averaged')
  if config.dataset == 'files':
    for split in ('train', 'eval'):
      for side in ('source', 'target'):
        if not config[f'{split}_{side}']:
          raise ConfigError(f"config.{split}_{side} is empty but config.dataset='files'; set the path "
                            f'(--config.{split}_{side}=PATH) or a tfds dataset name in config.dataset')


def model_settings(config: ml_collections.ConfigDict, platform: str | None = None) -> TransformerConfig:
  """config.model with its 'auto' choices made for `platform` (unknown fields are one-line errors)."""
  platform, model = platform or platforms.current(), config.model
  fields = {f.name for f in dataclasses.fields(TransformerConfig)}
  unknown = sorted(set(model) - fields)
  if unknown:
    raise ConfigError(f'config.model.{unknown[0]}: unknown field; known fields are {sorted(fields)}')
  values = dict(model)  # other values of these two fields: TransformerConfig's one-line error
  if values.get('dropout_masks', 'auto') == 'auto':
    values['dropout_masks'] = platforms.dropout_masks(platform)
  if values.get('attention', 'auto') == 'auto':
    values['attention'] = platforms.attention(values.get('dtype', 'float32'),
                                              values.get('d_model', 512) // max(values.get('num_heads', 8), 1),
                                              platform)
  return TransformerConfig(**values)


PER_PROCESS = ('process_id',)  # the config fields that differ between the processes of one run


def comparable(config: ml_collections.ConfigDict) -> dict:
  """The config as flat {'field' or 'model.field': value}, without the fields each process sets for itself:
  what every process of one run must agree on (cluster.check_same)."""
  values = json.loads(config.to_json_best_effort())
  flat = {f'model.{k}': v for k, v in values.pop('model').items()}
  flat.update((k, v) for k, v in values.items() if k not in PER_PROCESS)
  return flat


def cluster_settings(config: ml_collections.ConfigDict) -> ClusterSettings:
  """The processes' settings, for `cluster.start` (before JAX's platform is known)."""
  return _typed(ClusterSettings, config)


def resolve(config: ml_collections.ConfigDict, platform: str | None = None) -> Settings:
  """Checks `config` and makes its 'auto' choices for `platform` (default: the one JAX runs on)."""
  platform = platform or platforms.current()
  check(config)
  model = model_settings(config, platform)
  return Settings(
      platform=platform, model=model,
      data=_typed(DataSettings, config, vocab_size=model.vocab_size),
      optimizer=_typed(OptimizerSettings, config),
      decode=_typed(DecodeSettings, config, beam_top_k=platforms.top_k(config.beam_top_k, platform)),
      loop=_typed(LoopSettings, config, fused_output_loss=platforms.fused_output_loss(config.output_loss, platform),
                  mesh_shape=tuple(config.mesh_shape)),
      cluster=cluster_settings(config))


def saved(text: str) -> ml_collections.ConfigDict:
  """A workdir's config.json as a run config: keys renamed since take their new names; fields added since
  take the value those runs had (e.g. no skipped steps, the inverse-sqrt decay)."""
  values = json.loads(text)
  for old, new in RENAMED.items():
    *parent, old_key = old.split('.')
    *_, new_key = new.split('.')
    holder = values.get(parent[0], {}) if parent else values
    if old_key in holder and new_key not in holder:
      holder[new_key] = holder.pop(old_key)
  for key, value in ADDED.items():
    *parent, name = key.split('.')
    holder = values.setdefault(parent[0], {}) if parent else values
    holder.setdefault(name, value)
  if 'mesh_shape' in values:
    values['mesh_shape'] = tuple(values['mesh_shape'])
  return ml_collections.ConfigDict(values)
