"""saver.py: asynchronous saves whose failure or overrun stops the run in one line naming the step and the
newest intact checkpoint; checked with a stand-in manager (the real Orbax path: tests/test_train_loop.py)."""

import threading
import time

import pytest

from flax_transformer import saver, storage


class Manager:
  """A CheckpointManager's save surface: each save runs on a thread for `seconds`, then fails with `error`."""

  def __init__(self, seconds=0.0, error=None):
    self.seconds, self.error, self.thread, self.saved, self.closed = seconds, error, None, [], False

  def save(self, step, args=None, metrics=None):
    def write():
      time.sleep(self.seconds)
      if not self.error:
        self.saved.append(step)
    self.thread = threading.Thread(target=write)
    self.thread.start()

  def is_saving_in_progress(self):
    return self.thread is not None and self.thread.is_alive()

  def check_for_errors(self):
    if self.error and self.thread is not None and not self.is_saving_in_progress():
      raise self.error

  def wait_until_finished(self):
    if self.thread:
      self.thread.join()
    self.check_for_errors()

  def close(self):
    self.closed = True


@pytest.fixture
def saves(monkeypatch):
  """checkpointing.save_state as the manager's save; the look at the workdir after a failure finds nothing. Each
  test is one program's storage calls (storage.one_shutdown): a failure's shutdown deadline ends with it."""
  monkeypatch.setattr(saver.checkpointing, 'save_state', lambda manager, state, data, metrics: manager.save(0))
  monkeypatch.setattr(saver.checkpointing, 'remove_partial', lambda workdir, step: False)
  monkeypatch.setattr(saver.checkpointing, 'available_steps', lambda workdir: [4])
  with storage.one_shutdown():
    yield


def test_a_save_that_ends_makes_its_step_the_newest_intact_one(saves):
  manager = Manager(seconds=0.05)
  writer = saver.Saver(manager, '/run', timeout=10, intact_step=4)
  writer.save(8, None, {})
  assert writer.intact() == 'checkpoint 4 is the newest intact one (the save of step 8 did not finish)'
  writer.finish()
  assert writer.intact_step == 8 and writer.intact() == 'checkpoint 8 is the newest intact one'
  writer.close()
  assert manager.closed


def test_a_failed_save_is_reported_at_the_next_check_naming_its_step_and_the_checkpoint_before(saves):
  writer = saver.Saver(Manager(error=OSError(28, 'No space left on device')), '/run', timeout=10, intact_step=4)
  writer.save(8, None, {})
  writer.manager.thread.join()
  with pytest.raises(saver.CheckpointSaveFailed) as error:
    writer.check()
  assert str(error.value) == ('saving the checkpoint at step 8 in /run failed (OSError: [Errno 28] No space left on '
                              'device); the run stopped and checkpoint 4 is the newest intact one')
  writer.close()
  assert not writer.manager.closed  # Orbax's threads may wait forever after a failure: not joined


def test_a_save_still_running_past_its_timeout_is_a_failure(saves):
  writer = saver.Saver(Manager(seconds=3.0), '/run', timeout=1, intact_step=None)
  writer.save(6, None, {})
  started = time.monotonic()
  with pytest.raises(saver.CheckpointSaveFailed, match=r'saving the checkpoint at step 6 in /run failed \(.*1 s.*\); '
                                                        r'the run stopped and checkpoint 4 is the newest intact one'):
    writer.finish()
  assert time.monotonic() - started < 2.5  # stopped at the deadline, not when the save would have ended
