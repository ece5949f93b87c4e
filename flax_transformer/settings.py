"""The run config, read once: `resolve(config, platform)` checks every field against its stage's declaration
(one-line errors naming the field and the fix), makes every 'auto' choice for the platform, and hands each
stage its own frozen settings. `saved(text)` reads a workdir's config.json, older ones included (keys renamed
since, fields added since). The ConfigDict goes no further than this module and the loop (startup.py,
train_loop.py) and the programs.

Each stage's settings live with the stage, every field declared once (settings_fields.setting: type, description,
allowed values, the value older runs had); this module only assembles them:
  Settings.model      model.TransformerConfig          (config.model)
  Settings.data       parallel_text.DataSettings       sources, vocabulary, lengths, batches
  Settings.optimizer  optim.OptimizerSettings          Adam, the schedule, clipping, skipped steps
  Settings.decode     decoding_settings.DecodeSettings beam search and BLEU
  Settings.training   TrainingSettings (below)         steps, intervals, checkpoints, the loss guard, seeds
  Settings.cluster    cluster.ClusterSettings          processes and their timeouts
Training's own settings are declared here: the modules of the training loop sit above this one.
"""

import dataclasses
import json
import typing

import ml_collections

from flax_transformer import decoding_settings, parallel_text, platforms, settings_fields
from flax_transformer.cluster import ClusterSettings
from flax_transformer.decoding_settings import DecodeSettings
from flax_transformer.errors import ConfigError
from flax_transformer.settings_fields import setting
from flax_transformer.model import TransformerConfig
from flax_transformer.optim import OptimizerSettings
from flax_transformer.parallel_text import DataSettings

BEST_METRICS = ('bleu', 'loss')  # validation metrics a checkpoint can be chosen by

# Saved config.json keys renamed since: old -> new (a dotted key is under config.model).
RENAMED = {
    'max_length': 'max_train_length',
    'eval_max_length': 'max_eval_length',
    'model.max_len': 'model.max_positions',
}


@dataclasses.dataclass(frozen=True)
class TrainingSettings:
  """Training's own settings (startup.py, hooks.py, train_loop.py): steps, intervals, checkpoints, the loss and
  its guard, seeds, the device mesh; config fields of these names."""
  num_train_steps: int = setting('= config.num_train_steps (OptimizerSettings).', derived=True)
  checkpoint_every_steps: int = setting('Steps between checkpoints (also on the last step and on a signal).',
                                        minimum=1)
  keep_checkpoints: int = setting('Newest checkpoints kept (§6.1 averages the last 5 of base, 20 of big).',
                                  minimum=1)
  keep_best: int = setting('Best checkpoints kept by best_metric beside the newest keep_checkpoints (0: none); '
                           'a checkpoint is then written at every evaluation.', minimum=0, before=0)
  best_metric: str = setting("What keep_best and early stopping judge: validation 'bleu' (higher is better) or "
                             "'loss' (lower); of the weights' average when ema_decay > 0.", choices=BEST_METRICS,
                             before='bleu')
  early_stopping_evaluations: int = setting('End the run (exit 0) after this many evaluations without an '
                                            'improvement of best_metric (0: never).', minimum=0, before=0)
  eval_every_steps: int = setting('Steps between validation loss and BLEU.', minimum=1)
  log_every_steps: int = setting('Steps between progress lines and TensorBoard scalars.', minimum=1)
  num_eval_bleu_sentences: int = setting('Validation sentences translated for BLEU at each evaluation (0: none).',
                                         minimum=0, before=0)
  average_last: int = setting('§6.1: checkpoints averaged for the final model.', minimum=0)
  max_skipped_steps: int = setting('= config.max_skipped_steps (OptimizerSettings).', derived=True)
  loss_spike_factor: float = setting('The run stops when the loss stays above this many times its running median '
                                     '... (0: never).', minimum=0, before=0.0)
  loss_spike_steps: int = setting('... for this many consecutive steps.', minimum=0, before=20)
  label_smoothing: float = setting('§5.4 label smoothing ε_ls (0.1).', low=0.0, high=1.0)
  gradient_accumulation_steps: int = setting('= config.gradient_accumulation_steps (DataSettings).', derived=True)
  seed: int = setting("The run's seed: initialisation, dropout and the data stream.")
  dropout_rng_impl: str = setting('Key generator for dropout seeds (and for every mask with random dropout masks).',
                                  choices=('rbg', 'unsafe_rbg', 'threefry2x32'), before='rbg')
  restore_data_state: bool = setting('False: a resumed run restarts the data stream.', before=True)
  init_from: str = setting("'WORKDIR[:STEP]': fine-tune, starting from that run's parameters and vocabulary.",
                           before='')
  platform: str = setting("'' runs on whatever JAX finds; 'gpu' or 'tpu' refuses to start anywhere else.",
                          check=platforms.check_name, before='')
  mesh_shape: tuple = setting('(data, fsdp, model); -1 takes the remaining devices.')
  output_loss: str = setting("'fused': one hand-written gradient for projection + loss (faster on CPU); 'optax': "
                             "autodiff; 'auto': by platform.", choices=platforms.OUTPUT_LOSS + ('auto',),
                             before='auto')
  storage_timeout_seconds: int = setting('A checkpoint save or metrics write still unfinished after this stops '
                                         'the run.', minimum=1, before=300)

  @property
  def fused_output_loss(self) -> bool:
    return self.output_loss == 'fused'


