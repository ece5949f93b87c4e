"""Corpora fetched on first use: the files a config names, downloaded once into their folder and checked.

A run whose data files are missing and whose `config.download_url` is set (configs/multi30k.py sets Multi30k's)
downloads each missing file from that URL (`{name}` replaced by the file's name), checks it against the
SHA-256 recorded here, and renames it into place only then: a failed or interrupted download leaves nothing
that could be read as data. Offline, the error names the command that fetches the files on another machine.

Multi30k task 1 (Elliott et al., 2016) comes from the multi30k/dataset repository at a pinned commit.
"""

import contextlib
import glob
import hashlib
import os
import signal
import threading
import time
import urllib.error
import urllib.request

from flax_transformer import run_lock
from flax_transformer.errors import UserError

MULTI30K_COMMIT = 'a3d2e0d26b56f3846f66a952536ffed4e401d05a'
MULTI30K_URL = f'https://raw.githubusercontent.com/multi30k/dataset/{MULTI30K_COMMIT}/data/task1/raw/{{name}}'
# Every file a download may bring, with its SHA-256: a file not listed here is never downloaded.
SHA256 = {
    'train.en.gz': 'd79cfa999dd4c51d2cb42499b6796d5a882c3a8a961923c25a898c90f8bbd56f',
    'train.de.gz': '726e39b2fa9eb9ffb6dc763fb35a179f80fae06ffc5d28b6ace5faa883de28a6',
    'val.en.gz': '14f7d25ddd868909a9213e361768460edcacdd6ab9d1e77b92560dc10c10dc28',
    'val.de.gz': 'f0cba2f995189cf5770f29a8a9a537a3ad3f51657ad873405082ff6863a5e75a',
    'test_2016_flickr.en.gz': '611d361c6334bc7246101d48097c13cf5c4413c5befc793cc629934359d532d9',
    'test_2016_flickr.de.gz': '9204244e408ccb38d2a55cfcd344df15005fc42a07a6e55ca6c52b6ababb8cc8',
}
FETCH_COMMAND = 'python tools/get_multi30k.py --dir=DIR'
TIMEOUT_SECONDS = 30  # to connect, and for each read
FILE_SECONDS = 600  # for a whole file: a server that trickles a byte at a time does not hold a run forever


class DownloadError(UserError):
  """A corpus file that could not be fetched or does not match its checksum."""


def cache_dir(name: str) -> str:
  """The user's cache folder for corpus `name`: $XDG_CACHE_HOME/flax_transformer/NAME (~/.cache by default)."""
  root = os.environ.get('XDG_CACHE_HOME') or os.path.join(os.path.expanduser('~'), '.cache')
  return os.path.join(root, 'flax_transformer', name)


def sha256(path: str) -> str:
  with open(path, 'rb') as f:
    return hashlib.sha256(f.read()).hexdigest()


def fetch(paths: list[str], url: str) -> list[str]:
  """Downloads each of `paths` (local files named in SHA256) that is missing or does not match its checksum
  from `url` (with `{name}` for the file's name); returns the paths downloaded. One line per file on stdout."""
  fetched = []
  for path in paths:
    name = os.path.basename(path)
    if name not in SHA256:
      raise DownloadError(f'{path} does not exist, and {name} is not a file config.download_url can bring (no '
                          f'checksum is recorded for it); give the path of an existing file')
    if os.path.exists(path) and sha256(path) == SHA256[name]:
      continue
    if '://' in path:
      raise DownloadError(f'{path} does not exist; config.download_url fetches into a local folder only')
    source, partial = url.format(name=name), f'{path}.part.{os.getpid()}'
    os.makedirs(os.path.dirname(path) or '.', exist_ok=True)
    remove_abandoned(path)
    print(f'downloading {source} to {path}', flush=True)
    try:
      with _terminated_as_error(), open(partial, 'wb') as f:
        _download(source, f)
      if sha256(partial) != SHA256[name]:
        raise DownloadError(f'{name} from {source} does not match its SHA-256; nothing was kept (a changed or '
                            f'truncated file); rerun, or fetch it with {FETCH_COMMAND}')
      os.replace(partial, path)
    except (OSError, urllib.error.URLError) as error:
      reason = getattr(error, 'reason', None) or error
      raise DownloadError(f'{path} does not exist and downloading it from {source} failed ({reason}); on a machine '
                          f'with internet run {FETCH_COMMAND}, copy DIR here and pass --config=configs/multi30k.py:DIR') \
          from None
    finally:
      if os.path.exists(partial):
        os.remove(partial)
    print(f'{path}: {os.path.getsize(path) / 1e6:.2f} MB, checksum ok', flush=True)
    fetched.append(path)
  return fetched


def _download(source: str, f) -> None:
  """The body at `source` into the open file `f`, within FILE_SECONDS in all (TimeoutError past them; a read that
  waits longer than TIMEOUT_SECONDS fails on its own)."""
  deadline = time.monotonic() + FILE_SECONDS
  with urllib.request.urlopen(source, timeout=min(TIMEOUT_SECONDS, FILE_SECONDS)) as response:
    while True:
      left = deadline - time.monotonic()
      if left <= 0:
        raise TimeoutError(f'not complete after {FILE_SECONDS:g} s, {f.tell():,} bytes in')
      block = response.read1(1 << 16)  # what has arrived, not a full block: the deadline is checked between reads
      if not block:
        return
      f.write(block)


def remove_abandoned(path: str) -> None:
  """Removes the partial downloads of `path` (`path`.part.PID) whose process is gone (killed mid-download)."""
  for partial in glob.glob(glob.escape(path) + '.part.*'):
    pid = partial.rsplit('.', 1)[1]
    if pid.isdigit() and not run_lock.process_alive(int(pid)):
      with contextlib.suppress(FileNotFoundError):
        os.remove(partial)


@contextlib.contextmanager
def _terminated_as_error():
  """In the main thread, SIGTERM during the block raises OSError (so the partial file is removed and the program
  says so in one line) instead of ending the process where it stands."""
  if threading.current_thread() is not threading.main_thread():
    yield
    return

  def terminated(signum, frame):
    raise OSError('interrupted by SIGTERM; nothing was kept')

  previous = signal.signal(signal.SIGTERM, terminated)
  try:
    yield
  finally:
    signal.signal(signal.SIGTERM, previous)
