"""Paths on a local disk and on gs:// (a local GCS emulator) behave alike where the run depends on it."""

import os

import pytest

from flax_transformer import storage


@pytest.fixture(params=['local', 'gcs'])
def root(request, tmp_path):
  if request.param == 'local':
    return str(tmp_path)
  request.getfixturevalue('gcs')
  return f'gs://bucket/storage_{os.getpid()}_{request.node.name.split("[")[0]}'


def test_files_written_whole_appended_and_mirrored(root, tmp_path):
  storage.check_writable(root, 'workdir', 'choose another --workdir')
  storage.write_atomic(f'{root}/config.json', '{"a": 1}')
  storage.write_atomic(f'{root}/config.json', '{"a": 2}')
  assert storage.path(f'{root}/config.json').read_text() == '{"a": 2}'
  assert [p.name for p in storage.path(root).iterdir()] == ['config.json']  # no probe or temporary left

  for lines in (['1\n', '2\n'], ['3\n']):  # a resumed run appends to the metrics of the run before
    appended = storage.AppendedFile(f'{root}/metrics.jsonl')
    for line in lines:
      appended.write(line)
      appended.flush()
    appended.close()
  assert storage.path(f'{root}/metrics.jsonl').read_text() == '1\n2\n3\n'

  mirror = storage.MirroredDirectory(f'{root}/tensorboard')
  os.makedirs(mirror.local, exist_ok=True)
  with open(os.path.join(mirror.local, 'events.1'), 'w') as f:
    f.write('event')
  mirror.sync()
  assert storage.path(f'{root}/tensorboard/events.1').read_text() == 'event'
  storage.move(f'{root}/tensorboard', f'{root}/tensorboard.corrupt')  # as a damaged checkpoint is set aside
  assert storage.path(f'{root}/tensorboard.corrupt/events.1').read_text() == 'event'
  assert not storage.path(f'{root}/tensorboard').exists()

  assert storage.create_exclusive(f'{root}/lock', 'first') and not storage.create_exclusive(f'{root}/lock', 'second')
  assert storage.path(f'{root}/lock').read_text() == 'first'


def test_a_location_that_cannot_be_written_is_one_line_naming_it(gcs, tmp_path):
  blocker = tmp_path / 'file'
  blocker.write_text('')
  for location in ('gs://no-such-bucket/run', str(blocker / 'run')):
    with pytest.raises(storage.StorageError) as error:
      storage.check_writable(location, 'workdir', 'choose another --workdir')
    message = str(error.value)
    assert message.startswith(f'workdir {location} cannot be written (') and '\n' not in message
    assert message.endswith('; choose another --workdir')


def test_local_paths_are_absolute_and_urls_kept():
  assert storage.path('runs/a') == storage.path(os.path.join(os.getcwd(), 'runs/a'))
  assert os.fspath(storage.path('gs://bucket/run')) == 'gs://bucket/run'
  with pytest.raises(storage.StorageError, match='an empty path'):
    storage.path('')


def test_after_one_call_overran_every_later_call_shares_the_shutdowns_one_deadline(monkeypatch):
  import threading
  import time
  monkeypatch.setattr(storage, 'SHUTDOWN_SECONDS', 0.5)
  frozen = threading.Event()  # a storage server that never answers (set at the end to let the threads go)
  with storage.one_shutdown():
    assert storage.within(5, 'a quick write', lambda: 'written') == 'written'
    with pytest.raises(storage.StorageError, match=r'^a write did not finish within 0\.2 s: the storage stopped'):
      storage.within(0.2, 'a write', frozen.wait)
    started = time.monotonic()
    for what in ('the look at the checkpoints', 'closing the metrics', 'the lock'):  # each given 100 s on its own
      with pytest.raises(storage.StorageError, match=f'^{what} did not finish'):
        storage.within(100, what, frozen.wait)
    assert time.monotonic() - started < 0.5 + 3  # the three together, not 3 x 100 s
  frozen.set()
  with storage.one_shutdown():  # a new program's calls get their own time again
    assert storage.within(5, 'a quick write', lambda: 'written') == 'written'


def test_a_call_that_fails_is_one_line_naming_it_and_its_cause():
  def full():
    raise OSError(28, 'No space left on device')
  with storage.one_shutdown():
    with pytest.raises(storage.StorageError) as error:
      storage.within(5, 'writing the metrics of step 7 to /runs/a', full)
    assert str(error.value) == ('writing the metrics of step 7 to /runs/a failed (OSError: [Errno 28] No space left '
                                'on device)')
    with pytest.raises(OSError):  # the caller that reports the error itself gets it as it is
      storage.within(5, 'the save', full, own_errors=True)
    with pytest.raises(storage.StorageError, match='^a user error$'):  # a UserError passes as itself
      storage.within(5, 'x', lambda: (_ for _ in ()).throw(storage.StorageError('a user error')))


def test_a_metrics_line_cut_short_is_dropped_not_continued(root):
  from flax_transformer import metrics_log
  storage.write_atomic(f'{root}/train_metrics.jsonl', '{"step": 3, "split": "eval", "loss": 1.5}\n{"step": 4, "spl')
  assert metrics_log.read_evaluations(root) == {3: {'loss': 1.5}}  # a resumed run reads what was whole
  appended = storage.AppendedFile(f'{root}/train_metrics.jsonl')
  appended.write('{"step": 5, "split": "eval", "loss": 1.25}\n')
  appended.close()
  assert metrics_log.read_evaluations(root) == {3: {'loss': 1.5}, 5: {'loss': 1.25}}
