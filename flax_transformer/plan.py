"""A capacity plan without the devices: compile the real train step ahead of time for N devices and say
what each device holds, how many FLOPs a step is, and, given a peak and an MFU, how long training takes.

  python -m flax_transformer plan --config=configs/big.py --devices=8 --mesh='(1,8,1)' \
      --peak_tflops=989 --mfu=0.4 --device_memory_gb=80

The step is compiled by XLA:CPU over `--devices` fake CPU devices, for the config's longest batch shape
(config.max_train_length on both sides, as many rows as config.tokens_per_batch holds): parameter and optimizer
bytes follow exactly from the shardings; temporaries are XLA:CPU's buffer assignment for the same
program (a GPU or TPU compiler fuses differently, so treat them as an estimate); FLOPs are XLA's
cost_analysis() beside the analytic count (6 · parameters · tokens plus attention). Where the step does
not fit `--device_memory_gb`, the plan compiles the mesh or accumulation that does and says so.
The last line printed is one JSON object. The program: python -m flax_transformer plan (commands/plan.py).
"""

import dataclasses
import math

import jax
import jax.numpy as jnp

from flax_transformer import partitioning, steps, train_state
from flax_transformer.errors import ConfigError
from flax_transformer.model import TransformerConfig
from flax_transformer.settings import Settings

GIB = 2**30


def analytic_flops(model_config: TransformerConfig, rows: int, source_length: int, target_length: int) -> float:
  """Model FLOPs of one training step (forward + backward = 3 × forward, 2 FLOPs per multiply-add).

  Dense: 6 · N · tokens, N the weights each token meets (embedding look-ups are free, the pre-softmax
  projection is not): encoder layers per source token, decoder layers and the projection per target token.
  Attention: QKᵀ and AV, 2 · 2 · q · k · d_model per sentence and layer, for encoder self-, decoder self-
  and encoder-decoder attention.
  """
  d, f, n, v = model_config.d_model, model_config.d_ff, model_config.num_encoder_layers, model_config.vocab_size
  m = model_config.num_decoder_layers
  encoder_weights = n * (4 * d * d + 2 * d * f)
  decoder_weights = m * (8 * d * d + 2 * d * f) + v * d
  dense = 6 * (encoder_weights * rows * source_length + decoder_weights * rows * target_length)
  attention = 3 * 4 * d * rows * (n * source_length**2 + m * target_length**2 + m * target_length * source_length)
  return float(dense + attention)


def longest_batch_shape(s: Settings, dp: int) -> tuple[int, int, int]:
  """(rows, source length, target length) of the run's longest batch: its most memory-hungry step."""
  length = s.data.max_train_length
  multiple = dp * s.data.gradient_accumulation_steps
  rows = s.data.tokens_per_batch // length // multiple * multiple
  if rows < multiple:
    raise ConfigError(f'config.tokens_per_batch={s.data.tokens_per_batch} cannot hold {multiple} sentences of '
                      f'{length} tokens; raise it or lower config.max_train_length')
  return rows, length, length


def _bytes_per_device(abstract_tree) -> int:
  """The largest per-device share of a tree of sharded ShapeDtypeStructs."""
  total = 0
  for leaf in jax.tree_util.tree_leaves(abstract_tree):
    total += math.prod(leaf.sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
  return total


def compiled_here(s: Settings) -> Settings:
  """The target platform's settings as this CPU compiles them: cuDNN attention compiles only on a GPU, so
  XLA's stands in for it (the same memory and FLOPs to XLA:CPU); every other choice is the target's."""
  if s.model.attention != 'cudnn':
    return s
  return dataclasses.replace(s, model=dataclasses.replace(s.model, attention='xla'))


def with_accumulation(s: Settings, steps: int) -> Settings:
  """`s` with `steps` micro-batches an update (the data's batch sizes and the loop's step alike)."""
  return dataclasses.replace(s, data=dataclasses.replace(s.data, gradient_accumulation_steps=steps),
                             training=dataclasses.replace(s.training, gradient_accumulation_steps=steps))


def _compiled_step(s: Settings, mesh):
  """The train step for the run's longest batch, compiled for `mesh`; returns (compiled, abstract state, batch
  shape)."""
  rows, source_length, target_length = longest_batch_shape(s, partitioning.data_parallel_size(mesh))
  state, shardings = train_state.abstract_train_state(s.model, s.optimizer, mesh)
  step = partitioning.jit_train_step(steps.for_run(s)[0], mesh, shardings)
  batch_sharding = partitioning.batch_sharding(mesh)
  batch = {'inputs': jax.ShapeDtypeStruct((rows, source_length), jnp.int32, sharding=batch_sharding),
           'targets': jax.ShapeDtypeStruct((rows, target_length), jnp.int32, sharding=batch_sharding)}
  with partitioning.mesh_context(mesh):
    compiled = step.jitted.lower(state, batch, jax.random.key(0, impl=s.training.dropout_rng_impl)).compile()
  return compiled, state, (rows, source_length, target_length)


def compile_step(s: Settings, mesh_shape) -> dict:
  """Compiles the train step for the run's longest batch on `mesh_shape`; returns per-device figures.

  Memory comes from the program as configured. XLA's cost analysis counts a loop body once, so the FLOPs
  come from a second compilation with the layer scan unrolled (each layer counted as it runs).
  """
  mesh = partitioning.create_mesh(mesh_shape)
  compiled, state, (rows, source_length, target_length) = _compiled_step(s, mesh)
  memory = compiled.memory_analysis()
  layers = max(s.model.num_encoder_layers, s.model.num_decoder_layers)
  if s.model.scan_unroll < layers:
    compiled, *_ = _compiled_step(dataclasses.replace(s, model=dataclasses.replace(s.model, scan_unroll=layers)), mesh)
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  devices = mesh.devices.size
  return {
      'mesh': dict(mesh.shape), 'devices': devices, 'rows': rows, 'source_length': source_length,
      'target_length': target_length, 'tokens_per_step': rows * (source_length + target_length),
      'param_count': sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(state.params)),
      'param_bytes_per_device': _bytes_per_device(state.params),
      'optimizer_bytes_per_device': _bytes_per_device(state.opt_state),
      'temp_bytes_per_device': int(memory.temp_size_in_bytes),
      'flops_per_step': float(cost.get('flops', 0.0)) * devices,  # cost_analysis is per device (one partition)
      'analytic_flops_per_step': analytic_flops(s.model, rows, source_length, target_length),
  }


