"""Where the product reads and writes: local paths and storage URLs (gs://, s3://) through `etils.epath`.

Every file the product touches (config.json, the vocabulary, checkpoints and their data state, metrics,
TensorBoard, translations, data and translation inputs) is named by `path(location)`, so a `gs://` workdir
works wherever a local one does. Orbax writes its arrays through TensorStore and the rest through the same
epath, so one URL is one place for every process of a run.

URLs go through fsspec (gcsfs for gs://): one backend whose exclusive create (`create_exclusive`) makes the
workdir lock, and which reaches a local emulator through the standard variable: with
`STORAGE_EMULATOR_HOST=http://127.0.0.1:PORT` set, TensorStore (`TENSORSTORE_GCS_HTTP_URL`) and gcsfs both
talk to it, so tests run a pod's storage on one machine.
"""

import contextlib
import logging
import os
import posixpath
import re
import tempfile
import threading
import time

os.environ.setdefault('EPATH_USE_TF', 'false')  # gs:// through fsspec (gcsfs), which an emulator can stand in for
# A storage server that stops answering fails a request instead of hanging it: TensorStore (Orbax's arrays)
# gives up on a connection after CONNECT_SECONDS and on a transfer idle for IDLE_SECONDS; so does gcsfs (below).
CONNECT_SECONDS, IDLE_SECONDS = 15, 60
os.environ.setdefault('TENSORSTORE_CURL_CONNECT_TIMEOUT_SECONDS', str(CONNECT_SECONDS))
os.environ.setdefault('TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS', str(IDLE_SECONDS))
os.environ.setdefault('TENSORSTORE_CURL_LOW_SPEED_LIMIT_BYTES', '1')
if os.environ.get('STORAGE_EMULATOR_HOST'):
  os.environ.setdefault('TENSORSTORE_GCS_HTTP_URL', os.environ['STORAGE_EMULATOR_HOST'])
  os.environ.setdefault('GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT', 'false')  # its bucket probe speaks gRPC to real GCS only

import aiohttp  # noqa: E402
import fsspec  # noqa: E402
from etils import epath  # noqa: E402

for _protocol in ('gs', 'gcs', 's3'):  # other processes change the same folders: list them anew every time
  fsspec.config.conf.setdefault(_protocol, {}).setdefault('use_listings_cache', False)
for _protocol in ('gs', 'gcs'):  # per request: connect within CONNECT_SECONDS, then never idle for IDLE_SECONDS
  fsspec.config.conf[_protocol].setdefault('requests_timeout', aiohttp.ClientTimeout(
      total=None, sock_connect=CONNECT_SECONDS, sock_read=IDLE_SECONDS))
logging.getLogger('gcsfs').setLevel(logging.CRITICAL)  # its retries end in an exception the product reports in one line

from flax_transformer.errors import UserError  # noqa: E402


class StorageError(UserError):
  """A location that cannot be reached, read or written."""


def is_url(location) -> bool:
  return '://' in os.fspath(location)


def path(location) -> epath.Path:
  """A local path (made absolute: Orbax and other processes need it so) or a storage URL, as an epath.Path."""
  location = os.fspath(location)
  if not location:
    raise StorageError('an empty path was given; name a file or directory (local or gs://...)')
  if is_url(location):
    return epath.Path(location)
  return epath.Path(os.path.abspath(os.path.expanduser(location)))


def resolved(location) -> str:
  """`location` as the one place it names: a local path absolute with its symbolic links and '..' resolved, a
  URL with its path normalised."""
  location = os.fspath(location)
  if is_url(location):
    scheme, rest = location.split('://', 1)
    return f'{scheme}://{posixpath.normpath("/" + rest).lstrip("/")}'
  return os.path.realpath(os.path.abspath(os.path.expanduser(location)))


def _relation(output: str, other: str) -> str | None:
  """How the resolved `output` lies to the resolved `other`: 'is', 'holds', 'is inside', or None."""
  if output == other:
    return 'is'
  if other.startswith(output.rstrip('/') + '/'):
    return 'holds'
  if output.startswith(other.rstrip('/') + '/'):
    return 'is inside'
  return None


def check_output(label: str, output, reads: dict, fix: str = 'write the output to a place outside it') -> None:
  """Refuses an `output` (named `label` in the message, e.g. '--output=X') that is, holds or sits inside anything
  the program reads: `reads` maps what each is ('the workdir', 'the input', ...) to its location (None, '' or
  '-' for none). Locations are compared resolved (symbolic links, '..'), so no spelling of a path lets an output
  land on an input."""
  if not output or output == '-':
    return
  target = resolved(output)
  for what, location in reads.items():
    if not location or location == '-':
      continue
    relation = _relation(target, resolved(location))
    if relation:
      raise StorageError(f'{label} {relation} {what} {location}, which this program reads; {fix}')


