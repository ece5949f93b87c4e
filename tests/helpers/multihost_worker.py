"""One process of a multi-host run on localhost (used by tests/test_partitioning.py).

python tests/helpers/multihost_worker.py PROCESS_ID NUM_PROCESSES PORT OUTPUT_JSON
Each process holds 8/NUM_PROCESSES CPU devices and feeds its rows of the same global batch, on a
process-ordered mesh and on one whose data axis alternates between the processes; process 0 writes the
losses of both. The single-process reference is `three_steps(0, 1)`, called in the test's own process.
"""

import functools
import json
import os
import sys


def three_steps(process_id: int, num_processes: int, order: str = 'process') -> list[float]:
  """The losses of 3 train steps of configs/tiny.py on mesh (4, 2, 1) over 8 devices, this process feeding
  the rows of one fixed global batch that its devices hold. order='process': each process's devices one
  block of the data axis; 'alternating': the data axis alternates between the processes' devices."""
  import jax
  import numpy as np

  from configs import tiny
  from flax_transformer import settings, train_state
  from flax_transformer import partitioning, steps

  assert jax.device_count() == 8 and jax.process_count() == num_processes
  config = tiny.get_config()
  model_config = settings.model_settings(config)
  devices = jax.devices()
  if order == 'alternating':  # data index i takes the next two devices of process i % num_processes
    by_process = [[d for d in devices if d.process_index == p] for p in range(num_processes)]
    devices = [by_process[i % num_processes].pop(0) for i in range(4) for _ in range(2)]
  mesh = partitioning.create_mesh((4, 2, 1), devices)
  assert [d.id for d in mesh.devices.flat] == [d.id for d in devices]  # the order asked for
  state, shardings = train_state.create_train_state(model_config, settings.resolve(config).optimizer, mesh, jax.random.key(0))
  train_step = partitioning.jit_train_step(
      functools.partial(steps.train_step, model_config=model_config, label_smoothing=0.1), mesh, shardings)
  rng = np.random.default_rng(0)
  global_batch = {'inputs': rng.integers(2, 64, (8, 10)).astype(np.int32),
                  'targets': rng.integers(2, 64, (8, 9)).astype(np.int32)}
  shard = partitioning.data_shard(mesh.devices)
  if order == 'alternating' and num_processes == 2:
    assert shard.blocks == ((0, 1, 4, 5), (2, 3, 6, 7))[process_id], shard
  sharding = partitioning.batch_sharding(mesh)
  batch = {k: shard.to_global(v[list(shard.blocks)], sharding) for k, v in global_batch.items()}  # 1 row a block
  losses = []
  for _ in range(3):
    state, metrics = train_step(state, batch, jax.random.key(1))
    losses.append(float(metrics['loss']))
  return losses


if __name__ == '__main__':
  process_id, num_processes, port, output = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
  os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') +
                             f' --xla_force_host_platform_device_count={8 // num_processes}')
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
  import jax
  from configs import tiny
  from flax_transformer import cluster

  config = tiny.get_config()
  config.coordinator_address, config.num_processes, config.process_id = f'localhost:{port}', num_processes, process_id
  cluster.start(config)
  losses = {order: three_steps(process_id, num_processes, order) for order in ('process', 'alternating')}
  if process_id == 0:
    with open(output, 'w') as f:
      json.dump({'losses': losses, 'processes': jax.process_count(), 'devices': jax.device_count()}, f)
