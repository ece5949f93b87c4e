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
  with pytest.raises(ArgumentError, match='^beam= is not a decoding setting; the decoding settings are beam_size, '):
    DecodeSettings().replace(beam=2)


def test_translate_flags_offer_the_declared_values():
  flag_values = flags.FlagValues()
  translate.define(flag_values, ['translate'])
  declared = {f.name: f.metadata['choices'] for f in dataclasses.fields(DecodeSettings)}
  for name in ('beam_stop', 'bleu_tokenize'):
    assert tuple(flag_values[name].parser.enum_values) == declared[name]
  assert set(translate.DECODING_FLAGS) <= set(declared)
  assert decoding_settings.BLEU_TOKENIZERS == declared['bleu_tokenize']
