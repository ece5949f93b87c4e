"""One run per workdir: the lock on a local disk and on gs:// (a local GCS emulator)."""

import json
import subprocess
import sys
import time

import pytest

from flax_transformer import run_lock, storage
from flax_transformer.errors import WorkdirError


def _dead_pid() -> int:
  process = subprocess.Popen([sys.executable, '-c', 'pass'])
  process.wait()
  return process.pid


def _write_lock(workdir, **fields):
  record = {'host': 'this', 'pid': 1, 'started': '2026-12-01T00:00:00+00:00', 'refreshed': time.time(), **fields}
  (storage.path(workdir) / run_lock.LOCK_FILENAME).write_text(json.dumps(record))


def _check_lock(workdir, capsys):
  storage.path(workdir).mkdir(parents=True, exist_ok=True)
  lock = run_lock.RunLock(workdir, stale_seconds=3, refresh_seconds=0.5).acquire()
  with pytest.raises(WorkdirError, match=r'workdir .* is in use by a run started .* on this host \(pid \d+\); stop '
                                         r'that run or choose another --workdir'):
    run_lock.RunLock(workdir).acquire()  # a second run while the first lives
  time.sleep(1.2)
  assert json.loads((storage.path(workdir) / run_lock.LOCK_FILENAME).read_text())['refreshed'] > time.time() - 1
  lock.release()
  assert not (storage.path(workdir) / run_lock.LOCK_FILENAME).exists()

  host = run_lock.RunLock(workdir).record['host']
  _write_lock(workdir, host=host, pid=_dead_pid())  # left by a run killed on this host
  run_lock.RunLock(workdir).acquire().release()
  assert 'is no longer running' in capsys.readouterr().err

  _write_lock(workdir, host='gone-host', refreshed=time.time() - 3600)  # a host that died an hour ago
  run_lock.RunLock(workdir).acquire().release()
  assert 'has not refreshed it for 3600 s' in capsys.readouterr().err

  _write_lock(workdir, host='other-host', refreshed=time.time() - 1)  # silent since: taken over when stale
  run_lock.RunLock(workdir, stale_seconds=3, refresh_seconds=1).acquire().release()
  said = capsys.readouterr().err  # it waited for a refresh that never came, then took the lock over
  assert 'waiting to see whether it is alive' in said and 'has not refreshed it for' in said


def test_lock_on_a_local_disk(tmp_path, capsys):
  _check_lock(str(tmp_path / 'run'), capsys)


def test_lock_on_gcs(gcs, capsys):
  _check_lock('gs://bucket/locked_run', capsys)


def test_a_live_run_on_another_host_keeps_its_lock(tmp_path):
  workdir = str(tmp_path)
  other = run_lock.RunLock(workdir, refresh_seconds=0.5)
  other.record['host'] = 'other-host'  # as the first run's host sees it
  other.acquire()
  try:
    with pytest.raises(WorkdirError, match='is in use by a run started .* on host other-host'):
      run_lock.RunLock(workdir, stale_seconds=10, refresh_seconds=0.5).acquire()
  finally:
    other.release()