@dataclasses.dataclass(frozen=True)
class Settings:
  """Every stage's settings of one run on one platform (`resolve`)."""
  platform: str
  model: TransformerConfig
  data: DataSettings
  optimizer: OptimizerSettings
  decode: DecodeSettings
  training: TrainingSettings
  cluster: ClusterSettings


STAGES = (DataSettings, OptimizerSettings, DecodeSettings, TrainingSettings, ClusterSettings)


def _declared() -> dict[str, dataclasses.Field]:
  """Every config field (top level) with its one declaration (a stage's field that is not derived)."""
  return {f.name: f for stage in STAGES for f in dataclasses.fields(stage) if not f.metadata.get('derived')}


def added() -> dict[str, object]:
  """Fields added since the first config.json files, with the value those runs had ('model.' for the model)."""
  values = {name: f.metadata['before'] for name, f in _declared().items()
            if f.metadata['before'] is not settings_fields.NEW}
  values.update((f'model.{f.name}', f.metadata['before']) for f in dataclasses.fields(TransformerConfig)
                if f.metadata.get('before', settings_fields.NEW) is not settings_fields.NEW)
  return values


def _fail(field: str, value, why: str) -> typing.NoReturn:
  raise ConfigError(f'config.{field}={value!r}: {why}')


def check(config: ml_collections.ConfigDict) -> None:
  """Every field of the run config is there and can work: each against its declaration (type, range,
  choices), then the rules between fields and the model's own checks (TransformerConfig); nothing here
  touches JAX, so it runs before a multi-process start."""
  declared = _declared()
  for name in sorted(set(declared) | {'model'}):
    if name not in config:
      raise ConfigError(f'config.{name} is missing; add it to the config (configs/base.py sets every field)')
  for name, field in declared.items():
    why = settings_fields.problem(field, config[name])
    if why:
      _fail(name, config[name], why)
    if field.metadata['check']:
      field.metadata['check'](config[name])
  decoding_settings.check({name: config[name] for name in ('strategy', *decoding_settings.SAMPLING)},
                          lambda name: f'config.{name}')  # sampling's settings with sampling only
  if not isinstance(config.cooldown_steps, int) or not 0 <= config.cooldown_steps <= config.num_train_steps:
    _fail('cooldown_steps', config.cooldown_steps,
          f'must be an integer from 0 (no cooldown) to config.num_train_steps={config.num_train_steps}')
  if config.coordinator_address and not config.process_id < config.num_processes:
    raise ConfigError(f'config.process_id={config.process_id} is outside 0..{config.num_processes - 1} '
                      f'(config.num_processes={config.num_processes}); give each process its own id')
  if config.keep_checkpoints < config.average_last:
    raise ConfigError(f'config.keep_checkpoints={config.keep_checkpoints} is below config.average_last='
                      f'{config.average_last}; keep at least as many checkpoints as are averaged')
  if (config.keep_best or config.early_stopping_evaluations) and config.best_metric == 'bleu' and \
      not config.num_eval_bleu_sentences:
    raise ConfigError("config.best_metric='bleu' but config.num_eval_bleu_sentences=0 computes no BLEU; translate "
                      "some validation sentences (e.g. --config.num_eval_bleu_sentences=500) or judge by "
                      "--config.best_metric=loss")
  parallel_text.source_for(_data(config, config.model.vocab_size)).check()


