"""The training loop's periodic actions, one Hook each (flax examples/wmt's `for h in hooks: h(step)`, levanter's
`add_hook(fn, every=N)`): after every step the loop calls, in its list's order, each hook that is `due`.

  SaveCheck    every step: an asynchronous save that failed (or is overdue) stops the run at the next step
  StopSignal   every step: SIGTERM/SIGINT (agreed across processes) ends the run after this step
  LossGuard    every log step and checkpoint: fetches the steps' metrics; a lost loss stops the run
  Progress     every log step and checkpoint: the progress line, TensorBoard and the metrics file
  Evaluation   every eval_every_steps and the last step: validation loss and BLEU (validation_hooks.py)
  EarlyStopping  after each evaluation: the best so far; ends a run that stopped improving (validation_hooks.py)
  Checkpoint   every checkpoint_every_steps, the last step, a stop, and with config.keep_best every
               evaluation (ranked by its metrics): an Orbax save, never of a broken state
  LateStop     every step: a signal that came during the evaluation still stops the run with a checkpoint

The order is the contract: each hook names the hooks that must run before it (`after`), and `check_order`
refuses a list that breaks one. Adding a periodic action is one class and one list entry.
"""

import collections
import dataclasses
import os
import signal
import sys
import time
from typing import Any

import jax
import numpy as np

from flax_transformer.errors import UserError
from flax_transformer.metrics_log import MetricsLog
from flax_transformer.saver import Saver
from flax_transformer.settings import TrainingSettings

class TrainingDiverged(UserError):
  """The loss became NaN or Inf, or stayed far above its running median."""


@dataclasses.dataclass
class StepEnd:
  """What the hooks see after one step; they may set `stop` and fill `fetched`."""
  step: int
  state: Any  # the train state after the step (the loop's own)
  pending: list  # the metrics (on the devices) of the steps since the last fetch
  training: TrainingSettings
  stop: str | None = None  # why the run ends after this step (a signal's name)
  fetched: list | None = None  # `pending` on the host, once a hook fetched it at this step
  saved: bool = False  # a checkpoint was written at this step
  evaluated: dict | None = None  # the judged weights' validation metrics, at a step evaluated (validation_hooks.py)

  @property
  def last(self) -> bool:
    return self.step == self.training.num_train_steps

  @property
  def checkpoint_due(self) -> bool:
    # each evaluation ranks one
    ranked = self.training.keep_best > 0 and self.step % self.training.eval_every_steps == 0
    return self.step % self.training.checkpoint_every_steps == 0 or self.last or self.stop is not None or ranked

  @property
  def log_due(self) -> bool:
    return self.step % self.training.log_every_steps == 0 or self.checkpoint_due


class Hook:
  """One periodic action: `after_step(end)` at each step where `due(end)`; `at_end(end)` once the loop ends
  (not after an error); `close()` always."""
  name = ''
  after: tuple[str, ...] = ()  # hooks that must come before this one in the loop's list

  def due(self, end: StepEnd) -> bool:
    return True

  def after_step(self, end: StepEnd) -> None:
    pass

  def at_end(self, end: StepEnd | None) -> None:
    pass

  def close(self) -> None:
    pass


def check_order(hooks: list[Hook]) -> None:
  """Raises ValueError naming the first hook that comes before a hook it must follow."""
  seen = set()
  for hook in hooks:
    early = [name for name in hook.after if name not in seen and any(h.name == name for h in hooks)]
    if early:
      raise ValueError(f'hook {hook.name!r} must come after {early[0]!r} in the loop\'s list')
    seen.add(hook.name)


def _say(line: str) -> None:
  """A line on stdout from a signal handler: written at once, past Python's buffer (which the interrupted code
  may be in the middle of)."""
  os.write(sys.stdout.fileno(), (line + '\n').encode())


