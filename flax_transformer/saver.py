"""The loop's asynchronous checkpoint saves (Orbax): a save that fails, or is still unfinished after the storage
timeout (a storage server that stopped answering), stops the run in one line naming the step and the newest
intact checkpoint, and its partial files are removed."""

import time

import jax

from flax_transformer import checkpointing, storage
from flax_transformer.errors import UserError


class CheckpointSaveFailed(UserError):
  """A checkpoint could not be written (disk full, permissions, a storage server that stopped answering)."""


class Saver:
  """Asynchronous checkpoints whose failure is reported at once, naming the step that failed; a save still
  unfinished after `timeout` seconds (a storage server that stopped answering) is a failure too."""

  def __init__(self, manager, workdir: str, timeout: float, intact_step: int | None = None):
    self.manager, self.workdir, self.timeout = manager, workdir, timeout
    self.step, self.started, self.failed = None, None, False  # the save in flight and when it began; whether one failed
    self.intact_step = intact_step  # the newest checkpoint known to be whole (the one resumed from, or saved since)

  def intact(self) -> str:
    """The newest checkpoint known to be whole, in words, without asking the storage (which may be what failed);
    and the save still in flight, if one is."""
    said = ('no checkpoint was written' if self.intact_step is None else
            f'checkpoint {self.intact_step} is the newest intact one')
    if self.step is not None and self.step != self.intact_step and not self.failed:
      said += f' (the save of step {self.step} did not finish)'
    return said

  def _failure(self, step, error) -> CheckpointSaveFailed:
    self.failed = True  # Orbax's threads may wait forever now: the run exits without closing them
    storage.stopping()  # what follows (the look below, the closing writes) shares one deadline

    def look():  # what the failed save left, and the newest checkpoint before it
      removed = checkpointing.remove_partial(self.workdir, step) if jax.process_index() == 0 else False
      return removed, [s for s in checkpointing.available_steps(self.workdir) if s < step]

    try:
      removed, saved = storage.within(min(self.timeout, 60), 'looking at the checkpoints', look)
      intact = f'checkpoint {saved[-1]} is the newest intact one' if saved else 'no earlier checkpoint exists'
    except Exception:  # the storage itself may be what failed: what is known without it
      removed, intact = False, self.intact()
    cause = str(error) if isinstance(error, storage.StorageError) else checkpointing.reason(error)
    return CheckpointSaveFailed(f'saving the checkpoint at step {step} in {self.workdir} failed '
                                f'({cause}){"; its partial files were removed" if removed else ""}; '
                                f'the run stopped and {intact}')

  def _waited(self, what: str, call):
    """`call()` within what is left of the save's `timeout` (at least a second); its errors as themselves. An
    overrun is reported against the whole timeout, which the save has used up."""
    left = self.timeout - (time.monotonic() - self.started) if self.started else self.timeout
    try:
      return storage.within(max(left, 1.0), what, call, own_errors=True)
    except storage.Overdue:
      raise storage.overdue(what, self.timeout) from None

  def check(self) -> None:
    """Raises for a failed or overdue asynchronous save, at the first step after it failed."""
    if self.step is None:
      return
    try:  # Orbax's own look at its save can wait on the thread that writes: bounded as the save is
      in_progress = self._waited('the save', lambda: self.manager.check_for_errors() or
                                 self.manager.is_saving_in_progress())
      if time.monotonic() - self.started > self.timeout and in_progress:
        raise storage.overdue('the save', self.timeout)
      if not in_progress:
        self.intact_step = self.step
    except Exception as error:  # disk full, permission denied, storage gone quiet...
      raise self._failure(self.step, error) from None

  def finish(self) -> None:
    """Waits for the save in flight (within its timeout); raises if it failed."""
    try:  # returns at once when none is in flight, raising a failure of the last save
      self._waited('the save', self.manager.wait_until_finished)
    except Exception as error:
      raise self._failure(self.step, error) from None
    if self.step is not None:
      self.intact_step = self.step

  def save(self, step: int, state, data_state: dict, metrics: dict | None = None) -> None:
    """Starts the save of `step` (after the one in flight); `metrics` rank it among the best checkpoints."""
    self.finish()
    self.step, self.started = step, time.monotonic()
    try:
      self._waited('the save', lambda: checkpointing.save_state(self.manager, state, data_state, metrics))
    except Exception as error:
      raise self._failure(step, error) from None

  def close(self) -> None:
    if not self.failed:
      self.manager.close()