def check_replaceable(flag: str, output, overwrite: bool) -> None:
  """A folder output that `staged_directory` may write: absent, empty, or with `overwrite` any folder."""
  output = path(resolved(output))
  if output.exists() and not output.is_dir():
    raise StorageError(f'{flag}={output} is a file; give a folder (a new one, or an existing one with --overwrite)')
  if output.is_dir() and any(output.iterdir()) and not overwrite:
    raise StorageError(f'{output} is not empty; choose a new {flag} or pass --overwrite to replace it')


@contextlib.contextmanager
def staged_directory(output):
  """A new folder beside `output` to write into (yielded as an epath.Path); when the block ends without error it
  is swapped in for `output` (through its symbolic link, if `output` is one), and a previous `output` is removed
  only then; after an error it is removed and `output` is as it was. Readers never see a half-written folder."""
  output = path(resolved(output))
  staging = output.parent / f'.{output.name}.partial.{os.getpid()}'
  if staging.exists():
    staging.rmtree()
  staging.mkdir(parents=True)
  try:
    yield staging
  except BaseException:
    if staging.exists():
      staging.rmtree()
    raise
  replaced = output.parent / f'.{output.name}.replaced.{os.getpid()}'
  if output.exists():
    move(output, replaced)
  move(staging, output)
  if replaced.exists():
    replaced.rmtree()


def check_reachable(location, flag: str, timeout: float = CONNECT_SECONDS) -> None:
  """For a gs:// location, that its storage server (STORAGE_EMULATOR_HOST, else Google's) accepts a connection
  within `timeout` seconds: one line naming it if not, instead of a minute of retries in every later call."""
  location = os.fspath(location)
  if not location.startswith(('gs://', 'gcs://')):
    return
  import socket
  import urllib.parse
  endpoint = urllib.parse.urlsplit(os.environ.get('STORAGE_EMULATOR_HOST') or 'https://storage.googleapis.com')
  host, port = endpoint.hostname, endpoint.port or (443 if endpoint.scheme == 'https' else 80)
  try:
    socket.create_connection((host, port), timeout=timeout).close()
  except OSError as error:
    reason = 'no answer within {:g} s'.format(timeout) if isinstance(error, TimeoutError) else _reason(error)
    raise StorageError(f'{flag}={location}: the storage server {host}:{port} cannot be reached ({reason}); check '
                       f'the network' + (' and STORAGE_EMULATOR_HOST' if os.environ.get('STORAGE_EMULATOR_HOST')
                                         else '')) from None


class Overdue(StorageError):
  """A storage call that did not finish in its time."""


def overdue(what: str, seconds: float) -> Overdue:
  return Overdue(f'{what} did not finish within {seconds:g} s: the storage stopped answering (raise '
                 f'config.storage_timeout_seconds if it is only slow)')


# Once one storage call has overrun or failed, the program is stopping: every later call together (the look at
# what a failed save left, the closing writes, the lock) ends within SHUTDOWN_SECONDS of that moment, so a
# storage server that stopped answering costs the timeout once, not once per call.
SHUTDOWN_SECONDS = 5.0
_shutdown_deadline = None


def stopping() -> None:
  """Starts the shutdown's one deadline (if it has not started): see SHUTDOWN_SECONDS."""
  global _shutdown_deadline
  if _shutdown_deadline is None:
    _shutdown_deadline = time.monotonic() + SHUTDOWN_SECONDS


@contextlib.contextmanager
def one_shutdown():
  """A program's storage calls (a training run's) in this block share one shutdown deadline (`stopping`),
  started afresh."""
  global _shutdown_deadline
  _shutdown_deadline = None
  try:
    yield
  finally:
    _shutdown_deadline = None


def _left(seconds: float) -> float:
  """`seconds`, or what is left of the shutdown's deadline if that is sooner."""
  if _shutdown_deadline is None:
    return seconds
  return max(min(seconds, _shutdown_deadline - time.monotonic()), 0.01)


def within(seconds: float, what: str, call, own_errors: bool = False):
  """`call()`'s result, awaited at most `seconds` (less once the program is stopping: SHUTDOWN_SECONDS). A call
  that has not returned by then (a storage server that stopped answering) is a StorageError naming `what`, and
  is left behind in its daemon thread; a call that fails is a StorageError naming `what` and the cause (a full
  disk, a connection the server dropped), a UserError as itself; with `own_errors`, every error as itself
  (the caller says what failed)."""
  outcome, seconds = {}, _left(seconds)

  def target():
    try:
      outcome['value'] = call()
    except BaseException as error:  # handed to the caller's thread
      outcome['error'] = error

  thread = threading.Thread(target=target, name=f'storage: {what}', daemon=True)
  thread.start()
  thread.join(seconds)
  if thread.is_alive():
    stopping()
    raise overdue(what, round(seconds, 1))
  error = outcome.get('error')
  if error is not None:
    stopping()
    raise error if isinstance(error, UserError) or own_errors or not isinstance(error, Exception) else \
        StorageError(f'{what} failed ({_reason(error)})')
  return outcome.get('value')


