"""Decoding's settings in one place: the paper's defaults, the checks every caller gets, and the values
translate.py's flags offer, all read from DecodeSettings' declarations."""

import dataclasses

import pytest
from absl import flags

from configs import base
from flax_transformer import decoding_settings
from flax_transformer.commands import translate
from flax_transformer.decoding_settings import DecodeSettings
from flax_transformer.errors import ArgumentError, ConfigError


def test_the_defaults_are_the_papers_and_the_base_configs():
  config = base.get_config()
  for field in dataclasses.fields(DecodeSettings):
    assert config[field.name] == field.default, field.name  # configs/base.py cannot drift from the one declaration
  assert (DecodeSettings().beam_size, DecodeSettings().length_penalty_alpha, DecodeSettings().max_extra_length) == \
      (4, 0.6, 50)  # §6.1


@pytest.mark.parametrize('changes,message', [
    ({'length_penalty_alpha': float('nan')}, r'^length_penalty_alpha=nan: must be in \[0, inf\)'),
    ({'length_penalty_alpha': float('inf')}, r'^length_penalty_alpha=inf: must be in \[0, inf\)'),
    ({'max_extra_length': -5}, '^max_extra_length=-5: must be a non-negative integer'),
    ({'beam_size': 0}, '^beam_size=0: must be a positive integer'),
    ({'beam_stop': 'sometimes'}, "^beam_stop='sometimes': must be one of bound, beam_ended"),
    ({'eval_tokens_per_batch': 2.5}, '^eval_tokens_per_batch=2.5: must be a positive integer'),
])
def test_every_value_is_checked_once_for_every_caller(changes, message):
  with pytest.raises(ConfigError, match=message):
    DecodeSettings().replace(**changes)


def test_replace_keeps_what_is_not_given_and_refuses_a_name_it_does_not_know():
  changed = DecodeSettings().replace(beam_size=1, length_penalty_alpha=None)
  assert (changed.beam_size, changed.length_penalty_alpha) == (1, 0.6)
  with pytest.raises(ArgumentError, match='^beam= is not a decoding setting; the decoding settings are strategy, beam_size, '):
    DecodeSettings().replace(beam=2)


def test_translate_flags_offer_the_declared_values():
  flag_values = flags.FlagValues()
  translate.define(flag_values, ['translate'])
  declared = {f.name: f.metadata['choices'] for f in dataclasses.fields(DecodeSettings)}
  for name in ('beam_stop', 'bleu_tokenize'):
    assert tuple(flag_values[name].parser.enum_values) == declared[name]
  assert set(translate.DECODING_FLAGS) <= set(declared)
  assert decoding_settings.BLEU_TOKENIZERS == declared['bleu_tokenize']


def test_every_strategy_a_setting_names_is_registered_and_each_is_built_from_the_settings():
  from flax_transformer import search
  assert sorted(search.STRATEGIES) == sorted(decoding_settings.STRATEGIES)
  built = {name: search.strategy_for(DecodeSettings(strategy=name, beam_top_k='lax')) for name in search.STRATEGIES}
  assert isinstance(built['beam'], search.BeamSearch) and isinstance(built['greedy'], search.GreedySearch)
  assert built['sampling'] == search.SamplingSearch(1, 1.0, 0, 1.0) and built['sampling'].random
  assert search.strategy_for(DecodeSettings(beam_top_k='lax'), prefixed=True).prefixed
  assert search.strategy_for(DecodeSettings(strategy='sampling', num_samples=3, top_p=0.5), 5).num_samples == 5
  with pytest.raises(ArgumentError, match=r"^top_p=0.5 is a setting of sampling and the strategy is 'greedy'"):
    DecodeSettings(strategy='greedy').replace(top_p=0.5)


def test_a_decoding_setting_given_a_flag_or_a_request_field_is_one_from_its_declaration_alone():
  """translate.py's and the server's flags and the /translate fields come from DecodeSettings' declarations:
  a new decoding setting declared `given=CALLS` is all three without another line."""
  from flax_transformer import server
  from flax_transformer.commands import serve, translate
  declared = {f.name: f for f in dataclasses.fields(decoding_settings.DecodeSettings)}
  for define in (translate.define, serve.define):
    values = flags.FlagValues()
    define(values, [])
    for name in decoding_settings.given('flag'):
      assert values[name].default is None and declared[name].metadata['doc'] in values[name].help
      assert getattr(values[name].parser, 'enum_values', None) == (list(declared[name].metadata['choices'])
                                                                    if declared[name].metadata['choices'] else None)
  request = server.TranslateRequest.model_fields
  assert set(decoding_settings.given('request')) <= set(request)
  for name in decoding_settings.given('request'):
    assert request[name].description.startswith(declared[name].metadata['doc']) and request[name].default is None
  assert set(server.DECODING) | {'beam_size'} == set(decoding_settings.given('request'))
