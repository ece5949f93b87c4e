"""Cluster start-up: each environment simulated (variables, a fake metadata server), the arguments
`jax.distributed.initialize` receives, and what JAX's own detection makes of them."""

import contextlib
import http.server
import threading
import time

import jax
import pytest
from jax._src import clusters
from jax._src.clusters import cloud_tpu_cluster

from configs import tiny
from flax_transformer import cluster, settings
from flax_transformer.errors import ConfigError

TIMEOUTS = {'heartbeat_timeout_seconds': 30, 'shutdown_timeout_seconds': 60}
SLURM = {'SLURM_JOB_ID': '4242', 'SLURM_STEP_NODELIST': 'gpu-node[07-08]', 'SLURM_PROCID': '1'}


def _resolved(arguments, monkeypatch, environ, tpu_vm=False):
  """(coordinator, process count, process id, local device ids) as JAX's detection completes `arguments`."""
  for key in ('SLURM_JOB_ID', 'TPU_WORKER_HOSTNAMES', 'TPU_PROCESS_ADDRESSES', 'OMPI_MCA_orte_hnp_uri',
              'MEGASCALE_COORDINATOR_ADDRESS', 'KUBERNETES_SERVICE_HOST', 'JAX_COORDINATOR_PORT',
              'TPU_SKIP_MDS_QUERY'):  # (set by JAX on a machine without TPU chips)
    monkeypatch.delenv(key, raising=False)
  for key, value in environ.items():
    monkeypatch.setenv(key, value)
  monkeypatch.setattr(cloud_tpu_cluster, 'running_in_cloud_tpu_vm', tpu_vm)
  monkeypatch.setattr(clusters.cluster, 'running_in_cloud_tpu_vm', tpu_vm)
  monkeypatch.setattr(cloud_tpu_cluster.BaseTpuCluster, 'wait_for_coordinator', classmethod(lambda *a: None))
  monkeypatch.setattr(time, 'sleep', lambda seconds: None)  # JAX retries a metadata key the server lacks
  return clusters.ClusterEnv.auto_detect_unset_distributed_params(
      arguments.get('coordinator_address'), arguments.get('num_processes'), arguments.get('process_id'),
      arguments.get('local_device_ids'), None, 10)


def test_explicit_coordinator(monkeypatch):
  config = tiny.get_config()
  config.coordinator_address, config.num_processes, config.process_id = '10.0.0.1:1234', 4, 3
  found = cluster.detect(settings.resolve(config).cluster, {}, tpu_chips=0)
  assert found.arguments == {'coordinator_address': '10.0.0.1:1234', 'num_processes': 4, 'process_id': 3, **TIMEOUTS}
  assert found.kind == 'explicit coordinator 10.0.0.1:1234, 4 processes'
  config.process_id = 4
  with pytest.raises(ConfigError, match='config.process_id=4 is outside 0..3'):
    cluster.detect(settings.resolve(config).cluster, {}, tpu_chips=0)


@pytest.mark.parametrize('gpus_variable', [{'SLURM_GPUS_ON_NODE': '8'}, {'CUDA_VISIBLE_DEVICES': '0,1,2,3,4,5,6,7'}])
def test_slurm_one_task_per_node_sees_all_its_gpus(monkeypatch, gpus_variable):
  environ = {**SLURM, 'SLURM_NTASKS': '2', 'SLURM_STEP_NUM_NODES': '2', 'SLURM_LOCALID': '0', **gpus_variable}
  found = cluster.detect(settings.resolve(tiny.get_config()).cluster, environ, tpu_chips=0)
  assert found.arguments == {'local_device_ids': list(range(8)), **TIMEOUTS}
  assert found.kind == 'SLURM, 2 tasks on 2 nodes, one per node with all its GPUs'
  assert _resolved(found.arguments, monkeypatch, environ) == ('gpu-node07:' + str(4242 % 4096 + 61440), 2, 1,
                                                                list(range(8)))


def test_slurm_one_task_per_gpu(monkeypatch):
  environ = {**SLURM, 'SLURM_NTASKS': '16', 'SLURM_STEP_NUM_NODES': '2', 'SLURM_LOCALID': '5',
             'SLURM_GPUS_ON_NODE': '8', 'SLURM_PROCID': '13'}
  found = cluster.detect(settings.resolve(tiny.get_config()).cluster, environ, tpu_chips=0)
  assert found.arguments == TIMEOUTS and found.kind == 'SLURM, 16 tasks on 2 nodes, one per GPU'
  coordinator, count, process, devices = _resolved(found.arguments, monkeypatch, environ)
  assert (count, process, devices) == (16, 13, [5])  # JAX gives the task the GPU of its local id


def test_slurm_single_task_is_a_single_process():
  environ = {**SLURM, 'SLURM_NTASKS': '1', 'SLURM_LOCALID': '0'}
  assert cluster.detect(settings.resolve(tiny.get_config()).cluster, environ, tpu_chips=0) == cluster.ClusterStart('single process', None)


