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
import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Mapping

import jax

from flax_transformer.errors import UserError
from flax_transformer.settings_fields import setting

TPU_HOSTS_VARIABLES = ('TPU_WORKER_HOSTNAMES', 'TPU_PROCESS_ADDRESSES')
SLURM_VARIABLES = ('SLURM_JOB_ID', 'SLURM_STEP_NODELIST', 'SLURM_NTASKS', 'SLURM_PROCID', 'SLURM_LOCALID')


@dataclasses.dataclass(frozen=True)
class ClusterSettings:
  """How the processes of a run start and watch each other: config fields of these names (train), flags of these
  names (translate); the defaults are a program's without a config."""
  coordinator_address: str = setting("host:port of process 0 (e.g. '10.0.0.1:1234'); '' detects the cluster from "
                                     "the environment (TPU VM, GKE, SLURM, Open MPI) or runs one process.",
                                     before='', default='')
  num_processes: int = setting('Processes of the run, with coordinator_address.', minimum=1, before=1, default=1)
  process_id: int = setting("This process's number, 0 to num_processes - 1, with coordinator_address.", minimum=0,
                            before=0, default=0)
  initialization_timeout_seconds: int = setting('How long the processes have to start and find each other.',
                                                minimum=1, before=300, default=300)
  heartbeat_timeout_seconds: int = setting('A process silent this long is dead: every other one stops, naming it.',
                                           minimum=1, before=30, default=30)
  shutdown_timeout_seconds: int = setting('How long an exiting process waits for the others at the end.', minimum=1,
                                          before=60, default=60)


@dataclasses.dataclass(frozen=True)
class ClusterStart:
  kind: str  # what the banner names
  arguments: dict | None  # for jax.distributed.initialize; None: a single process, no initialisation


def _tpu_chips() -> int:
  """The TPU chips on the PCI bus of the host (read from its devices list: no backend starts)."""
  from jax._src import hardware_utils
  return hardware_utils.num_available_tpu_chips_and_device_id()[0]


def _gpus_on_node(environ: Mapping[str, str]) -> int | None:
  """The node's GPUs as SLURM or CUDA names them, None if neither does."""
  if environ.get('SLURM_GPUS_ON_NODE', '').isdigit():
    return int(environ['SLURM_GPUS_ON_NODE'])
  visible = environ.get('CUDA_VISIBLE_DEVICES', '')
  return len(visible.split(',')) if visible and visible != 'NoDevFiles' else None


def detect(cluster_settings: ClusterSettings, environ: Mapping[str, str] | None = None,
           tpu_chips: int | None = None) -> ClusterStart:
  """The cluster this process runs in and the `jax.distributed.initialize` arguments that start it."""
  environ = os.environ if environ is None else environ
  timeouts = {'heartbeat_timeout_seconds': cluster_settings.heartbeat_timeout_seconds,
              'shutdown_timeout_seconds': cluster_settings.shutdown_timeout_seconds}
  address, count, index = (cluster_settings.coordinator_address, cluster_settings.num_processes,
                            cluster_settings.process_id)
  if address:  # settings.py checked that 0 <= index < count
    return ClusterStart(f'explicit coordinator {address}, {count} processes',
                        {'coordinator_address': address, 'num_processes': count, 'process_id': index, **timeouts})
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


def start(cluster_settings: ClusterSettings, spelling: str = '--config.') -> ClusterStart:
  """Starts jax.distributed as `detect` says (once per process; before anything asks JAX for devices). Processes
  that have not all joined within config.initialization_timeout_seconds stop with one line naming who is
  missing (JAX itself would abort the process a minute later with a C++ stack dump). `spelling`: how the
  program's command line spells a cluster setting (`--config.process_id`, or `--process_id`)."""
  found = detect(cluster_settings)
  if found.arguments is not None and not jax.distributed.is_initialized():
    jax.config.update('jax_cpu_collectives_implementation', 'gloo')  # collectives of CPU devices (tests, CPU clusters)
    seconds = cluster_settings.initialization_timeout_seconds
    watchdog = threading.Timer(seconds, _not_joined, (found, cluster_settings, spelling))
    watchdog.daemon = True
    watchdog.start()
    try:
      jax.distributed.initialize(**found.arguments, initialization_timeout=seconds + 60)
    finally:
      watchdog.cancel()
  return found


def _not_joined(found: ClusterStart, cluster_settings: ClusterSettings, spelling: str) -> None:
  """The line and exit of a process whose run's processes did not all join in time."""
  seconds, address = cluster_settings.initialization_timeout_seconds, cluster_settings.coordinator_address
  if address:
    count, index = cluster_settings.num_processes, cluster_settings.process_id
    others = f'process {1 - index}' if count == 2 else f'one or more of the other {count - 1} processes'
    where = (f'waiting as the coordinator at {address}' if index == 0 else
             f'its coordinator at {address} is not answering')
    _stop(f'process {index} of {count}: {others} did not join within {seconds} s ({where}); start all {count} '
          f'processes of the run ({spelling}process_id 0 to {count - 1}) with {spelling}coordinator_address={address}, '
          f'or raise {spelling}initialization_timeout_seconds')
  _stop(f'the processes of this {found.kind} run did not all join within {seconds} s; start every process of the '
        f'job, or raise {spelling}initialization_timeout_seconds')


