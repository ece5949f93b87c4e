"""A process that has imported TensorFlow once and forks each program the suite starts, so that a train.py or
translate.py subprocess begins where a fresh interpreter would be after ~6 s of CPU spent importing it.

Each program is still a process of its own, started as the test starts it: `python train.py ...` runs an
ordinary interpreter whose sitecustomize (this folder) calls `launch()` before anything heavy is imported. The
launcher sends its command line, environment, working directory and standard streams to the server, which
forks; the fork takes them over (its environment replaced before JAX is imported, so JAX reads the test's
device count, platform and cache from it) and runs the script as `__main__`. The launcher stays the process the
test holds: it forwards the signals a test sends (SIGTERM, SIGINT, ...), exits with the program's status or
dies of its signal, and a kill -9 of it kills the program (the fork sees its connection close).

Started by tests/conftest.py, one server per pytest process, only for programs of this repository (not the
installed console scripts, not `python -c`, not an interpreter given options such as `-X importtime`);
TEST_FRESH_INTERPRETERS=1 turns it off. What a fork shares with its siblings and a fresh interpreter does not:
TensorFlow's import-time state (none the programs read) and the string hash seed.
"""

import json
import os
import signal
import socket
import struct
import sys
import threading

ADDRESS = 'TEST_FORK_SERVER'  # the environment variable that holds the server's socket path
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
NOT_FORKED = {os.path.join(ROOT, 'tests', 'helpers', 'gcs_emulator.py'),  # the tests SIGSTOP it: it must be the
              os.path.abspath(__file__)}  # process they hold


def _program(orig_argv: list[str]):
  """('script', path, args) or ('module', name, args) for `python SCRIPT ...` / `python -m MODULE ...` of this
  repository's programs; None for anything else (run as it is)."""
  if len(orig_argv) < 2:
    return None
  first, rest = orig_argv[1], orig_argv[2:]
  if first == '-m' and rest and rest[0].split('.')[0] in ('flax_transformer', 'tools', 'bench', 'tests'):
    return 'module', rest[0], rest[1:]
  if first.startswith('-') or not first.endswith('.py'):
    return None
  path = os.path.abspath(first)
  if not path.startswith(ROOT + os.sep) or path in NOT_FORKED:
    return None
  return 'script', path, rest


def _send(connection, message: dict, fds=()) -> None:
  payload = json.dumps(message).encode()
  data = struct.pack('!I', len(payload)) + payload
  sent = socket.send_fds(connection, [data[:4096]], list(fds))
  connection.sendall(data[sent:])


def _receive(connection) -> tuple[dict, list[int]]:
  data, fds, _, _ = socket.recv_fds(connection, 4096, 3)
  if len(data) < 4:
    data += connection.recv(4 - len(data), socket.MSG_WAITALL)
  (size,) = struct.unpack('!I', data[:4])
  data = data[4:]
  while len(data) < size:
    data += connection.recv(size - len(data), socket.MSG_WAITALL)
  return json.loads(data), fds


def launch() -> None:
  """In a starting interpreter: if a fork server is set and this is one of its programs, have it run there and
  exit as it does (never returns); otherwise return and let the interpreter go on."""
  path = os.environ.get(ADDRESS)
  program = path and not sys.flags.ignore_environment and _program(sys.orig_argv)
  if not program:
    return
  connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
  try:
    connection.connect(path)
  except OSError:
    connection.close()
    return  # no server (it was stopped): a fresh interpreter, as without one
  _send(connection, {'program': program, 'environment': dict(os.environ), 'cwd': os.getcwd()}, (0, 1, 2))
  replies = connection.makefile('r')
  started = replies.readline()
  if not started:  # the server ended before forking it: a fresh interpreter, as without one
    connection.close()
    return
  child = int(started.split()[1])
  for number in FORWARDED:
    signal.signal(number, lambda number, _: os.kill(child, number))
  how, value = (replies.readline() or 'signal 9').split()
  if how == 'signal':
    signal.signal(int(value), signal.SIG_DFL)
    os.kill(os.getpid(), int(value))
  os._exit(int(value) if how == 'exit' else 1)


