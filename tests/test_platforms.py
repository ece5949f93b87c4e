"""What runs where: the platform check and each platform's 'auto' choice (settings.py makes them once)."""

import pytest

from flax_transformer.model import TransformerConfig


def test_auto_choices_follow_the_platform():
  from flax_transformer import platforms
  assert TransformerConfig(vocab_size=64, d_model=32, num_heads=4).dropout_masks == 'hash'  # tests run on CPU
  assert TransformerConfig(vocab_size=64, d_model=32, num_heads=4).attention == 'xla'
  assert [platforms.dropout_masks(p) for p in ('cpu', 'gpu', 'tpu')] == ['hash', 'random', 'random']
  assert [platforms.top_k('auto', p) for p in ('cpu', 'gpu', 'tpu')] == ['two_stage', 'lax', 'lax']
  assert [platforms.fused_output_loss('auto', p) for p in ('cpu', 'gpu', 'tpu')] == [True, False, False]
  assert platforms.fused_output_loss('optax', 'cpu') is False and platforms.fused_output_loss('fused', 'gpu') is True
  assert platforms.attention('bfloat16', 64, 'gpu') == 'cudnn'
  assert platforms.attention('float32', 64, 'gpu') == 'xla'
  assert platforms.attention('bfloat16', 64, 'tpu') == 'xla'
  assert platforms.attention('bfloat16', 256, 'gpu') == 'xla'  # beyond cuDNN's head sizes


def test_a_platform_that_is_absent_is_a_one_line_error():
  from flax_transformer import platforms
  from flax_transformer.errors import ConfigError
  platforms.check('')
  platforms.check('cpu')
  with pytest.raises(ConfigError, match=r"config.platform='gpu' but JAX finds only cpu devices .*install jax"):
    platforms.check('gpu')
  with pytest.raises(ConfigError, match="config.platform='cuda': unknown value"):
    platforms.check('cuda')
