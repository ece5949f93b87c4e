"""How the processes of a run find each other: one function reads the cluster's environment and says which
arguments `jax.distributed.initialize` gets; JAX's own cluster detection fills in the rest.

  explicit coordinator   --config.coordinator_address / num_processes / process_id (any machines, tests)
  Cloud TPU VM           a TPU VM slice, single- or multi-host (JAX reads the VM's metadata server)
  GKE TPU                TPU pods on GKE (TPU_WORKER_HOSTNAMES / TPU_PROCESS_ADDRESSES)
  SLURM                  srun with more than one task: one task per node sees all the node's GPUs,
                         one task per GPU sees its own (SLURM_LOCALID)
  Open MPI               mpirun (OMPI_MCA_orte_hnp_uri)
  single process         anything else: no jax.distributed, the devices this process sees

Every multi-process start sets the heartbeat and shutdown timeouts of the run config, so a process that
dies is noticed by the others within `config.heartbeat_timeout_seconds`.
"""

import dataclasses
import os
from collections.abc import Mapping

import jax

from flax_transformer.errors import ConfigError

TPU_HOSTS_VARIABLES = ('TPU_WORKER_HOSTNAMES', 'TPU_PROCESS_ADDRESSES')
SLURM_VARIABLES = ('SLURM_JOB_ID', 'SLURM_STEP_NODELIST', 'SLURM_NTASKS', 'SLURM_PROCID', 'SLURM_LOCALID')


@dataclasses.dataclass(frozen=True)
class ClusterStart:
  kind: str  # what the banner names
  arguments: dict | None  # for jax.distributed.initialize; None: a single process, no initialisation


def _tpu_chips() -> int:
  """TPU chips attached to this machine (read from its PCI devices: no backend starts)."""
  from jax._src import hardware_utils
  return hardware_utils.num_available_tpu_chips_and_device_id()[0]


def _gpus_on_node(environ: Mapping[str, str]) -> int | None:
  """The node's GPUs as SLURM or CUDA names them, None if neither does."""
  if environ.get('SLURM_GPUS_ON_NODE', '').isdigit():
    return int(environ['SLURM_GPUS_ON_NODE'])
  visible = environ.get('CUDA_VISIBLE_DEVICES', '')
  return len(visible.split(',')) if visible and visible != 'NoDevFiles' else None


def detect(config, environ: Mapping[str, str] | None = None, tpu_chips: int | None = None) -> ClusterStart:
  """The cluster this process runs in and the `jax.distributed.initialize` arguments that start it."""
  environ = os.environ if environ is None else environ
  timeouts = {'heartbeat_timeout_seconds': config.heartbeat_timeout_seconds,
              'shutdown_timeout_seconds': config.shutdown_timeout_seconds}
  if config.coordinator_address:
    if not 0 <= config.process_id < config.num_processes:
      raise ConfigError(f'config.process_id={config.process_id} is outside 0..{config.num_processes - 1} '
                        f'(config.num_processes={config.num_processes}); give each process its own id')
    return ClusterStart(f'explicit coordinator {config.coordinator_address}, {config.num_processes} processes',
                        {'coordinator_address': config.coordinator_address, 'num_processes': config.num_processes,
                         'process_id': config.process_id, **timeouts})
  if (_tpu_chips() if tpu_chips is None else tpu_chips) > 0:
    kind = 'GKE TPU' if any(environ.get(v) for v in TPU_HOSTS_VARIABLES) else 'Cloud TPU VM'
    if environ.get('MEGASCALE_COORDINATOR_ADDRESS'):
      kind += f' (multislice, {environ.get("MEGASCALE_NUM_SLICES", "several")} slices)'
    return ClusterStart(kind, dict(timeouts))  # JAX finds hosts, process ids and the coordinator itself
  if all(v in environ for v in SLURM_VARIABLES) and int(environ['SLURM_NTASKS']) > 1:
    tasks = int(environ['SLURM_NTASKS'])
    nodes = int(environ.get('SLURM_STEP_NUM_NODES') or environ.get('SLURM_NNODES') or tasks)
    if tasks == nodes:  # one task per node: it drives every GPU of its node (JAX alone would give it one)
      gpus = _gpus_on_node(environ)
      devices = list(range(gpus)) if gpus else []  # [] leaves every device visible
      return ClusterStart(f'SLURM, {tasks} tasks on {nodes} nodes, one per node with all its GPUs',
                          {'local_device_ids': devices, **timeouts})
    return ClusterStart(f'SLURM, {tasks} tasks on {nodes} nodes, one per GPU', dict(timeouts))
  if 'OMPI_MCA_orte_hnp_uri' in environ:
    return ClusterStart('Open MPI', dict(timeouts))
  return ClusterStart('single process', None)


def start(config) -> ClusterStart:
  """Starts jax.distributed as `detect` says (once per process; before anything asks JAX for devices)."""
  found = detect(config)
  if found.arguments is not None and not jax.distributed.is_initialized():
    jax.config.update('jax_cpu_collectives_implementation', 'gloo')  # collectives of CPU devices (tests, CPU clusters)
    jax.distributed.initialize(**found.arguments)
  return found
