"""One run per workdir: `run.lock`, created exclusively (on a local disk or an object store alike) by
process 0 at start-up and refreshed while the run lives.

A second run on the same workdir (a preempted job restarted while the old one still runs) is refused in one
line before it writes anything. A lock left by a run that died is taken over, with a line saying so: at
once when its process is gone from this host, else once it has not been refreshed for `stale_seconds`.
"""

import datetime
import json
import os
import socket
import sys
import threading
import time

from flax_transformer import storage
from flax_transformer.errors import WorkdirError

LOCK_FILENAME = 'run.lock'
REFRESH_SECONDS = 30  # how often a live run rewrites its lock


def process_alive(pid: int) -> bool:
  """Whether process `pid` of this host is running."""
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # someone else's process
    return True
  return True


class RunLock:
  """The workdir's lock, held by this process until `release`."""

  def __init__(self, workdir, stale_seconds: float = 4 * REFRESH_SECONDS, refresh_seconds: float = REFRESH_SECONDS):
    self.path = storage.path(workdir) / LOCK_FILENAME
    self.stale_seconds, self.refresh_seconds = stale_seconds, refresh_seconds
    self.record = {'host': socket.gethostname(), 'pid': os.getpid(),
                   'started': datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}
    self._released = threading.Event()
    self._refresher = None

  def _text(self) -> str:
    return json.dumps({**self.record, 'refreshed': time.time()})

  def _held(self) -> dict | None:
    """The lock's record, None if it is gone; one still unreadable after a few reads (a writer that does not
    write atomically) counts as refreshed when last written."""
    for attempt in range(3):
      try:
        return json.loads(self.path.read_text())
      except FileNotFoundError:
        return None
      except (ValueError, OSError):
        time.sleep(0.1 * (attempt + 1))
    return {'host': '?', 'pid': -1, 'started': '?', 'refreshed': self.path.stat().mtime}

  def _take_over(self, held: dict, why: str) -> None:
    print(f'taking over the lock of workdir {self.path.parent}: its run (host {held["host"]}, pid {held["pid"]}, '
          f'started {held["started"]}) {why}', file=sys.stderr, flush=True)
    try:
      self.path.unlink()
    except FileNotFoundError:
      pass

  def acquire(self) -> 'RunLock':
    waited_for = None
    while not storage.create_exclusive(self.path, self._text()):
      held = self._held()
      if held is None:
        continue
      age = time.time() - held['refreshed']
      if held['host'] == self.record['host'] and held['pid'] > 0 and not process_alive(held['pid']):
        self._take_over(held, 'is no longer running')
      elif age > self.stale_seconds:
        self._take_over(held, f'has not refreshed it for {age:.0f} s')
      elif waited_for is not None and held['refreshed'] != waited_for:
        raise WorkdirError(f'workdir {self.path.parent} is in use by a run started {held["started"]} on host '
                           f'{held["host"]} (pid {held["pid"]}); stop that run or choose another --workdir')
      elif held['host'] == self.record['host']:
        raise WorkdirError(f'workdir {self.path.parent} is in use by a run started {held["started"]} on this host '
                           f'(pid {held["pid"]}); stop that run or choose another --workdir')
      else:  # another host's run: alive if it refreshes the lock, dead if it stays silent
        if waited_for is None:
          print(f'workdir {self.path.parent} is locked by a run on host {held["host"]} (pid {held["pid"]}), last '
                f'refreshed {age:.0f} s ago; waiting to see whether it is alive (taken over after '
                f'{self.stale_seconds:.0f} s without a refresh)', file=sys.stderr, flush=True)
        waited_for = held['refreshed']
        time.sleep(min(self.refresh_seconds, max(self.stale_seconds - age, 0)) + 1)
    self._refresher = threading.Thread(target=self._refresh, name='run-lock', daemon=True)
    self._refresher.start()
    return self

  def _refresh(self) -> None:
    while not self._released.wait(self.refresh_seconds):
      try:
        storage.write_atomic(self.path, self._text())  # a reader sees the old record or the new, never a part
      except Exception:  # a storage hiccup: the next refresh tries again
        pass

  def release(self) -> None:
    """Removes the lock if it is still this run's."""
    self._released.set()
    if self._refresher is not None:  # a refresh in flight would write the lock back after it is removed
      self._refresher.join(timeout=self.refresh_seconds + 60)
    held = self._held()
    if held and held.get('pid') == self.record['pid'] and held.get('host') == self.record['host']:
      self.path.unlink()
