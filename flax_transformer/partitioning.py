"""Device mesh, the logical-axis rules table, shardings and the one `jax.jit` of the train and eval steps.

Parameters are annotated with logical axis names in layers.py; this table alone decides how
they, the Adam moments and the activations are split over the mesh axes:
  data  - data parallelism (batch split, parameters replicated),
  fsdp  - fully sharded data parallelism / ZeRO-3 (batch split and parameters split over d_model),
  model - tensor parallelism (attention heads, FFN units and the vocabulary split).
"""

import contextlib
import dataclasses
import functools
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from flax_transformer.errors import ConfigError
from flax_transformer.model import Transformer, TransformerConfig

MESH_AXES = ('data', 'fsdp', 'model')
BATCH_AXES = ('data', 'fsdp')  # Mesh axes the batch is split over.

# (logical axis, mesh axis): the first rule whose mesh axis is still free wins.
LOGICAL_AXIS_RULES = (
    ('batch', BATCH_AXES),
    ('vocab', 'model'),
    ('heads', 'model'),
    ('mlp', 'model'),
    ('embed', 'fsdp'),
    ('embed', None),
    ('kv', 'fsdp'),  # attention biases [.., heads, kv] (their kernels already split 'embed' over fsdp)
    ('norm', 'fsdp'),
    ('kv', None),
    ('qkv', None),
    ('length', None),
    ('norm', None),
    ('layers', None),  # the stacked-layer axis of nn.scan
)


def mesh_shape_for(mesh_shape: Sequence[int], device_count: int) -> tuple[int, ...]:
  """`mesh_shape` (data, fsdp, model) for `device_count` devices, its one -1 entry (if any) filled with the
  remaining devices; a shape that cannot be is a one-line error."""
  shape = list(mesh_shape)
  if len(shape) != len(MESH_AXES) or not all(isinstance(s, int) for s in shape):
    raise ConfigError(f'config.mesh_shape={tuple(mesh_shape)}: needs {len(MESH_AXES)} integers for {MESH_AXES}')
  if shape.count(-1) > 1 or any(s == 0 or s < -1 for s in shape):
    raise ConfigError(f'config.mesh_shape={tuple(mesh_shape)}: entries must be positive, with at most one -1')
  known = math.prod(s for s in shape if s != -1)
  if -1 in shape:
    if device_count % known:
      raise ConfigError(f'config.mesh_shape={tuple(mesh_shape)}: {device_count} devices are not divisible by {known}')
    shape[shape.index(-1)] = device_count // known
  if math.prod(shape) != device_count:
    raise ConfigError(f'config.mesh_shape={tuple(mesh_shape)} needs {math.prod(shape)} devices '
                      f'but {device_count} are available; make the product of its entries {device_count}')
  return tuple(shape)