class StopSignal(Hook):
  """Turns SIGTERM/SIGINT into a stop after the step (checkpoint, then exit 0).

  A multi-process run must stop every process at the same step, or the others wait forever in the next
  collective. There SIGTERM is left to JAX's preemption service (set up by `jax.distributed.initialize`),
  SIGINT is passed on to it as a SIGTERM of this process, and the step to stop at is the one
  `multihost_utils.reached_preemption_sync_point` agrees on across processes. A second signal while the run
  stops is answered with a line. The handlers are restored by `close`, last.
  """
  name = 'signals'

  def __init__(self, multi_process: bool = False):
    self.received = None
    self.multi_process = multi_process
    self._previous = {}
    for sig in (signal.SIGINT,) if multi_process else (signal.SIGTERM, signal.SIGINT):
      self._previous[sig] = signal.signal(sig, self._handle)

  def _handle(self, signum, frame):
    name = signal.Signals(signum).name
    if self.received is not None:  # pressed again while the run stops: the stop's checkpoint is being written
      _say(f'{name} received again: the run is saving its checkpoint and exits once it is written')
    elif self.multi_process:
      os.kill(os.getpid(), signal.SIGTERM)  # to the preemption service, which tells every process
    else:
      self.received = name
      _say(f'{name} received: the run stops after this step and saves a checkpoint')

  def check(self, step: int) -> str | None:
    """The signal to stop on after `step`, or None; call after every step, on every process."""
    if self.multi_process and self.received is None:
      from jax.experimental import multihost_utils
      if multihost_utils.reached_preemption_sync_point(step):
        self.received = 'SIGTERM'
    return self.received

  def after_step(self, end: StepEnd) -> None:
    end.stop = self.check(end.step)  # every step: the processes' agreed stop step must not be skipped

  def close(self) -> None:
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)


class LossGuard(Hook):
  """Stops a run whose loss is lost: non-finite for more than `max_skipped` consecutive steps (each such
  step's update is skipped by optax.apply_if_finite), or above `factor` × its running median (of the last
  `window` finite losses) for `patience` consecutive steps. Names the last checkpoint from before the trouble.
  As a hook, it fetches the pending steps' metrics (every log step and checkpoint) before judging them."""
  name = 'guard'
  after = ('signals',)  # a stop makes a checkpoint due, and the losses are judged before every checkpoint

  def __init__(self, max_skipped: int, factor: float, patience: int, window: int = 200, verbose: bool = True,
               checkpoints: list[int] | None = None):
    self.max_skipped, self.factor, self.patience, self.verbose = max_skipped, factor, patience, verbose
    self.history = collections.deque(maxlen=window)
    self.nonfinite, self.high = [], []  # steps of the current runs of non-finite and of too-high losses
    self.checkpoints = list(checkpoints or [])  # steps saved so far, the run's earlier ones included

  def saved(self, step: int) -> None:
    self.checkpoints.append(step)

  def last_good(self, trouble_start: int) -> str:
    good = [s for s in self.checkpoints if s < trouble_start]
    return f'checkpoint {good[-1]} is from before it' if good else 'no checkpoint was written before it'

  def update(self, step: int, loss: float) -> None:
    if not np.isfinite(loss):
      self.nonfinite.append(step)
      self.first_nonfinite = loss if len(self.nonfinite) == 1 else self.first_nonfinite
      if self.verbose:
        print(f'step {step}: loss {loss}, the update was skipped', flush=True)
      if len(self.nonfinite) > self.max_skipped:
        raise TrainingDiverged(
            f'the training loss became {self.first_nonfinite} at step {self.nonfinite[0]} and stayed non-finite for '
            f'{len(self.nonfinite)} steps; the run stopped and {self.last_good(self.nonfinite[0])}; lower '
            f'config.learning_rate_factor or enable config.grad_clip_norm')
      return
    self.nonfinite = []
    median = float(np.median(self.history)) if self.history else None
    if self.factor and median is not None and loss > self.factor * median:
      self.high.append(step)
      if len(self.high) >= self.patience:
        raise TrainingDiverged(
            f'the training loss rose to {loss:.4g} at step {step}, above {self.factor:g} x its running median '
            f'{median:.4g} for {len(self.high)} steps (since step {self.high[0]}); the run stopped and '
            f'{self.last_good(self.high[0])}; lower config.learning_rate_factor or enable config.grad_clip_norm')
      return  # a spike does not move the median it is judged against
    self.high = []
    self.history.append(loss)

  def due(self, end: StepEnd) -> bool:
    return end.log_due

  def after_step(self, end: StepEnd) -> None:
    end.fetched = jax.device_get(list(end.pending))
    end.pending.clear()
    for i, metrics in enumerate(end.fetched):
      self.update(end.step - len(end.fetched) + i + 1, float(metrics['loss']))

  def at_end(self, end: StepEnd | None) -> None:
    if self.nonfinite:
      raise TrainingDiverged(f'the training loss was not finite from step {self.nonfinite[0]} to the last step; '
                             f'{self.last_good(self.nonfinite[0])}')


def _finite_mean(values) -> float:
  """Mean of the finite values (steps whose update was skipped do not count); NaN if none."""
  values = np.asarray(values, np.float64)
  finite = values[np.isfinite(values)]
  return float(finite.mean()) if finite.size else float('nan')


def _format_eta(seconds: float) -> str:
  seconds = int(max(seconds, 0))
  return f'{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}'