def _run_forked(connection, request: dict, fds: list[int]) -> int:
  """In the fork: become the program the launcher was started as, and run it."""
  import io
  import runpy
  for number in FORWARDED:
    signal.signal(number, signal.SIG_DFL)
  signal.signal(signal.SIGINT, signal.default_int_handler)
  for target, fd in enumerate(fds):
    os.dup2(fd, target)
    os.close(fd)
  environment = request['environment']
  old_paths = [p for p in os.environ.get('PYTHONPATH', '').split(os.pathsep) if p]
  new_paths = [p for p in environment.get('PYTHONPATH', '').split(os.pathsep) if p]
  os.environ.clear()
  os.environ.update(environment)
  os.chdir(request['cwd'])
  unbuffered = bool(environment.get('PYTHONUNBUFFERED'))
  sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.open(0, 'rb', closefd=False), encoding='utf-8')
  sys.stdout = sys.__stdout__ = io.TextIOWrapper(io.open(1, 'wb', closefd=False), encoding='utf-8',
                                                 line_buffering=os.isatty(1), write_through=unbuffered)
  sys.stderr = sys.__stderr__ = io.TextIOWrapper(io.open(2, 'wb', closefd=False), encoding='utf-8',
                                                 errors='backslashreplace', line_buffering=True)

  def die_with_the_launcher():  # a kill -9 of the launcher closes its end: the program goes with it
    while connection.recv(1):
      pass
    os.kill(os.getpid(), signal.SIGKILL)
  threading.Thread(target=die_with_the_launcher, daemon=True).start()

  kind, name, args = request['program']
  paths = [p for p in sys.path[1:] if p not in old_paths]
  if 'numpy' in sys.modules:  # a fresh interpreter seeds numpy's global generator from the OS
    sys.modules['numpy'].random.seed()
  sys.argv = [name, *args]  # run_module puts the module's file in argv[0], as `python -m` does
  sys.path[:] = [os.path.dirname(name) if kind == 'script' else os.getcwd(), *new_paths, *paths]
  if kind == 'script':
    runpy.run_path(name, run_name='__main__')
  else:
    runpy.run_module(name, run_name='__main__', alter_sys=True)
  return 0


def freeze_imported_objects() -> None:
  """After the heavy imports: their millions of objects moved out of the garbage collector's reach (they live as
  long as the process), and collections made rarer. Tracing a jitted step allocates objects by the million; with
  TensorFlow imported each full collection walked everything. Measured on test_search, test_translator and
  test_model in one process: 80.0 s -> 74.2 s (freeze) -> 71.9 s (and the thresholds), medians of two."""
  import gc
  gc.freeze()
  gc.set_threshold(50_000, 20, 20)  # Python's default: (700, 10, 10)


def serve(path: str) -> None:
  """Binds `path` (launchers may connect at once and wait), imports TensorFlow, then forks a program per
  connection and tells its launcher the fork's pid and, when it ends, its exit status. Ends with its parent."""
  import select
  parent = os.getppid()
  listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
  listener.bind(path)
  listener.listen(128)
  sys.path.insert(0, ROOT)
  from flax_transformer import tensorflow_setup
  tensorflow_setup.import_quietly()
  import tensorflow_datasets  # noqa: F401  (read by the tfds source)
  freeze_imported_objects()
  children = {}  # pid -> the connection to its launcher
  while os.getppid() == parent:
    if select.select([listener], [], [], 0.05)[0]:
      connection, _ = listener.accept()
      request, fds = _receive(connection)
      sys.stdout.flush()
      sys.stderr.flush()
      pid = os.fork()
      if pid == 0:
        listener.close()
        for other in children.values():
          other.close()
        raise SystemExit(_run_forked(connection, request, fds))
      for fd in fds:
        os.close(fd)
      connection.sendall(f'pid {pid}\n'.encode())
      children[pid] = connection
    while children:
      pid, status = os.waitpid(-1, os.WNOHANG)
      if pid == 0:
        break
      connection = children.pop(pid)
      ended = f'signal {os.WTERMSIG(status)}' if os.WIFSIGNALED(status) else f'exit {os.waitstatus_to_exitcode(status)}'
      try:
        connection.sendall(f'{ended}\n'.encode())
      except OSError:
        pass  # its launcher is gone (killed)
      connection.close()
  for pid in children:
    os.kill(pid, signal.SIGKILL)


_started = {}  # in a pytest process: its server's process and socket path
_starting = threading.Lock()


def started(environment: dict) -> str | None:
  """In a pytest process: the socket path of its server, started with `environment` at the first call (bound
  before it imports anything, so launchers may queue at once); None if it could not start."""
  import atexit
  import subprocess
  import tempfile
  import time
  with _starting:
    if not _started:
      path = os.path.join(tempfile.mkdtemp(prefix='fork_server_'), 'socket')
      environment = {k: v for k, v in environment.items() if k != ADDRESS}
      process = subprocess.Popen([sys.executable, os.path.abspath(__file__), path], env=environment,
                                 stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
      deadline = time.monotonic() + 60
      while not os.path.exists(path) and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
      if not os.path.exists(path):
        process.kill()
        return None
      atexit.register(process.kill)
      _started.update(process=process, path=path)
    return _started['path']


if __name__ == '__main__':
  serve(sys.argv[1])
