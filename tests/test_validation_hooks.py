"""Validation in the loop: the weights' moving average evaluated beside them, the best checkpoints kept by the
validation metric, early stopping at the right evaluation, and both carried across a resume."""

import json
import os

import jax
import pytest

from flax_transformer import checkpointing, metrics_log, train_loop, validation_hooks, weights
from flax_transformer.translator import Translator
from tests.helpers.corpus import write_corpus

# The validation BLEU a scripted run reports at steps 2, 4, ...: it rises to its best at step 8, then falls.
BLEU = {2: 10.0, 4: 30.0, 6: 20.0, 8: 50.0, 10: 40.0, 12: 35.0, 14: 30.0, 16: 45.0}


@pytest.fixture
def scripted(tiny_config, tmp_path, monkeypatch):
  """A tiny run whose evaluations report BLEU[step] (and a loss that falls as BLEU rises), for each weights."""
  (train_src, train_tgt), _, _ = write_corpus(str(tmp_path), 200, 0, 'train')
  (eval_src, eval_tgt), _, _ = write_corpus(str(tmp_path), 10, 1, 'eval')
  config = tiny_config
  config.dataset, config.train_source, config.train_target = 'files', train_src, train_tgt
  config.eval_source, config.eval_target = eval_src, eval_tgt
  config.num_bucket_boundaries, config.max_train_length, config.max_eval_length = 1, 16, 16
  config.num_train_steps, config.eval_every_steps, config.checkpoint_every_steps = 20, 2, 100
  config.log_every_steps, config.keep_checkpoints, config.keep_best = 1, 1, 2
  config.early_stopping_evaluations, config.average_last, config.mesh_shape = 3, 1, (1, 1, 1)
  config.ema_decay = 0.5
  evaluated = []

  def evaluate(self, step, params, split='eval'):
    evaluated.append((step, split))
    results = {'bleu': BLEU[step] + (1.0 if split == 'eval_ema' else 0.0), 'loss': 100.0 - BLEU[step]}
    self.log.scalars(step, results, split)
    return results
  monkeypatch.setattr(validation_hooks.Evaluation, 'evaluate', evaluate)
  return config, str(tmp_path / 'work'), evaluated


@pytest.mark.slow  # 8 s or more of compilation and steps on 2 cores (the marker)
def test_the_best_checkpoints_are_kept_and_the_run_stops_after_three_evaluations_without_improvement(scripted, capsys):
  config, workdir, evaluated = scripted
  result = train_loop.train_and_evaluate(config, workdir, jax.local_devices()[:1])
  assert result['step'] == 14  # best at 8; 10, 12, 14 do not improve on it
  assert evaluated == [(s, split) for s in range(2, 15, 2) for split in ('eval', 'eval_ema')]
  assert 'early stopping at step 14: validation bleu has not improved for 3 evaluations (best 51.0000 at step 8)' \
      in capsys.readouterr().out
  assert checkpointing.available_steps(workdir) == [8, 10, 14]  # the two best (the moving average's BLEU) + newest
  assert weights.ranked_steps(workdir, 'bleu', workdir) == [8, 10, 14]  # best first
  assert json.loads(open(os.path.join(workdir, 'checkpoints', '8', 'metrics', 'metrics')).read())['bleu'] == 51.0
  assert Translator.from_workdir(workdir, checkpoint='best', weights='ema').checkpoints == (8,)


@pytest.mark.slow  # 8 s or more of compilation and steps on 2 cores (the marker)
def test_a_resumed_run_keeps_its_best_and_its_count_of_evaluations_without_improvement(scripted):
  config, workdir, evaluated = scripted
  config.num_train_steps = 10
  train_loop.train_and_evaluate(config, workdir, jax.local_devices()[:1])
  assert checkpointing.available_steps(workdir) == [8, 10]
  config.num_train_steps = 20
  result = train_loop.train_and_evaluate(config, workdir, jax.local_devices()[:1])
  assert result['step'] == 14 and checkpointing.available_steps(workdir) == [8, 10, 14]  # as uninterrupted
  logged = metrics_log.read_evaluations(workdir, 'eval_ema')
  assert sorted(logged) == list(range(2, 15, 2))


def test_judging_by_loss_keeps_the_lowest(scripted):
  config, workdir, _ = scripted
  config.best_metric, config.early_stopping_evaluations, config.ema_decay = 'loss', 0, 0.0
  config.num_train_steps = 16
  train_loop.train_and_evaluate(config, workdir, jax.local_devices()[:1])
  assert checkpointing.available_steps(workdir) == [8, 16]  # loss 50 (step 8) and 55 (16); newest is 16
  assert weights.ranked_steps(workdir, 'loss', workdir) == [8, 16]
