"""`train_and_evaluate(config, workdir)`: set-up (startup.py: the config read once, the cluster, the checks,
the mesh, the vocabulary, the state resumed from the newest good checkpoint, the data, the jitted steps), then
`_train`: a loop that only orchestrates batches, the pure train step and the hooks (hooks.py), called in the
order of their list, which is their contract.

The hooks: a failed save stops the run; SIGTERM/SIGINT stop it after a checkpoint; the progress line and
TensorBoard every `log_every_steps`; an Orbax checkpoint (with each process's data-iterator state) every
`checkpoint_every_steps`, on the last step and on a signal, never of a lost run (a NaN/Inf loss stops it
before the next checkpoint is written, so the last good one stays untouched); validation loss, perplexity,
accuracy and BLEU on a validation sample every `eval_every_steps`.
"""

import sys

import jax

from flax_transformer import checkpointing, hooks, startup, storage, validation_hooks
from flax_transformer.metrics_log import MetricsLog, read_evaluations
from flax_transformer.saver import CheckpointSaveFailed, Saver


ORDER = (hooks.SaveCheck, hooks.StopSignal, hooks.LossGuard, hooks.Progress, validation_hooks.Evaluation,
         validation_hooks.EarlyStopping, hooks.Checkpoint, hooks.LateStop)  # the loop's hooks in their order: hooks.py
# and validation_hooks.py say what each does and why it comes there


def build_hooks(run: startup.Run, log: MetricsLog, saver: Saver) -> list[hooks.Hook]:
  """The hooks of ORDER for `run`."""
  loop = run.settings.training
  signals = hooks.StopSignal(multi_process=jax.process_count() > 1)
  guard = hooks.LossGuard(loop.max_skipped_steps, loop.loss_spike_factor, loop.loss_spike_steps, verbose=run.is_chief,
                    checkpoints=checkpointing.available_steps(run.workdir))
  checkpoint = hooks.Checkpoint(run, saver, guard)
  evaluation = validation_hooks.Evaluation(run, log, signals)
  progress = hooks.Progress(run, log, evaluation.seconds)
  history = (read_evaluations(run.workdir, validation_hooks.judged_split(run), until=run.start_step)
             if run.start_step else {})
  early_stopping = validation_hooks.EarlyStopping(loop.best_metric, loop.early_stopping_evaluations,
                                            {step: m[loop.best_metric] for step, m in history.items()
                                             if loop.best_metric in m}, verbose=run.is_chief)
  built = [hooks.SaveCheck(saver), signals, guard, progress, evaluation, early_stopping, checkpoint,
           hooks.LateStop(signals, checkpoint)]
  assert tuple(type(hook) for hook in built) == ORDER
  return built


def train_and_evaluate(config, workdir: str, devices=None) -> dict:
  """Trains (or resumes) the run in `workdir` on `devices` (default: all); returns the last metrics."""
  with storage.one_shutdown():
    run, state = startup.set_up(config, workdir, devices)
    timeout = run.settings.training.storage_timeout_seconds
    log = MetricsLog(run.workdir, run.is_chief, timeout)
    saver = Saver(run.manager, run.workdir, timeout, run.start_step or None)
    ordered = build_hooks(run, log, saver)
    hooks.check_order(ordered)
    failure = None
    try:
      step = _train(run, state, ordered)
    except storage.StorageError as error:  # a write that failed or overran: what is safe, from what is known
      failure = storage.StorageError(f'{error}; the run stopped and {saver.intact()}')
      raise failure from None
    except BaseException as error:
      failure = error
      raise
    finally:
      _close(run, log, ordered, failure)
  named = {hook.name: hook for hook in ordered}
  evaluated = named['evaluation'].last
  return {'step': step, 'train': named['progress'].last, 'eval': evaluated.get('eval', {}),
          **({'eval_ema': evaluated['eval_ema']} if 'eval_ema' in evaluated else {})}


def _train(run: startup.Run, state, ordered: list[hooks.Hook]) -> int:
  """The loop: a step, then every hook due after it, in the list's order; returns the last step."""
  loop, step, pending, end, compiled = run.settings.training, run.start_step, [], None, set()
  ended = finished(run, next((h for h in ordered if isinstance(h, validation_hooks.EarlyStopping)), None))
  if ended and run.is_chief:
    print(f'warning: {ended}', file=sys.stderr, flush=True)
  while step < loop.num_train_steps and not ended:
    batch = run.to_global(next(run.train_iter))
    shape = (batch['inputs'].shape, batch['targets'].shape)
    if shape not in compiled:  # a new batch shape: compiled (or read from the cache) now
      compiled.add(shape)
      if run.is_chief:
        print(f'compiling the train step for batch shape {len(compiled)} of {len(run.train_iter.batching.used_shapes)}: '
              f'{shape[0][0]} x ({shape[0][1]} + {shape[1][1]}) tokens', flush=True)
    state, metrics = run.train_step(state, batch, run.dropout_rng)
    pending.append(metrics)
    step += 1
    end = hooks.StepEnd(step, state, pending, loop)
    for hook in ordered:
      if hook.due(end):
        hook.after_step(end)
    if end.stop:
      break
  for hook in ordered:
    hook.at_end(end)
  return step


def finished(run: startup.Run, early_stopping: validation_hooks.EarlyStopping | None) -> str:
  """Why the run resumed at `run.start_step` has ended already (its steps are reached, or it stopped early), with
  what to change to train on; '' if it has not."""
  loop, step = run.settings.training, run.start_step
  if step and step >= loop.num_train_steps:
    return (f'the run in {run.workdir} ended at step {step} (config.num_train_steps={loop.num_train_steps}); nothing '
            f'was trained: to train on, raise --config.num_train_steps above {step}')
  if step and early_stopping and early_stopping.patience and early_stopping.since >= early_stopping.patience:
    return (f'the run in {run.workdir} stopped early at step {step}: validation {early_stopping.metric} has not '
            f'improved for {early_stopping.since} evaluations (best at step {early_stopping.best_step}); nothing was '
            f'trained: to train on, raise --config.early_stopping_evaluations above {early_stopping.since} (0: never '
            f'stop early)')
  return ''


def _close(run: startup.Run, log: MetricsLog, ordered: list[hooks.Hook], failure: BaseException | None):
  """Each closing write within the storage timeout (after the storage itself failed, only the lock is tried);
  the signal handlers last, so a signal while the run winds down cannot interrupt its closing writes."""
  gone_quiet = isinstance(failure, (storage.StorageError, CheckpointSaveFailed))
  signals = [hook for hook in ordered if isinstance(hook, hooks.StopSignal)]
  closing = [] if gone_quiet else [(hook.name, hook.close) for hook in ordered if hook not in signals]
  closing += [] if gone_quiet else [('the metrics', log.close)]
  closing += [('the workdir lock', run.lock.release)] if run.lock else []
  for what, close in closing:
    try:
      storage.within(run.settings.training.storage_timeout_seconds, f'closing {what} in {run.workdir}', close)
    except Exception:
      if failure is None:
        raise
  for hook in signals:
    hook.close()