class _Metadata(http.server.BaseHTTPRequestHandler):
  """A Compute Engine metadata server: worker 1 of a 2-host TPU VM slice."""
  values = {'agent-worker-number': '1', 'worker-network-endpoints': 'w0:0:10.1.0.5,w1:1:10.1.0.6',
            'tpu-env': "ACCELERATOR_TYPE: 'v4-16'\n"}

  def do_GET(self):
    body = self.values.get(self.path.rsplit('/', 1)[-1])
    self.send_response(200 if body is not None and self.headers['Metadata-Flavor'] == 'Google' else 404)
    self.end_headers()
    self.wfile.write((body or '').encode())

  def log_message(self, *args):
    pass


GKE_NODE = {'agent-worker-number': None, 'worker-network-endpoints': None}  # a GKE node's metadata has no TPU workers


@contextlib.contextmanager
def _metadata_server(**values):
  """{'GCE_METADATA_IP': its address} of a metadata server answering `values` over the defaults (None: 404)."""
  handler = type('Metadata', (_Metadata,), {'values': {**_Metadata.values, **values}})
  server = http.server.HTTPServer(('127.0.0.1', 0), handler)
  threading.Thread(target=server.serve_forever, daemon=True).start()
  try:
    yield {'GCE_METADATA_IP': f'127.0.0.1:{server.server_port}'}
  finally:
    server.shutdown()


def test_gke_tpu(monkeypatch):
  environ = {'TPU_WORKER_HOSTNAMES': 'host-0.tpu,host-1.tpu,host-2.tpu,host-3.tpu', 'TPU_WORKER_ID': '2'}
  found = cluster.detect(settings.resolve(tiny.get_config()).cluster, environ, tpu_chips=4)
  assert found.arguments == TIMEOUTS and found.kind == 'GKE TPU'
  with _metadata_server(**GKE_NODE) as metadata:
    assert _resolved(found.arguments, monkeypatch, {**environ, **metadata}, tpu_vm=True) == ('host-0.tpu:8482', 4, 2,
                                                                                            None)


def test_gke_tpu_multislice(monkeypatch):
  environ = {'TPU_WORKER_HOSTNAMES': 'a-0,a-1', 'TPU_WORKER_ID': '1', 'MEGASCALE_COORDINATOR_ADDRESS': 'a-0:9000',
             'MEGASCALE_NUM_SLICES': '2', 'MEGASCALE_SLICE_ID': '1'}
  found = cluster.detect(settings.resolve(tiny.get_config()).cluster, environ, tpu_chips=4)
  assert found.kind == 'GKE TPU (multislice, 2 slices)'
  with _metadata_server(**GKE_NODE) as metadata:
    assert _resolved(found.arguments, monkeypatch, {**environ, **metadata}, tpu_vm=True) == ('a-0:8482', 4, 3, None)


@pytest.mark.parametrize('multi_host', [True, False])
def test_cloud_tpu_vm_slice(monkeypatch, multi_host):
  """gcloud ... ssh --worker=all: no variable names the cluster; JAX asks the VM's metadata server."""
  single = {} if multi_host else {'agent-worker-number': '0', 'worker-network-endpoints': 'w0:0:10.1.0.5'}
  with _metadata_server(**single) as environ:
    found = cluster.detect(settings.resolve(tiny.get_config()).cluster, environ, tpu_chips=4)
    assert found.arguments == TIMEOUTS and found.kind == 'Cloud TPU VM'
    resolved = _resolved(found.arguments, monkeypatch, environ, tpu_vm=True)
  assert resolved == (('10.1.0.5:8482', 2, 1, None) if multi_host else ('10.1.0.5:8482', 1, 0, None))


def test_unknown_environment_is_a_single_process():
  environ = {'HOSTNAME': 'workstation', 'CUDA_VISIBLE_DEVICES': '0'}
  assert cluster.detect(settings.resolve(tiny.get_config()).cluster, environ, tpu_chips=0) == cluster.ClusterStart('single process', None)


def test_start_passes_the_arguments(monkeypatch):
  calls = []
  monkeypatch.setattr(jax.distributed, 'is_initialized', lambda: False)
  monkeypatch.setattr(jax.distributed, 'initialize', lambda **kwargs: calls.append(kwargs))
  monkeypatch.setattr(cluster, '_tpu_chips', lambda: 0)
  for key in cluster.SLURM_VARIABLES + cluster.TPU_HOSTS_VARIABLES + ('OMPI_MCA_orte_hnp_uri',):
    monkeypatch.delenv(key, raising=False)
  config = tiny.get_config()
  config.heartbeat_timeout_seconds = 7
  assert cluster.start(settings.resolve(config).cluster).kind == 'single process' and calls == []
  config.coordinator_address, config.num_processes, config.process_id = 'localhost:5', 2, 1
  assert cluster.start(settings.resolve(config).cluster).kind.startswith('explicit coordinator')
  assert calls == [{'coordinator_address': 'localhost:5', 'num_processes': 2, 'process_id': 1,
                    'heartbeat_timeout_seconds': 7, 'shutdown_timeout_seconds': 60, 'initialization_timeout': 360}]