# --- One failure stops every process ----------------------------------------------------------
# JAX's own heartbeat ends a process whose peer died with a C++ abort after `heartbeat_timeout_seconds`.
# Before that, every process beats a counter in the coordination service's key-value store each second
# and watches the others': a peer silent for a quarter of the heartbeat timeout is named and this process exits 1
# (JAX's service, beating at half the timeout, can find a dead peer from half the timeout on: seen at 5.8 s of 10).
# A process that stops on an error posts it there first, so every process exits with the same cause.

_KEYS = 'flax_transformer'
_watch = None


def _stop(line: str) -> None:
  sys.stdout.flush()
  print(f'error: {line}', file=sys.stderr, flush=True)
  os._exit(1)  # not sys.exit: threads waiting in collectives or Orbax would keep the process alive


class PeerWatch(threading.Thread):
  """Beats this process's counter and watches the others' counters and posted errors, once a second."""

  def __init__(self, client, silence_seconds: float):
    super().__init__(name='peer-watch', daemon=True)
    self.client, self.silence_seconds = client, silence_seconds
    self.process, self.count = jax.process_index(), jax.process_count()
    self.stopping = False  # this process posted its own error: the others must read it, not be named dead
    self.finished = threading.Event()  # this process's work is done (finish_watching)

  def run(self):
    beats, seen, unreachable_since, done = 0, {}, None, set()
    while not self.finished.is_set():
      now = time.monotonic()
      try:
        beats += 1
        self.client.key_value_set(f'{_KEYS}/alive/{self.process}', str(beats), True)
        for key, message in self.client.key_value_dir_get(f'{_KEYS}/error/'):
          process = int(key.rsplit('/', 1)[-1])
          if process != self.process and not self.stopping:
            _stop(f'process {process} of {self.count}: {message}')
        for peer in range(self.count):
          if peer != self.process and peer not in done:
            value = _try_get(self.client, f'{_KEYS}/alive/{peer}')
            if value == DONE:  # its work is done: its silence from now on is its exit
              done.add(peer)
            elif value is not None and value != seen.get(peer, (None,))[0]:
              seen[peer] = (value, now)
            elif peer in seen and now - seen[peer][1] > self.silence_seconds and not self.stopping:
              _stop(f'process {peer} of {self.count} stopped responding {self.silence_seconds:g} s ago (killed, '
                    f'preempted or hung); this process stops too; process {peer}\'s log holds the cause')
        unreachable_since = None
      except Exception as error:  # the coordination service itself (on process 0) is gone
        unreachable_since = unreachable_since or now
        if now - unreachable_since > self.silence_seconds and not self.stopping:
          _stop(f'the coordination service on process 0 cannot be reached ({type(error).__name__}); process 0 '
                f'stopped (its log holds the cause) and this process stops too')
      self.finished.wait(1.0)


def _try_get(client, key: str) -> str | None:
  try:
    return client.key_value_try_get(key)
  except Exception:  # not set yet
    return None


def watch_peers(cluster_settings: ClusterSettings) -> None:
  """Starts the PeerWatch of a multi-process run (once per process)."""
  global _watch
  if jax.process_count() > 1 and _watch is None:
    from jax._src import distributed
    _watch = PeerWatch(distributed.global_state.client, cluster_settings.heartbeat_timeout_seconds / 4)
    _watch.start()


DONE = 'done'  # the beat of a process whose work is done


def finish_watching() -> None:
  """Before a process whose work is done exits: it stops watching its peers and tells them it is done, so its
  silence is not taken for a death (and no daemon thread is inside a coordination-service call while the
  interpreter exits, which aborts the process)."""
  if _watch is None or _watch.finished.is_set():
    return
  _watch.finished.set()
  _watch.join(timeout=10)
  try:
    _watch.client.key_value_set(f'{_KEYS}/alive/{_watch.process}', DONE, True)
  except Exception:  # the service is gone already: nobody is watching
    pass


def stop_all(message: str) -> None:
  """Stops this process on `message`, and with it every other process, which all print the same cause."""
  if _watch is None:
    _stop(message)
  _watch.stopping = True
  line = f'process {_watch.process} of {_watch.count}: {message}'
  try:
    _watch.client.key_value_set(f'{_KEYS}/error/{_watch.process}', message.replace('\n', ' '), True)
    time.sleep(3.0)  # the others read it within a second; the coordination service lives in process 0 (leave_last)
  except Exception:
    pass
  _stop(line)


def leave_last() -> None:
  """Before process 0 exits on an error every process met: the others exit first, since the coordination
  service they are connected to lives in process 0 (their exit would otherwise be an abort of JAX's client)."""
  if jax.process_count() > 1 and jax.process_index() == 0:
    time.sleep(3.0)


