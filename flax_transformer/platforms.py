"""What runs where: the platform check, the 'auto' choices per platform, and the start-up banner.

Three speed-ups were measured on CPUs only; each is one config value whose 'auto' default picks the
measured path on CPU and the standard library path on GPU and TPU:
  config.model.dropout_masks  'hash' (an index hash fused into the op that applies it) | 'random'
                              (jax.random.bernoulli with config.dropout_rng_impl keys, 'rbg' by default);
  config.output_loss          'fused' (one hand-written gradient for projection + loss) | 'optax' (autodiff);
  config.beam_top_k           'two_stage' (block maxima first) | 'lax' (jax.lax.top_k).
Attention always goes through `jax.nn.dot_product_attention`; `config.model.attention='auto'` asks it
for cuDNN's fused kernel on GPUs in bf16 (where cuDNN takes the head size) and for XLA elsewhere.
"""

import contextlib
import math
import os

import jax

from flax_transformer.errors import ConfigError

PLATFORMS = ('cpu', 'gpu', 'tpu')
DROPOUT_MASKS = ('hash', 'random')
ATTENTION = ('xla', 'cudnn', 'explicit')
TOP_K = ('two_stage', 'lax')
OUTPUT_LOSS = ('fused', 'optax')


def current() -> str:
  """The platform JAX computes on: 'cpu', 'gpu' or 'tpu' (ROCm counts as 'gpu')."""
  backend = jax.default_backend()
  return 'gpu' if backend in ('cuda', 'rocm') else backend


def check(wanted: str) -> None:
  """`config.platform`: '' accepts whatever JAX finds; 'gpu' or 'tpu' refuses to run anywhere else."""
  if wanted not in ('',) + PLATFORMS:
    raise ConfigError(f"config.platform={wanted!r}: unknown value; use '', {', '.join(map(repr, PLATFORMS))}")
  if wanted and current() != wanted:
    raise ConfigError(f'config.platform={wanted!r} but JAX finds only {current()} devices '
                      f'({jax.devices()[0].device_kind}); install jax for {wanted} (README: Install) '
                      f"or set --config.platform=''")


def dropout_masks(platform: str | None = None) -> str:
  return 'hash' if (platform or current()) == 'cpu' else 'random'


def fused_output_loss(value: str, platform: str | None = None) -> bool:
  """config.output_loss: 'fused' -> True, 'optax' -> False, 'auto' -> fused on CPU only."""
  if value == 'auto':
    return (platform or current()) == 'cpu'
  if value not in OUTPUT_LOSS:
    raise ConfigError(f"config.output_loss={value!r}: unknown value; use one of {', '.join(OUTPUT_LOSS)}, 'auto'")
  return value == 'fused'


def top_k(value: str, platform: str | None = None) -> str:
  if value == 'auto':
    return 'two_stage' if (platform or current()) == 'cpu' else 'lax'
  if value not in TOP_K:
    raise ConfigError(f"config.beam_top_k={value!r}: unknown value; use one of {', '.join(TOP_K)}, 'auto'")
  return value


def attention(dtype: str, head_size: int, platform: str | None = None) -> str:
  """cuDNN's flash attention takes bf16/fp16 with head sizes that are multiples of 8 up to 128."""
  if (platform or current()) == 'gpu' and dtype == 'bfloat16' and head_size % 8 == 0 and head_size <= 128:
    return 'cudnn'
  return 'xla'


def banner(config, model_config, mesh, num_params: int, num_batch_shapes: int, fused_output_loss: bool,
           cluster_kind: str = 'single process') -> str:
  """What this run is on and what it will compile, printed before the first compilation."""
  devices = mesh.devices.flatten()
  dp = math.prod(mesh.shape[a] for a in ('data', 'fsdp'))
  lines = [
      f'platform: {current()} ({devices[0].device_kind}), {devices.size} devices '
      f'({jax.local_device_count()} on this process); process {jax.process_index()} of {jax.process_count()}',
      f'cluster: {cluster_kind}',
      f'mesh: {" x ".join(f"{name}={size}" for name, size in mesh.shape.items())}',
      f'model: {num_params:,} parameters (float32), compute dtype {model_config.dtype}, attention '
      f'{model_config.attention}, dropout masks {model_config.dropout_masks}, '
      f'{"fused" if fused_output_loss else "optax"} output loss, beam top-k {top_k(config.beam_top_k)}',
      f'batch: {config.tokens_per_batch:,} tokens per side per step globally, {config.tokens_per_batch // dp:,} '
      f'per data-parallel device, {config.gradient_accumulation_steps} micro-batch(es); '
      f'{num_batch_shapes} batch shapes to compile',
  ]
  return '\n'.join(lines)


@contextlib.contextmanager
def _stderr_silenced():
  """Sends file descriptor 2 (C++ logging included) to /dev/null inside the block."""
  saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
  os.dup2(devnull, 2)
  try:
    yield
  finally:
    os.dup2(saved, 2)
    os.close(saved)
    os.close(devnull)


def import_tensorflow_quietly():
  """Imports TensorFlow (tf.data only) with its C++ start-up lines silenced, and hides accelerators from it
  so tf.data never takes GPU or TPU memory. Call before anything else imports TensorFlow."""
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  with _stderr_silenced():  # CUDA probing and absl's pre-initialisation notices are written from C++
    import tensorflow as tf
    try:
      tf.config.set_visible_devices([], 'GPU')
      if tf.config.list_physical_devices('TPU'):
        tf.config.set_visible_devices([], 'TPU')
    except RuntimeError:  # TensorFlow's devices are initialised already (an earlier call did this)
      pass
  return tf
