"""Shared fixtures. Eight host CPU devices so sharded code paths run on CPU."""

import os

os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=8')
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.config.set_visible_devices([], 'GPU')

# Tests compile many identical programs (same tiny model, fresh jit objects): a persistent
# compilation cache for the test run turns the repeats into look-ups.
jax.config.update('jax_compilation_cache_dir', os.environ.get('JAX_TEST_CACHE_DIR', '/tmp/flax_transformer_jax_cache'))
jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.5)
jax.config.update('jax_persistent_cache_min_entry_size_bytes', 0)

from configs import tiny  # noqa: E402
from flax_transformer.model import TransformerConfig  # noqa: E402


@pytest.fixture
def tiny_config():
  return tiny.get_config()


@pytest.fixture
def small_model_config():
  """Small enough for seconds, wide enough that heads/FFN/vocab split 4 ways."""
  return TransformerConfig(vocab_size=64, d_model=32, num_heads=4, d_ff=64, num_encoder_layers=2,
                           num_decoder_layers=2, dropout_rate=0.0, max_len=64)


def random_batch(rng: np.random.Generator, batch: int, src_len: int, tgt_len: int, vocab: int):
  """Token batches with an EOS and right padding of random length; ids 0 (pad) and 1 (eos) reserved."""
  def side(length):
    ids = rng.integers(3, vocab, size=(batch, length))
    lengths = rng.integers(2, length + 1, size=batch)
    for row, n in enumerate(lengths):
      ids[row, n - 1] = 1
      ids[row, n:] = 0
    return ids.astype(np.int32)
  return {'inputs': side(src_len), 'targets': side(tgt_len)}


@pytest.fixture
def np_rng():
  return np.random.default_rng(0)