class Progress(Hook):
  """Per-interval training metrics, the progress line and its ETA (evaluations included)."""
  name = 'progress'
  after = ('guard',)  # reports the metrics the guard fetched

  def __init__(self, run, log: MetricsLog, evaluations: list[float]):
    self.run, self.log, self.evaluations = run, log, evaluations  # the seconds each evaluation took
    self.tick, self.tick_step, self.start = time.perf_counter(), run.start_step, time.perf_counter()
    self.last = {}

  def due(self, end: StepEnd) -> bool:
    return end.fetched is not None

  def after_step(self, end: StepEnd) -> None:
    loop, step, fetched, now = self.run.settings.training, end.step, end.fetched, time.perf_counter()
    losses = [m['loss'] for m in fetched]
    elapsed = now - max(self.tick, self.evaluations_end())
    metrics = {'loss': _finite_mean(losses), 'nll': _finite_mean([m['nll'] for m in fetched]),
               'accuracy': _finite_mean([m['accuracy'] for m in fetched]),
               'grad_norm': _finite_mean([m['grad_norm'] for m in fetched]),
               'learning_rate': float(self.run.learning_rate(step - 1)),
               'tokens_per_second': float(sum(m['tokens'] for m in fetched)) / elapsed,
               'steps_per_second': (step - self.tick_step) / elapsed,
               'dropped_too_long': self.run.train_iter.batching.dropped}
    self.log.scalars(step, metrics, 'train')
    self.log.step_losses(step, losses, self.run.train_iter.row_hashes(step - len(losses) + 1, step))
    evaluations_left = loop.num_train_steps // loop.eval_every_steps - step // loop.eval_every_steps
    eta = ((loop.num_train_steps - step) / max(metrics['steps_per_second'], 1e-9)
           + evaluations_left * (np.mean([s for s, _ in self.evaluations]) if self.evaluations else 0.0))
    self.log.say(f'step {step}/{loop.num_train_steps} loss {metrics["loss"]:.4f} lr {metrics["learning_rate"]:.2e} '
                 f'{metrics["tokens_per_second"]:,.0f} tok/s elapsed {_format_eta(now - self.start)} '
                 f'ETA {_format_eta(eta)}')
    self.tick, self.tick_step, self.last = now, step, metrics

  def evaluations_end(self) -> float:
    """When the latest evaluation ended (its time does not count as training time)."""
    return self.evaluations[-1][1] if self.evaluations else 0.0


class SaveCheck(Hook):
  """A failed or overdue asynchronous save stops the run at the first step after it failed."""
  name = 'saves'

  def __init__(self, saver: Saver):
    self.saver = saver

  def after_step(self, end: StepEnd) -> None:
    self.saver.check()


class Checkpoint(Hook):
  """An Orbax checkpoint of the state and this process's data position, where one is due; none at a step whose
  loss is not finite (its skipped update left the state as it was; a broken one stays broken). The last save
  is awaited when the loop ends."""
  name = 'checkpoint'
  # a stop makes one due; a lost run never overwrites a good checkpoint; an evaluation's metrics rank it
  after = ('signals', 'guard', 'evaluation', 'early stopping')

  def __init__(self, run, saver: Saver, guard: LossGuard):
    self.run, self.saver, self.guard = run, saver, guard

  def due(self, end: StepEnd) -> bool:
    return end.checkpoint_due

  def after_step(self, end: StepEnd) -> None:
    if self.guard.nonfinite:
      print(f'no checkpoint at step {end.step}: its loss is not finite', flush=True)
      return
    ranked = self.run.settings.training.keep_best > 0 and end.evaluated is not None
    self.saver.save(end.step, end.state, self.run.train_iter.state(), end.evaluated if ranked else None)
    self.guard.saved(end.step)
    end.saved = True

  def at_end(self, end: StepEnd | None) -> None:
    self.saver.finish()

  def close(self) -> None:
    self.saver.close()


class LateStop(Hook):
  """A signal that arrived after this step's checks (during its evaluation) still ends the run here, with a
  checkpoint at this step if none was written."""
  name = 'late stop'
  after = ('checkpoint',)  # the checkpoint hook has saved this step, or said why not, or was not due

  def __init__(self, signals: StopSignal, checkpoint: Checkpoint):
    self.signals, self.checkpoint = signals, checkpoint

  def due(self, end: StepEnd) -> bool:
    return self.signals.received is not None

  def after_step(self, end: StepEnd) -> None:
    if not end.checkpoint_due and not end.saved:  # else the Checkpoint hook has written this step's (or said why not)
      self.checkpoint.after_step(end)
    end.stop = self.signals.received
    saved = f'checkpoint saved at step {end.step}' if end.saved else f'no checkpoint at step {end.step}'
    print(f'{end.stop} received: {saved}; exiting', flush=True)
