"""Scale-out: FSDP memory per device, restore onto other meshes, multi-host, bf16, mesh errors."""

import dataclasses
import itertools
import json
import os
import socket
import subprocess
import sys

import flax.linen as nn
import jax
import numpy as np
import pytest
from jax.experimental import mesh_utils

from flax_transformer import settings, train_state
from flax_transformer import checkpointing, partitioning, steps, weights
from flax_transformer.errors import ConfigError
from flax_transformer.model import TransformerConfig
from tests.helpers import multihost_worker
from tests.conftest import random_batch, subprocess_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _device0_bytes(tree) -> int:
  device = jax.devices()[0]
  return sum(shard.data.nbytes for leaf in jax.tree_util.tree_leaves(tree)
             for shard in leaf.addressable_shards if shard.device == device)


def _total_bytes(tree) -> int:
  return sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(tree))


def test_fsdp_holds_an_eighth_per_device(tiny_config, small_model_config):
  mesh = partitioning.create_mesh((1, 8, 1))
  config = TransformerConfig(**{**small_model_config.__dict__, 'd_model': 64, 'd_ff': 256, 'vocab_size': 512})
  state, _ = train_state.create_train_state(config, settings.resolve(tiny_config).optimizer, mesh, jax.random.key(0))
  for name, tree in (('parameters', state.params), ('optimizer state', state.opt_state)):
    fraction = _device0_bytes(tree) / _total_bytes(tree)
    print(f'FSDP (1,8,1): device 0 holds {fraction:.4f} of the {name} bytes ({_total_bytes(tree):,} in all)')
    assert fraction < 1 / 8 * 1.1


@pytest.mark.slow  # 8 s or more of compilation and steps on 2 cores (the marker)
def test_checkpoint_from_one_mesh_restores_on_others(tiny_config, small_model_config, tmp_path):
  state, _ = train_state.create_train_state(small_model_config, settings.resolve(tiny_config).optimizer, partitioning.create_mesh((2, 2, 2)),
                                             jax.random.key(0))
  manager = checkpointing.create_manager(str(tmp_path), 2)
  checkpointing.save_state(manager, state)
  manager.wait_until_finished()
  expected = jax.device_get(state.params)
  for shape, devices in (((1, 1, 1), jax.devices()[:1]), ((8, 1, 1), jax.devices())):
    mesh = partitioning.create_mesh(shape, devices)
    target, shardings = train_state.create_train_state(small_model_config, settings.resolve(tiny_config).optimizer, mesh, jax.random.key(1))
    restored = checkpointing.restore_state(manager, 0, target, shardings)
    for a, b in zip(jax.tree_util.tree_leaves(expected), jax.tree_util.tree_leaves(jax.device_get(restored.params))):
      np.testing.assert_array_equal(a, b)
  manager.close()
  abstract = nn.meta.unbox(partitioning.abstract_params(small_model_config))
  params_only = weights.restore_params(str(tmp_path), 0, abstract)  # what translate.py does
  assert all(np.array_equal(a, b) for a, b in zip(jax.tree_util.tree_leaves(expected),
                                                   jax.tree_util.tree_leaves(jax.device_get(params_only))))


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('localhost', 0))
    return s.getsockname()[1]


