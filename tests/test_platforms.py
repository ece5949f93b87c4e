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


@pytest.mark.accelerator
@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
def test_the_train_step_on_the_accelerator_tracks_the_cpu(dtype):
  """On the GPU or TPU, with the choices settings.py makes there (cuDNN attention for bf16 on a GPU, random
  dropout masks, lax top-k, autodiff loss): three train steps of the tiny config against the same steps on
  the host CPU, in float32; with bfloat16 on the accelerator, within bf16's error."""
  import functools

  import jax
  import numpy as np

  from configs import tiny
  from flax_transformer import partitioning, platforms, settings, steps, train_state
  from tests.conftest import random_batch
  config = tiny.get_config()
  config.model.dropout_rate = 0.0  # the masks differ between the platforms' generators
  accelerator = platforms.current()
  assert accelerator in ('gpu', 'tpu'), 'TEST_ON_ACCELERATOR=1 on a machine whose JAX sees no accelerator'
  batch = random_batch(np.random.default_rng(0), 16, 12, 11, config.model.vocab_size)
  losses = {}
  for platform, devices in ((accelerator, jax.devices()[:1]), ('cpu', jax.devices('cpu')[:1])):
    with config.unlocked():
      config.model.dtype = dtype if platform == accelerator else 'float32'
    s = settings.resolve(config, platform)
    mesh = partitioning.create_mesh((1, 1, 1), devices)
    state, shardings = train_state.create_train_state(s.model, s.optimizer, mesh, jax.random.key(0))
    step = partitioning.jit_train_step(functools.partial(
        steps.train_step, model_config=s.model, label_smoothing=s.training.label_smoothing,
        fused_output_loss=s.training.fused_output_loss), mesh, shardings)
    losses[platform] = []
    for _ in range(3):
      state, metrics = step(state, batch, jax.random.key(1))
      losses[platform].append(float(metrics['loss']))
  np.testing.assert_allclose(losses[accelerator], losses['cpu'], rtol=1e-3 if dtype == 'float32' else 3e-2)