def _reason(error: Exception) -> str:
  text = re.sub(r'\{\{[^}]*\}\}\s*', '', str(error)).strip()  # TensorFlow's {{function_node ...}} prefix
  return f'{type(error).__name__}: {(text.splitlines() or [""])[0][:200]}'


def check_writable(directory, what: str, fix: str) -> None:
  """Creates `directory` and writes, reads back and removes a probe in it (one per process), or raises one
  line naming the location, `what` it is and the `fix`."""
  directory = path(directory)
  probe = directory / f'.write_test.{os.uname().nodename}.{os.getpid()}'
  try:
    directory.mkdir(parents=True, exist_ok=True)
    probe.write_text('ok')
    if probe.read_text() != 'ok':
      raise OSError('the probe read back differs from what was written')
    probe.unlink()
  except Exception as error:  # OSError locally; gcsfs and aiohttp raise their own types for URLs
    raise StorageError(f'{what} {directory} cannot be written ({_reason(error)}); {fix}') from None


def write_atomic(location, data: bytes | str) -> None:
  """Writes a whole file so readers see the old content or the new, never a part: a local file through a
  temporary name and a rename; an object store's upload is atomic already."""
  location = path(location)
  data = data.encode('utf-8') if isinstance(data, str) else data
  if is_url(location):
    location.write_bytes(data)
    return
  temporary = location.parent / f'.{location.name}.tmp.{os.getpid()}.{threading.get_ident()}'
  temporary.write_bytes(data)
  os.replace(temporary, location)


def move(source, target) -> None:
  """Renames a file or folder. An object store has no rename: its objects are copied, then deleted (gcsfs's
  own move first tries an API that not every bucket offers, retrying each object for seconds)."""
  source, target = path(source), path(target)
  if not is_url(source):
    os.rename(source, target)
    return
  filesystem = fsspec.core.url_to_fs(os.fspath(source))[0]
  filesystem.copy(os.fspath(source), os.fspath(target), recursive=True)
  filesystem.rm(os.fspath(source), recursive=True)


def create_exclusive(location, text: str) -> bool:
  """Creates the file with `text` unless it exists (atomically, on local disks and object stores alike):
  True if this call created it."""
  location = path(location)
  try:
    if is_url(location):
      import fsspec
      with fsspec.open(os.fspath(location), 'xb') as f:
        f.write(text.encode('utf-8'))
    else:
      descriptor = os.open(location, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
      with os.fdopen(descriptor, 'w') as f:
        f.write(text)
  except FileExistsError:
    return False
  return True


def whole_lines(text: str) -> str:
  """`text` up to its last newline: what a writer cut short mid-line (a full disk, kill -9) leaves is dropped."""
  return text[:text.rfind('\n') + 1]


class AppendedFile:
  """A text file the run appends to (metrics), on any storage: local files are appended to; an object
  store's object, which cannot be appended to, is rewritten whole from a local copy at each `flush`."""

  def __init__(self, location):
    self.location = path(location)
    if is_url(self.location):
      self._local = tempfile.NamedTemporaryFile('w+', suffix=f'.{self.location.name}', delete=True)
      if self.location.exists():
        self._local.write(whole_lines(self.location.read_text()))
      self._file = self._local
    else:
      if self.location.exists():  # a line cut short (a full disk, a kill) is dropped, not continued
        with open(self.location, 'r+b') as f:
          f.truncate(f.read().rfind(b'\n') + 1)
      self._local, self._file = None, open(self.location, 'a')

  def write(self, text: str) -> None:
    self._file.write(text)

  def flush(self) -> None:
    self._file.flush()
    if self._local is not None:
      self._local.seek(0)
      self.location.write_text(self._local.read())

  def close(self) -> None:
    self.flush()
    self._file.close()


class MirroredDirectory:
  """A local directory whose files are copied to `location` at each `sync` (TensorBoard's event files:
  TensorFlow's own writer cannot reach every store the product can). For a local `location`, that
  directory itself."""

  def __init__(self, location):
    self.location = path(location)
    self.local = tempfile.mkdtemp(prefix='mirror_') if is_url(self.location) else os.fspath(self.location)

  def sync(self) -> None:
    if not is_url(self.location):
      return
    for root, _, files in os.walk(self.local):
      for name in files:
        source = os.path.join(root, name)
        target = self.location / os.path.relpath(source, self.local)
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(source, 'rb') as f:
          target.write_bytes(f.read())
