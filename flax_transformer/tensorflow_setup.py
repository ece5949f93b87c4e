"""TensorFlow serves tf.data alone: imported with its C++ start-up lines silenced and with accelerators hidden
from it, so it never takes GPU or TPU memory from JAX."""

import contextlib
import os


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


def import_quietly():
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