def total_bytes(figures: dict) -> int:
  return figures['param_bytes_per_device'] + figures['optimizer_bytes_per_device'] + figures['temp_bytes_per_device']


def candidate_fixes(s: Settings, mesh_shape, devices: int):
  """Meshes that shard more state (FSDP over all devices, then tensor parallelism), then gradient accumulation."""
  data, fsdp, model = mesh_shape
  meshes = [(1, devices, 1)] + [(1, devices // tp, tp) for tp in (2, 4, 8) if devices % tp == 0]
  accumulation = s.data.gradient_accumulation_steps
  for mesh in meshes:
    if tuple(mesh) != (data, fsdp, model):
      yield f'--mesh={mesh}', mesh, accumulation
  for k in (2, 4, 8):
    yield f'--mesh={meshes[0]} --config.gradient_accumulation_steps={k * accumulation}', meshes[0], k * accumulation


def resolve_mesh(mesh_shape) -> tuple[int, int, int]:
  """The mesh shape with its -1 entry filled in (and checked) as partitioning.create_mesh does."""
  return tuple(partitioning.create_mesh(mesh_shape).devices.shape)


def table(figures: dict, peak_tflops: float, mfu: float, memory_gb: float | None) -> str:
  rows = [('parameters (float32)', f'{figures["param_count"]:,}'),
          ('mesh', ' x '.join(f'{k}={v}' for k, v in figures['mesh'].items())),
          ('longest batch', f'{figures["rows"]} x ({figures["source_length"]} + {figures["target_length"]}) tokens'),
          ('parameter bytes / device', f'{figures["param_bytes_per_device"] / GIB:.2f} GiB'),
          ('optimizer bytes / device', f'{figures["optimizer_bytes_per_device"] / GIB:.2f} GiB'),
          ('temporaries / device (XLA:CPU)', f'{figures["temp_bytes_per_device"] / GIB:.2f} GiB'),
          ('total / device', f'{total_bytes(figures) / GIB:.2f} GiB'
           + (f' of {memory_gb:g} GB' if memory_gb else '')),
          ('FLOPs / step (XLA cost_analysis)', f'{figures["flops_per_step"]:.3e}'),
          ('FLOPs / step (analytic)', f'{figures["analytic_flops_per_step"]:.3e}')]
  if peak_tflops:
    rows += [(f'step time at {mfu:.0%} MFU of {peak_tflops:g} TFLOP/s', f'{figures["step_seconds"]:.3f} s'),
             (f'hours to {figures["num_train_steps"]:,} steps', f'{figures["hours_to_num_train_steps"]:.1f}')]
  width = max(len(name) for name, _ in rows)
  return '\n'.join(f'{name:<{width}}  {value}' for name, value in rows)


def plan(s: Settings, devices: int, mesh_shape: tuple[int, int, int], peak_tflops: float = 0.0, mfu: float = 0.4,
         device_memory_gb: float | None = None) -> dict:
  """The plan of the run `s` (resolved for its target platform) as a dict: the figures of `compile_step`,
  timings and, when it does not fit, the fix."""
  s = compiled_here(s)
  if len(jax.devices()) != devices:
    raise ConfigError(f'--devices={devices} but JAX has {len(jax.devices())} devices; run plan as a module '
                      f'(python -m flax_transformer plan) so it can create them')
  mesh_shape = resolve_mesh(mesh_shape)
  figures = compile_step(s, mesh_shape)

  def timing(f):
    seconds = f['analytic_flops_per_step'] / (devices * peak_tflops * 1e12 * mfu) if peak_tflops else None
    f.update(step_seconds=seconds, num_train_steps=s.optimizer.num_train_steps,
             hours_to_num_train_steps=seconds * s.optimizer.num_train_steps / 3600 if seconds else None)
    return f

  figures = timing(figures)
  figures['fits'] = None if device_memory_gb is None else total_bytes(figures) <= device_memory_gb * 1e9
  figures['fix'] = None
  if figures['fits'] is False:
    for description, mesh, k in candidate_fixes(s, mesh_shape, devices):
      try:
        candidate = timing(compile_step(with_accumulation(s, k), mesh))
      except ConfigError:
        continue
      if total_bytes(candidate) <= device_memory_gb * 1e9:
        figures['fix'] = {'flags': description, 'total_bytes_per_device': total_bytes(candidate)}
        break
  return figures


if __name__ == '__main__':  # the program is python -m flax_transformer plan
  from flax_transformer.__main__ import moved
  moved('plan', 'plan')
