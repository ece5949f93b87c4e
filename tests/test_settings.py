"""The run config read once: every field checked, 'auto' made per platform, frozen settings per stage, old
config.json files loaded, and the ConfigDict kept out of the stage modules."""

import ast
import dataclasses
import json
import os

import ml_collections
import pytest

from configs import base, big, multi30k, tiny
from flax_transformer import settings
from flax_transformer.errors import ConfigError

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'flax_transformer')
# The modules that hold the whole run config: this one's subject, the loop (set-up and train_and_evaluate) and the
# programs (their command lines build it). Every other module takes its own stage's settings.
HOLDERS = {'settings.py', 'train_loop.py', 'startup.py', 'commands/train.py', 'commands/translate.py',
           'commands/__init__.py', 'commands/plan.py', 'commands/inspect_batches.py'}


@pytest.mark.parametrize('module', [base, big, multi30k, tiny])
def test_every_config_resolves_on_every_platform(module):
  for platform in ('cpu', 'gpu', 'tpu'):
    s = settings.resolve(module.get_config(), platform)
    assert s.platform == platform
    assert s.model.dropout_masks == ('hash' if platform == 'cpu' else 'random')
    assert s.decode.beam_top_k == ('two_stage' if platform == 'cpu' else 'lax')
    assert s.training.fused_output_loss is (platform == 'cpu')
    assert s.model.attention == 'xla'  # float32: cuDNN's fused attention is for bf16


def test_cudnn_attention_only_for_bf16_on_gpu_and_explicit_choices_are_kept():
  config = base.get_config()
  config.model.dtype = 'bfloat16'
  assert settings.resolve(config, 'gpu').model.attention == 'cudnn'
  assert settings.resolve(config, 'tpu').model.attention == 'xla'
  config.model.attention, config.model.dropout_masks, config.beam_top_k, config.output_loss = (
      'explicit', 'random', 'lax', 'optax')
  s = settings.resolve(config, 'cpu')
  assert (s.model.attention, s.model.dropout_masks, s.decode.beam_top_k, s.training.fused_output_loss) == (
      'explicit', 'random', 'lax', False)


def test_stage_settings_are_frozen_and_carry_the_config_values():
  config = multi30k.get_config()
  s = settings.resolve(config, 'cpu')
  assert s.data.max_train_length == config.max_train_length and s.data.vocab_size == config.model.vocab_size
  assert s.optimizer.warmup_steps == config.warmup_steps and s.training.mesh_shape == tuple(config.mesh_shape)
  for stage in (s, s.model, s.data, s.optimizer, s.decode, s.training, s.cluster):
    with pytest.raises(dataclasses.FrozenInstanceError):
      setattr(stage, dataclasses.fields(stage)[0].name, None)


@pytest.mark.parametrize('field, value, message', [
    ('num_train_steps', '100', "config.num_train_steps='100': must be a positive integer"),
    ('num_train_steps', 0, 'config.num_train_steps=0: must be a positive integer'),
    ('beam_size', True, 'config.beam_size=True: must be a positive integer'),
    ('max_extra_length', -1, 'config.max_extra_length=-1: must be a non-negative integer'),
    ('label_smoothing', 1.0, r'config.label_smoothing=1.0: must be in \[0, 1\)'),
    ('label_smoothing', '0.1', "config.label_smoothing='0.1': must be a float"),
    ('adam_eps', 0.0, 'config.adam_eps=0.0: must be positive'),
    ('bleu_tokenize', 'moses', "config.bleu_tokenize='moses': must be one of 13a"),
    ('output_loss', 'fast', "config.output_loss='fast': must be one of fused, optax, auto"),
    ('platform', 'cuda', "config.platform='cuda': unknown value"),
    ('restore_data_state', 'yes', "config.restore_data_state='yes': must be a bool"),
    ('source_lang', 3, 'config.source_lang=3: must be a str'),
    ('keep_checkpoints', 2, 'config.keep_checkpoints=2 is below config.average_last=5'),
])
def test_a_bad_field_is_a_one_line_error_naming_it(field, value, message):
  config = ml_collections.ConfigDict({**base.get_config().to_dict(), field: value})  # as a config.json may hold it
  with pytest.raises(ConfigError, match=message) as error:
    settings.resolve(config, 'cpu')
  assert '\n' not in str(error.value)


def test_a_missing_field_and_an_unknown_model_field_are_one_line_errors():
  config = base.get_config()
  with config.unlocked():
    del config['warmup_steps']
  with pytest.raises(ConfigError, match=r'config.warmup_steps is missing; add it'):
    settings.resolve(config, 'cpu')
  config = base.get_config()
  with config.unlocked():
    config.model.hidden_size = 3
  with pytest.raises(ConfigError, match='config.model.hidden_size: unknown field'):
    settings.resolve(config, 'cpu')


def test_an_older_config_json_loads_with_its_old_names_and_the_values_its_run_had():
  current = json.loads(tiny.get_config().to_json())
  old = json.loads(json.dumps(current))
  old['max_length'], old['eval_max_length'] = old.pop('max_train_length'), old.pop('max_eval_length')
  old['model']['max_len'] = old['model'].pop('max_positions')
  for key in ('max_skipped_steps', 'lr_decay', 'bleu_tokenize', 'beam_top_k', 'output_loss', 'init_from'):
    del old[key]
  for key in ('dropout_masks', 'attention'):
    del old['model'][key]
  loaded = settings.saved(json.dumps(old))
  assert loaded.max_train_length == current['max_train_length']
  assert loaded.max_eval_length == current['max_eval_length']
  assert loaded.model.max_positions == current['model']['max_positions']
  s = settings.resolve(loaded, 'cpu')
  assert s.optimizer.max_skipped_steps == 0  # those runs skipped no step; configs now say 5
  assert (s.optimizer.lr_decay, s.decode.bleu_tokenize, s.decode.beam_top_k) == ('inverse_sqrt', '13a', 'two_stage')
  assert settings.resolve(settings.saved(json.dumps(current)), 'cpu') == settings.resolve(tiny.get_config(), 'cpu')


def _python_files():
  for directory, _, names in os.walk(PACKAGE):
    for name in names:
      if name.endswith('.py'):
        path = os.path.join(directory, name)
        yield os.path.relpath(path, PACKAGE), ast.parse(open(path).read())


def test_the_run_config_stops_at_the_config_module_and_the_loop():
  """No stage module takes a `config` argument or falls back with config.get(...): each takes its settings."""
  found = []
  for name, tree in _python_files():
    for node in ast.walk(tree):
      if isinstance(node, (ast.FunctionDef, ast.Lambda)) and name not in HOLDERS:
        found += [f'{name}: {getattr(node, "name", "lambda")}({a.arg})' for a in node.args.args if a.arg == 'config']
      if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == 'get'
          and 'config' in ast.unparse(node.func.value) and name != 'settings.py'):
        found.append(f'{name}:{node.lineno}: {ast.unparse(node)}')
  assert not found, found


def test_auto_is_resolved_only_by_the_config_module():
  """The platform's choice functions are called from settings.py alone (once per run)."""
  callers = set()
  for name, tree in _python_files():
    for node in ast.walk(tree):
      if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == 'platforms'
          and node.attr in ('dropout_masks', 'attention', 'top_k', 'fused_output_loss')):
        callers.add(name)
  assert callers == {'settings.py'}
