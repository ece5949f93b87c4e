"""What runs where: the platform check and the 'auto' choices per platform (settings.py makes them once).

Three speed-ups were measured on CPUs only; each is one config value whose 'auto' default picks the
measured path on CPU and the standard library path on GPU and TPU:
  config.model.dropout_masks  'hash' (an index hash fused into the op that applies it) | 'random'
                              (jax.random.bernoulli with config.dropout_rng_impl keys, 'rbg' by default);
  config.output_loss          'fused' (one hand-written gradient for projection + loss) | 'optax' (autodiff);
  config.beam_top_k           'two_stage' (block maxima first) | 'lax' (jax.lax.top_k).
Attention goes through `jax.nn.dot_product_attention` ('xla', or 'cudnn': its fused kernel) unless
`config.model.attention='explicit'` (attention.py's own softmax and products); 'auto' asks for cuDNN's kernel on
GPUs in bf16 (where cuDNN takes the head size) and for XLA elsewhere.
"""

import os

import jax

from flax_transformer.decoding_settings import TOP_K
from flax_transformer.errors import ConfigError

PLATFORMS = ('cpu', 'gpu', 'tpu')
DROPOUT_MASKS = ('hash', 'random')
ATTENTION = ('xla', 'cudnn', 'explicit')
OUTPUT_LOSS = ('fused', 'optax')


def current() -> str:
  """The platform JAX computes on: 'cpu', 'gpu' or 'tpu' (ROCm counts as 'gpu')."""
  backend = jax.default_backend()
  return 'gpu' if backend in ('cuda', 'rocm') else backend


def check_name(wanted: str) -> None:
  """`config.platform` is '' or a platform's name."""
  if wanted not in ('',) + PLATFORMS:
    raise ConfigError(f"config.platform={wanted!r}: unknown value; use '', {', '.join(map(repr, PLATFORMS))}")


def check(wanted: str) -> None:
  """`config.platform`: '' accepts whatever JAX finds; 'gpu' or 'tpu' refuses to run anywhere else."""
  check_name(wanted)
  if wanted and current() != wanted:
    raise ConfigError(f'config.platform={wanted!r} but JAX finds only {current()} devices '
                      f'({jax.devices()[0].device_kind}); install jax for {wanted} (README: Install) '
                      f"or set --config.platform=''")


def dropout_masks(platform: str) -> str:
  return 'hash' if platform == 'cpu' else 'random'


def fused_output_loss(value: str, platform: str) -> bool:
  """config.output_loss: 'fused' -> True, 'optax' -> False, 'auto' -> fused on CPU only."""
  if value == 'auto':
    return platform == 'cpu'
  if value not in OUTPUT_LOSS:
    raise ConfigError(f"config.output_loss={value!r}: unknown value; use one of {', '.join(OUTPUT_LOSS)}, 'auto'")
  return value == 'fused'


def top_k(value: str, platform: str) -> str:
  """config.beam_top_k: 'auto' -> 'two_stage' on CPU only, else as given."""
  if value == 'auto':
    return 'two_stage' if platform == 'cpu' else 'lax'
  if value not in TOP_K:
    raise ConfigError(f"config.beam_top_k={value!r}: unknown value; use one of {', '.join(TOP_K)}, 'auto'")
  return value


def attention(dtype: str, head_size: int, platform: str) -> str:
  """config.model.attention='auto': cuDNN's flash attention takes bf16/fp16 with head sizes that are multiples
  of 8 up to 128."""
  if platform == 'gpu' and dtype == 'bfloat16' and head_size % 8 == 0 and head_size <= 128:
    return 'cudnn'
  return 'xla'


def enable_compilation_cache() -> None:
  """Persists compiled programs (one per batch shape) in the user's cache folder (or $JAX_COMPILATION_CACHE_DIR),
  so a restarted training run, and every translation after the first, skip recompiling; the programs call it."""
  directory = os.environ.get('JAX_COMPILATION_CACHE_DIR') or os.path.join(
      os.path.expanduser('~'), '.cache', 'flax_transformer', 'jax')
  jax.config.update('jax_compilation_cache_dir', directory)
  if 'JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS' not in os.environ:  # the environment's own choice stands
    jax.config.update('jax_persistent_cache_min_compile_time_secs', 1.0)