@pytest.mark.slow
def test_two_process_run_matches_one_process(tmp_path):
  env = subprocess_env(None)  # the worker sets its device count
  worker = os.path.join(ROOT, 'tests', 'helpers', 'multihost_worker.py')
  port, multi = str(_free_port()), tmp_path / 'multi.json'
  processes = [subprocess.Popen([sys.executable, worker, str(i), '2', port, str(multi)], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for i in range(2)]
  single = multihost_worker.three_steps(0, 1)  # the same steps in this 8-device process, meanwhile
  outputs = [p.communicate(timeout=300)[0] for p in processes]
  assert all(p.returncode == 0 for p in processes), outputs[0][-3000:]
  multi_run = json.loads(multi.read_text())
  print('1 process:', single, '\n2 processes:', multi_run)
  assert multi_run['processes'] == 2 and multi_run['devices'] == 8
  np.testing.assert_allclose(multi_run['losses']['process'], single, rtol=1e-5)
  np.testing.assert_allclose(multi_run['losses']['alternating'], single, rtol=1e-5)


@pytest.mark.parametrize('mesh_shape,message', [
    ((3, 1, 1), 'config.mesh_shape=(3, 1, 1) needs 3 devices but 8 are available'),
    ((-1, 3, 1), '8 devices are not divisible by 3'),
])
def test_mesh_that_does_not_fit_is_a_one_line_error(mesh_shape, message):
  with pytest.raises(ConfigError, match=message.replace('(', r'\(').replace(')', r'\)')):
    partitioning.create_mesh(mesh_shape)


def test_heads_and_batch_must_divide_the_mesh(tiny_config, small_model_config, np_rng):
  config = TransformerConfig(**{**small_model_config.__dict__, 'num_heads': 2})
  with pytest.raises(ConfigError, match='num_heads=2 is not divisible by the mesh model axis \\(4\\)'):
    partitioning.check_model_fits_mesh(config, partitioning.create_mesh((2, 1, 4)))
  mesh = partitioning.create_mesh((8, 1, 1))
  state, shardings = train_state.create_train_state(settings.model_settings(tiny_config), settings.resolve(tiny_config).optimizer, mesh,
                                                     jax.random.key(0))
  step = partitioning.jit_train_step(steps.train_step, mesh, shardings)
  with pytest.raises(ConfigError, match='a global batch of 6 rows is not divisible by the data-parallel size 8'):
    step(state, random_batch(np_rng, 6, 5, 5, 64), jax.random.key(0))


@dataclasses.dataclass(frozen=True)
class FakeTpuDevice:
  """What mesh_utils reads of a TPU device: its chip's coordinates in the slice's torus, and its host."""
  id: int
  process_index: int
  coords: tuple[int, int, int]
  device_kind: str
  core_on_chip: int = 0
  platform: str = 'tpu'
  slice_index: int = 0


def _tpu_slice(kind: str, topology: tuple[int, int, int], chips_per_host: tuple[int, int, int]):
  """One device per chip (v4 megacore, v5e); each host holds a `chips_per_host` block of the torus."""
  hosts = [t // h for t, h in zip(topology, chips_per_host)]
  devices = []
  for z, y, x in itertools.product(*(range(n) for n in reversed(topology))):
    host = (x // chips_per_host[0]) + hosts[0] * ((y // chips_per_host[1]) + hosts[1] * (z // chips_per_host[2]))
    devices.append(FakeTpuDevice(len(devices), host, (x, y, z), kind))
  return devices


@pytest.mark.parametrize('name,kind,topology,mesh_shape', [
    ('v4-16', 'TPU v4', (2, 2, 2), (8, 1, 1)),
    ('v4-64', 'TPU v4', (4, 4, 2), (4, 8, 1)),
    ('v5e 4x4', 'TPU v5 lite', (4, 4, 1), (16, 1, 1)),
])
def test_tpu_slice_meshes_feed_each_process_the_rows_of_its_devices(name, kind, topology, mesh_shape):
  """mesh_utils orders a slice's devices by the interconnect, which interleaves hosts along the batch."""
  devices = mesh_utils.create_device_mesh(mesh_shape, _tpu_slice(kind, topology, (2, 2, 1)))
  processes = np.vectorize(lambda d: d.process_index)(devices)
  block_of = np.arange(mesh_shape[0] * mesh_shape[1]).reshape(mesh_shape[:2])  # data-major, as PartitionSpec(('data', 'fsdp'))
  shards = {p: partitioning.data_shard(devices, p) for p in np.unique(processes)}
  print(name, mesh_shape, 'processes along the batch:', processes[..., 0].ravel().tolist())
  for process, shard in shards.items():
    print(f'  process {process}: shard {shard.index} of {shard.count}, blocks {shard.blocks}')
    assert set(shard.blocks) == set(block_of[processes[..., 0] == process].tolist())
  assert sorted(b for s in shards.values() for b in s.blocks) == list(range(block_of.size))  # disjoint, covering
  assert sorted(s.index for s in shards.values()) == list(range(len(shards))) == list(range(shards[0].count))
  assert any(s.blocks != tuple(range(s.blocks[0], s.blocks[0] + len(s.blocks))) for s in shards.values())  # interleaved


def test_a_mesh_that_leaves_out_a_process_or_splits_it_unevenly_is_a_one_line_error():
  devices = np.array(_tpu_slice('TPU v4', (2, 2, 2), (2, 2, 1)), dtype=object)
  with pytest.raises(ConfigError, match=r'config.mesh_shape=\(4, 1, 1\) holds none of process 1\'s devices'):
    partitioning.data_shard(devices[:4].reshape(4, 1, 1), 1)
  overlapping = devices[[0, 4, 1, 2, 5, 6, 3, 7]].reshape(4, 1, 2)  # blocks 0 and 3 each span both processes
  with pytest.raises(ConfigError, match=r'config.mesh_shape=\(4, 1, 2\) gives the processes overlapping or uneven'):
    partitioning.data_shard(overlapping, 0)
