"""Parameter + Adam-state bytes per device for base and big under each parallelism, from jax.eval_shape.

python bench/memory.py [--devices=8]   (no arrays are allocated; CPU devices stand in for accelerators)
"""

import argparse
import math
import os
import sys

parser = argparse.ArgumentParser()
parser.add_argument('--devices', type=int, default=8)
args = parser.parse_args()
os.environ['XLA_FLAGS'] = f'--xla_force_host_platform_device_count={args.devices}'
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from configs import base, big  # noqa: E402
from flax_transformer import optim, partitioning  # noqa: E402
from flax_transformer.model import Transformer, TransformerConfig  # noqa: E402


def per_device_bytes(config, mesh_shape):
  model_config = TransformerConfig.from_config(config)
  mesh = partitioning.create_mesh(mesh_shape)
  tx, _ = optim.create_optimizer(config, model_config.d_model)

  def init(rng):
    params = Transformer(model_config).init(rng, jnp.ones((1, 1), jnp.int32), jnp.ones((1, 1), jnp.int32))['params']
    return partitioning.TrainState.create(apply_fn=None, params=params, tx=tx)

  abstract = jax.eval_shape(init, jax.random.key(0))
  shardings = partitioning.logical_to_shardings(abstract, mesh)
  import flax.linen as nn
  leaves = jax.tree_util.tree_leaves(nn.meta.unbox(abstract))
  total = sum(math.prod(x.shape) * x.dtype.itemsize for x in leaves)
  device = sum(math.prod(s.shard_shape(x.shape)) * x.dtype.itemsize
               for x, s in zip(leaves, jax.tree_util.tree_leaves(shardings)))
  return total, device


n = args.devices
print('| model | parallelism (data, fsdp, model) | params + Adam, all | per device |\n|---|---|---|---|')
for name, config in (('base', base.get_config()), ('big', big.get_config())):
  for label, shape in (('data parallel', (n, 1, 1)), ('FSDP', (1, n, 1)), ('tensor parallel', (1, 1, n)),
                       ('FSDP × TP', (1, n // 2, 2))):
    total, device = per_device_bytes(config, shape)
    print(f'| {name} | {label} {shape} | {total / 2**30:.2f} GiB | {device / 2**30:.3f} GiB |')