def create_mesh(mesh_shape: Sequence[int], devices=None) -> Mesh:
  """A ('data', 'fsdp', 'model') mesh; one entry may be -1 (all remaining devices)."""
  devices = jax.devices() if devices is None else devices
  shape = mesh_shape_for(mesh_shape, len(devices))
  try:
    device_array = mesh_utils.create_device_mesh(shape, devices)
  except (AssertionError, ValueError, NotImplementedError):
    device_array = np.asarray(devices).reshape(shape)
  return Mesh(device_array, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def data_parallel_size(mesh: Mesh) -> int:
  return math.prod(mesh.shape[a] for a in BATCH_AXES)


@dataclasses.dataclass(frozen=True)
class DataShard:
  """This process's part of every global batch: the data-parallel row blocks its devices hold, wherever
  they sit in the mesh (a TPU slice's interconnect order interleaves hosts; a process-ordered mesh does not).

  Processes whose devices hold the same blocks (a model axis across hosts) read the same data shard; the
  `count` shards are disjoint and cover the batch, ordered by their first block.
  """
  index: int  # which data shard this process reads, 0 <= index < count
  count: int  # the processes' distinct block sets
  blocks: tuple[int, ...]  # the data-parallel blocks this process holds, ascending: its local rows in order
  data_parallel: int  # blocks of a global batch (mesh data x fsdp)

  def to_global(self, local: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """This process's rows [len(blocks) * r, ...] (block by block, in `blocks` order) -> the global array
    [data_parallel * r, ...], each device given the rows of its block."""
    rows = local.shape[0] // len(self.blocks)
    global_shape = (rows * self.data_parallel, *local.shape[1:])
    arrays = []
    for device, index in sharding.addressable_devices_indices_map(global_shape).items():
      at = self.blocks.index((index[0].start or 0) // rows) * rows
      arrays.append(jax.device_put(local[at:at + rows], device))
    return jax.make_array_from_single_device_arrays(global_shape, sharding, arrays)


def data_shard(devices: np.ndarray, process_index: int | None = None) -> DataShard:
  """The DataShard of process `process_index` (default: this one) on a (data, fsdp, model) device array.

  Batches are split over ('data', 'fsdp'), data-major: the device at [i, j, k] holds block i * fsdp + j.
  Only `process_index` is read from the devices, so this runs on device descriptions of any slice.
  """
  process_index = jax.process_index() if process_index is None else process_index
  data, fsdp, _ = devices.shape
  blocks = np.broadcast_to(np.arange(data * fsdp).reshape(data, fsdp, 1), devices.shape)
  held = {}
  for device, block in zip(devices.flat, blocks.flat):
    held.setdefault(device.process_index, set()).add(int(block))
  shards = sorted({tuple(sorted(b)) for b in held.values()})
  if len(set().union(*shards)) != sum(map(len, shards)) or len({len(s) for s in shards}) != 1:
    raise ConfigError(f'config.mesh_shape={tuple(devices.shape)} gives the processes overlapping or uneven '
                      f'shares of the batch (blocks per process: {dict(sorted(held.items()))}); choose a mesh whose '
                      f'data x fsdp axes split evenly over the hosts')
  if process_index not in held:
    raise ConfigError(f'config.mesh_shape={tuple(devices.shape)} holds none of process {process_index}\'s '
                      f'devices; use every device (-1 in config.mesh_shape)')
  mine = tuple(sorted(held[process_index]))
  return DataShard(shards.index(mine), len(shards), mine, data * fsdp)


def check_model_fits_mesh(model_config: TransformerConfig, mesh: Mesh) -> None:
  """One-line errors for tensor-parallel splits that do not divide the model."""
  tp = mesh.shape['model']
  for field in ('num_heads', 'd_ff'):
    value = getattr(model_config, field)
    if value % tp:
      raise ConfigError(f'config.model.{field}={value} is not divisible by the mesh model axis ({tp}); '
                       f'choose a model axis that divides it')


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Batches [b, l] are split over the data-parallel axes."""
  return NamedSharding(mesh, PartitionSpec(BATCH_AXES))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())


@contextlib.contextmanager
def mesh_context(mesh: Mesh):
  """The mesh and rules that the model's activation constraints resolve against while tracing."""
  with jax.set_mesh(mesh), nn.logical_axis_rules(LOGICAL_AXIS_RULES):
    yield


def logical_to_shardings(boxed_tree, mesh: Mesh):
  """A tree of nn.LogicallyPartitioned (or abstract) leaves -> the matching NamedSharding tree."""
  specs = nn.get_partition_spec(boxed_tree)
  return nn.logical_to_mesh_sharding(specs, mesh, LOGICAL_AXIS_RULES)


def abstract_params(model_config: TransformerConfig):
  """Parameter shapes (boxed with logical names) from `jax.eval_shape`: nothing is allocated."""
  return jax.eval_shape(lambda: Transformer(model_config).init(jax.random.key(0), jnp.ones((1, 1), jnp.int32),
                                                               jnp.ones((1, 1), jnp.int32))['params'])


def jit_train_step(train_step: Callable, mesh: Mesh, state_shardings) -> Callable:
  """The training step compiled once per batch shape over the mesh.

  in_shardings:  state as created; batch split over ('data', 'fsdp'); dropout key replicated.
  out_shardings: the new state keeps the layout; metrics are replicated scalars.
  donate_argnums=0: the old state's buffers are reused for the new state (halves peak memory).
  """
  jitted = jax.jit(train_step,
                   in_shardings=(state_shardings, batch_sharding(mesh), replicated(mesh)),
                   out_shardings=(state_shardings, replicated(mesh)),
                   donate_argnums=0)

  dp = data_parallel_size(mesh)

  @functools.wraps(train_step)
  def step(state, batch, rng):
    rows = batch['inputs'].shape[0]
    if rows % dp:
      raise ConfigError(f'a global batch of {rows} rows is not divisible by the data-parallel size {dp} '
                        f'(mesh data x fsdp); make batch sizes multiples of {dp}')
    with mesh_context(mesh):
      return jitted(state, batch, rng)

  step.jitted = jitted
  return step


def jit_eval_step(eval_step: Callable, mesh: Mesh, param_shardings) -> Callable:
  """Evaluation step: parameters as in the state, batch split, replicated metric sums."""
  jitted = jax.jit(eval_step, in_shardings=(param_shardings, batch_sharding(mesh)),
                   out_shardings=replicated(mesh))

  @functools.wraps(eval_step)
  def step(params, batch):
    with mesh_context(mesh):
      return jitted(params, batch)

  step.jitted = jitted
  return step
