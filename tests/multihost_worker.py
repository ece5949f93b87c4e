"""One process of a multi-host run on localhost (used by tests/test_partitioning.py).

python tests/multihost_worker.py PROCESS_ID NUM_PROCESSES PORT OUTPUT_JSON
Each process holds 8/NUM_PROCESSES CPU devices and feeds its rows of the same global batch; process 0 writes
the losses. The single-process reference is `three_steps(0, 1)`, called in the test's own 8-device process.
"""

import functools
import json
import os
import sys


def three_steps(process_id: int, num_processes: int) -> list[float]:
  """The losses of 3 train steps of configs/tiny.py on mesh (4, 2, 1) over 8 devices, this process
  feeding its contiguous block of rows of one fixed global batch."""
  import jax
  import numpy as np

  from configs import tiny
  from flax_transformer import partitioning, steps
  from flax_transformer.model import TransformerConfig

  assert jax.device_count() == 8 and jax.process_count() == num_processes
  config = tiny.get_config()
  model_config = TransformerConfig.from_config(config)
  mesh = partitioning.create_mesh((4, 2, 1))
  state, shardings = partitioning.create_train_state(config, model_config, mesh, jax.random.key(0))
  train_step = partitioning.jit_train_step(
      functools.partial(steps.train_step, model_config=model_config, label_smoothing=0.1), mesh, shardings)
  rng = np.random.default_rng(0)
  global_batch = {'inputs': rng.integers(2, 64, (8, 10)).astype(np.int32),
                  'targets': rng.integers(2, 64, (8, 9)).astype(np.int32)}
  rows = 8 // num_processes
  local = {k: v[process_id * rows:(process_id + 1) * rows] for k, v in global_batch.items()}  # this host's shard
  sharding = partitioning.batch_sharding(mesh)
  batch = {k: jax.make_array_from_process_local_data(sharding, v) for k, v in local.items()}
  losses = []
  for _ in range(3):
    state, metrics = train_step(state, batch, jax.random.key(1))
    losses.append(float(metrics['loss']))
  return losses


if __name__ == '__main__':
  process_id, num_processes, port, output = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
  os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') +
                             f' --xla_force_host_platform_device_count={8 // num_processes}')
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  import jax
  from configs import tiny
  from flax_transformer import train_loop

  config = tiny.get_config()
  config.coordinator_address, config.num_processes, config.process_id = f'localhost:{port}', num_processes, process_id
  train_loop.maybe_initialize_distributed(config)
  losses = three_steps(process_id, num_processes)
  if process_id == 0:
    with open(output, 'w') as f:
      json.dump({'losses': losses, 'processes': jax.process_count(), 'devices': jax.device_count()}, f)