def model_settings(config: ml_collections.ConfigDict, platform: str | None = None) -> TransformerConfig:
  """config.model with its 'auto' choices made for `platform` (unknown fields are one-line errors)."""
  platform, model = platform or platforms.current(), config.model
  known = {f.name for f in dataclasses.fields(TransformerConfig)}
  unknown, missing = sorted(set(model) - known), sorted(known - set(model))
  if unknown:
    raise ConfigError(f'config.model.{unknown[0]}: unknown field; known fields are {sorted(known)}')
  if missing:
    raise ConfigError(f'config.model.{missing[0]} is missing; add it to the config (configs/base.py sets every field)')
  values = dict(model)  # other values of these two fields: TransformerConfig's one-line error
  if values['dropout_masks'] == 'auto':
    values['dropout_masks'] = platforms.dropout_masks(platform)
  if values['attention'] == 'auto':
    values['attention'] = platforms.attention(values['dtype'], values['d_model'] // max(values['num_heads'], 1),
                                              platform)
  return TransformerConfig(**values)


def _stage(cls, config: ml_collections.ConfigDict, **given):
  """cls built from the config's fields of the same names (`given` first, for derived fields and choices)."""
  return cls(**{f.name: given[f.name] if f.name in given else settings_fields.typed(f, config[f.name])
                for f in dataclasses.fields(cls)})


def _shared(config: ml_collections.ConfigDict) -> dict:
  """The derived fields that repeat another stage's field of the same name."""
  return {'num_train_steps': config.num_train_steps, 'max_skipped_steps': config.max_skipped_steps,
          'gradient_accumulation_steps': config.gradient_accumulation_steps, 'seed': config.seed,
          'eval_tokens_per_batch': config.eval_tokens_per_batch}


def _data(config: ml_collections.ConfigDict, vocab_size: int) -> DataSettings:
  return _stage(DataSettings, config, vocab_size=vocab_size, **_shared(config))


def decoding_for(decoding: DecodeSettings, platform: str | None = None) -> DecodeSettings:
  """`decoding` with its 'auto' choice (the top-k path) made for `platform` (default: the one JAX runs on)."""
  top_k = platforms.top_k(decoding.beam_top_k, platform or platforms.current())
  return dataclasses.replace(decoding, beam_top_k=top_k)


def cluster_settings(config: ml_collections.ConfigDict) -> ClusterSettings:
  """The processes' settings, for `cluster.start` (before JAX's platform is known)."""
  return _stage(ClusterSettings, config)


def resolve(config: ml_collections.ConfigDict, platform: str | None = None, checked: bool = False) -> Settings:
  """Checks `config` (unless `checked`: check() has) and makes its 'auto' choices for `platform` (default: the
  one JAX runs on)."""
  platform = platform or platforms.current()
  if not checked:
    check(config)
  model = model_settings(config, platform)
  return Settings(
      platform=platform, model=model, data=_data(config, model.vocab_size),
      optimizer=_stage(OptimizerSettings, config),
      decode=decoding_for(_stage(DecodeSettings, config), platform),
      training=_stage(TrainingSettings, config, **_shared(config),
                      output_loss='fused' if platforms.fused_output_loss(config.output_loss, platform) else 'optax'),
      cluster=cluster_settings(config))


PER_PROCESS = ('process_id',)  # the config fields that differ between the processes of one run


def comparable(config: ml_collections.ConfigDict) -> dict:
  """The config as flat {'field' or 'model.field': value}, without the fields each process sets for itself:
  what every process of one run must agree on (cluster.check_same)."""
  values = json.loads(config.to_json_best_effort())
  flat = {f'model.{k}': v for k, v in values.pop('model').items()}
  flat.update((k, v) for k, v in values.items() if k not in PER_PROCESS)
  return flat


def to_json(config: ml_collections.ConfigDict, **changes) -> str:
  """The config as a workdir's config.json holds it, with `changes` (top-level fields) made."""
  values = json.loads(config.to_json_best_effort())
  values.update(changes)
  return json.dumps(values, indent=2)


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
  for key, value in added().items():
    *parent, name = key.split('.')
    holder = values.setdefault(parent[0], {}) if parent else values
    holder.setdefault(name, value)
  if 'mesh_shape' in values:
    values['mesh_shape'] = tuple(values['mesh_shape'])
  return ml_collections.ConfigDict(values)