def stop_all_after_failure(error: Exception) -> None:
  """Stops every process after an error on this one. A failed collective or save is often the symptom of a
  peer that died: the PeerWatch is given the time to name it first; else this error is the cause (a
  UserError's one line, or any other error's traceback and first line)."""
  if _watch is None:
    return
  time.sleep(_watch.silence_seconds + 3)
  if isinstance(error, UserError):
    stop_all(str(error))
  traceback.print_exception(error)
  stop_all(f'{type(error).__name__}: {(str(error).strip().splitlines() or [""])[0][:300]}')


def together(work) -> None:
  """Runs `work()`, the whole of a program's work on each of its processes: when done, this process tells the
  others (finish_watching); an error met by every process (ProcessError) ends them all as it is; any other
  error on this one stops every other with its line (or the dead peer's, if one died)."""
  try:
    work()
    finish_watching()
  except ProcessError:  # every process raised it: nothing to tell the others
    leave_last()
    raise
  except Exception as error:
    if jax.distributed.is_initialized():
      stop_all_after_failure(error)
    raise


def agree(name: str, error: Exception | None = None, value: str = '') -> list[str]:
  """Every process's `value` at point `name` (a key-value all-gather, no device collective); if any
  process passes an `error`, every process raises the same ProcessError naming it."""
  if jax.process_count() == 1:
    if error is not None:
      raise error
    return [value]
  from jax._src import distributed
  client, process, count = distributed.global_state.client, jax.process_index(), jax.process_count()
  failure = '' if error is None else f'{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ""}'
  client.key_value_set(f'{_KEYS}/agree/{name}/{process}', json.dumps([failure, value]), True)
  posted = [json.loads(client.blocking_key_value_get(f'{_KEYS}/agree/{name}/{p}', AGREE_TIMEOUT_MS))
            for p in range(count)]
  failed = [(p, f) for p, (f, _) in enumerate(posted) if f]
  if failed:
    p, first = failed[0]
    raise ProcessError(p, count, first, error if failed[0][0] == process else None)
  return [v for _, v in posted]


def check_same(name: str, values: dict) -> None:
  """Every process holds the same flat `values` (e.g. settings.comparable's config), or every process raises one
  ProcessError naming the first field that differs from process 0's."""
  if jax.process_count() == 1:
    return
  posted = [json.loads(v) for v in agree(name, value=json.dumps(values, sort_keys=True, default=str))]
  for process, other in enumerate(posted[1:], 1):
    differing = sorted(k for k in set(posted[0]) | set(other) if posted[0].get(k) != other.get(k))
    if differing:
      key = differing[0]
      raise ProcessError(process, len(posted), f'config.{key}={other.get(key)!r} but process 0 has '
                         f'{posted[0].get(key)!r} ({len(differing)} field(s) differ); start every process of a run '
                         f'with the same config (only config.process_id differs)')


AGREE_TIMEOUT_MS = 4 * 3600 * 1000  # as long as the slowest process may take to get there (the vocabulary)


class ProcessError(UserError):
  """An error one process met, raised on every process."""

  def __init__(self, process: int, count: int, message: str, original: Exception | None = None):
    super().__init__(f'process {process} of {count}: {message}')
    self.original = original


_gathers = 0  # gathered_texts calls so far: each barrier's key is its own


def gathered_texts(mine: list[str], total: int, what: str) -> list[str]:
  """Every process's texts, given each holds those of items process_index, process_index + processes, ... of
  `total`: all `total` of them in order, on every process. A barrier of the coordination service first (the
  processes may get there minutes apart: a device collective on CPU gives up after 30 s), then two all-gathers
  (the sizes, then the bytes). `what`: the texts, named if the barrier is never reached."""
  if jax.process_count() == 1:
    return list(mine)
  global _gathers
  _gathers += 1
  import numpy as np
  from jax.experimental import multihost_utils
  from orbax.checkpoint import multihost
  multihost.get_barrier_sync_fn()(key=f'{_KEYS}/gather/{_gathers}/{what}', timeout_ms=AGREE_TIMEOUT_MS)
  encoded = [text.encode('utf-8') for text in mine]
  sizes = np.asarray(multihost_utils.process_allgather(np.array([len(encoded), sum(map(len, encoded))], np.int64)))
  rounded = lambda n, least: max(least, 1 << (int(n) - 1).bit_length())  # few shapes: few compiled all-gathers
  lengths = np.zeros((rounded(sizes[:, 0].max(), 64),), np.int64)
  lengths[:len(encoded)] = [len(e) for e in encoded]
  data = np.zeros((rounded(sizes[:, 1].max(), 4096),), np.uint8)
  data[:sizes[jax.process_index(), 1]] = np.frombuffer(b''.join(encoded), np.uint8)
  lengths, data = (np.asarray(x) for x in multihost_utils.process_allgather((lengths, data)))  # [P, ...] each
  texts = [''] * total
  for process in range(len(sizes)):
    ends = np.cumsum(lengths[process, :sizes[process, 0]])
    for n, (start, end) in enumerate(zip(np.concatenate([[0], ends[:-1]]), ends)):
      texts[process + n * len(sizes)] = bytes(data[process, start:end]).decode('utf-8')
  return texts
