"""The loop's validation hooks: the weights (and, with config.ema_decay > 0, their moving average) evaluated
every `eval_every_steps`, and the run's best so far by `config.best_metric`, which ranks the checkpoints kept
(config.keep_best) and ends a run that stopped improving (config.early_stopping_evaluations).

  Evaluation      validation loss, perplexity, accuracy and BLEU on a sample: `eval/...` for the weights,
                  `eval_ema/...` for their moving average; the judged weights' metrics go on the StepEnd
  EarlyStopping   the best value so far (kept across a resume: read back from train_metrics.jsonl); after
                  `early_stopping_evaluations` evaluations without improvement, the run ends with a checkpoint
"""

import time

import jax

from flax_transformer import (cluster, parallel_text, partitioning, scoring, sentence_batches, storage, token_table,
                              translator)
from flax_transformer.checkpointing import HIGHER_IS_BETTER
from flax_transformer.hooks import Hook, StepEnd, StopSignal
from flax_transformer.metrics_log import MetricsLog

TRANSLATIONS_DIR = 'translations'  # translations/eval_<step>.txt: the BLEU sample's translations


def judged_split(run) -> str:
  """The metrics split the best checkpoint and early stopping judge: the moving average's when there is one."""
  return 'eval_ema' if run.settings.optimizer.ema_decay > 0 else 'eval'


class Evaluation(Hook):
  """Validation loss, perplexity and accuracy, and BLEU on a sample, every process on the same batches, of the
  weights and of their moving average; a signal meanwhile abandons it (the loop then saves and exits)."""
  name = 'evaluation'
  after = ('guard',)  # a run whose loss is lost stops before an evaluation spends its time

  def __init__(self, run, log: MetricsLog, signals: StopSignal):
    self.run, self.log, self.signals = run, log, signals
    self.batches, self.sources, self.encoded, self.references = None, None, None, None  # built at the first one
    self.seconds = []  # (duration, end time) of each evaluation
    self.last = {}  # split ('eval', 'eval_ema') -> the latest metrics

  def due(self, end: StepEnd) -> bool:
    return end.step % end.training.eval_every_steps == 0 or end.last

  def _translate(self, params, should_stop):
    s, run = self.run.settings, self.run
    if self.sources is None:
      pairs = storage.within(s.training.storage_timeout_seconds, 'reading the validation sentences', lambda: list(
          parallel_text.python_pairs(s.data, 'eval'))[:s.training.num_eval_bleu_sentences])
      self.sources, self.references = [p[0] for p in pairs], [p[1] for p in pairs]
      self.encoded = sentence_batches.encode_sentences(run.processor, self.sources)
    model_params, processes = params, jax.process_count()
    if processes > 1:  # each process decodes its share (every processes-th sentence) with the whole model
      from jax.experimental import multihost_utils
      model_params = multihost_utils.process_allgather(params, tiled=True)
    mine = range(jax.process_index(), len(self.sources), processes)
    model = translator.Translator(model_params, s.model, run.processor, decoding=s.decode)
    translated = model.translate([self.sources[i] for i in mine], encoded=[self.encoded[i] for i in mine],
                                 should_stop=should_stop)  # the same on every process: signals act between steps
    if translated is None or processes == 1:
      return translated
    return cluster.gathered_texts(translated, len(self.sources), 'validation translations')

  def evaluate(self, step: int, params, split: str = 'eval') -> dict:
    """The metrics of `params` at `step`, logged under `split`; {} if SIGTERM/SIGINT arrives meanwhile."""
    s, run, should_stop = self.run.settings, self.run, lambda: self.signals.received is not None
    if self.batches is None:
      dp_size = partitioning.data_parallel_size(run.mesh)
      self.batches = storage.within(s.training.storage_timeout_seconds, 'reading the validation data and vocabulary',
                                    lambda: token_table.eval_batches(s.data, run.vocab_path, 'eval', dp_size))
    results = scoring.evaluate_loss(run.eval_step, params, self.batches, run.eval_to_global, should_stop)
    if results is not None and s.training.num_eval_bleu_sentences > 0:
      hypotheses = self._translate(params, should_stop)
      if hypotheses is None:
        results = None
      else:
        results['bleu'], _ = scoring.bleu(hypotheses, self.references, s.decode.bleu_tokenize)
        if run.is_chief:  # the sample's translations, to read beside the score
          folder = run.workdir / TRANSLATIONS_DIR
          name = f'eval_{step}.txt' if split == 'eval' else f'{split}_{step}.txt'
          storage.within(s.training.storage_timeout_seconds, f'writing the translations of step {step} to {folder}',
                         lambda: folder.mkdir(parents=True, exist_ok=True) or (folder / name).write_text(
                             ''.join(h + '\n' for h in hypotheses)))
    if results is None:
      print(f'evaluation at step {step} abandoned: {self.signals.received} received', flush=True)
      return {}
    self.log.scalars(step, results, split)
    bleu = f' bleu {results["bleu"]:.2f}' if 'bleu' in results else ''
    weights = '' if split == 'eval' else ' (moving average)'
    self.log.say(f'eval step {step}{weights}: loss {results["loss"]:.4f} perplexity {results["perplexity"]:.2f} '
                 f'accuracy {results["accuracy"]:.4f}{bleu}')
    return results

  def after_step(self, end: StepEnd) -> None:
    start = time.perf_counter()
    self.last = {'eval': self.evaluate(end.step, end.state.params)}
    if end.state.ema_params is not None and self.last['eval']:
      self.last['eval_ema'] = self.evaluate(end.step, end.state.ema_params, 'eval_ema')
    self.seconds.append((time.perf_counter() - start, time.perf_counter()))
    end.evaluated = self.last.get(judged_split(self.run)) or None


class EarlyStopping(Hook):
  """The best value of `config.best_metric` so far, and the run's end after `early_stopping_evaluations` (> 0)
  evaluations without an improvement (strictly better), with a checkpoint and a line saying why. `history`:
  {step: value} of the evaluations before this start (a resumed run carries its count on)."""
  name = 'early stopping'
  after = ('evaluation',)

  def __init__(self, metric: str, patience: int, history: dict[int, float] | None = None, verbose: bool = True):
    self.metric, self.patience, self.verbose = metric, patience, verbose
    self.best, self.best_step, self.since = None, None, 0
    for step, value in sorted((history or {}).items()):
      self.judge(step, value)

  def better(self, value: float) -> bool:
    if self.best is None:
      return True
    return value > self.best if self.metric in HIGHER_IS_BETTER else value < self.best

  def judge(self, step: int, value: float) -> None:
    if self.better(value):
      self.best, self.best_step, self.since = value, step, 0
    else:
      self.since += 1

  def due(self, end: StepEnd) -> bool:
    return end.evaluated is not None and self.metric in end.evaluated  # no BLEU without a BLEU sample

  def after_step(self, end: StepEnd) -> None:
    self.judge(end.step, end.evaluated[self.metric])
    if self.patience and self.since >= self.patience:
      end.stop = 'early stopping'
      if self.verbose:
        print(f'early stopping at step {end.step}: validation {self.metric} has not improved for {self.since} '
              f'evaluations (best {self.best:.4f} at step {self.best_step}); the run ends here with a checkpoint',
              flush=True)
