"""config.init_from: a new run starts from another run's parameters and vocabulary, with a fresh optimizer."""

import json
import os
import subprocess

import numpy as np
import pytest

from tests.conftest import subprocess_env, train_command
from tests.helpers.corpus import write_corpus


@pytest.mark.slow
def test_fine_tuning_starts_from_the_source_models_loss(trained_run, tmp_path):
  from flax_transformer import settings, workdirs
  from flax_transformer import checkpointing, input_pipeline, partitioning, steps, tokenizer, weights
  from flax_transformer.startup import data_seed
  source, _ = trained_run
  corpus, workdir = tmp_path / 'corpus', tmp_path / 'tuned'
  corpus.mkdir()
  write_corpus(str(corpus), 200, 5, 'train')  # another corpus than the source's
  write_corpus(str(corpus), 10, 6, 'eval')
  result = subprocess.run(train_command(workdir, corpus, 2, f'--config.init_from={source}:9',
                                        '--config.model.dropout_rate=0'),
                          env=subprocess_env(), capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-2000:]
  assert f'parameters from {source} step 9; optimizer and schedule start at step 0' in result.stdout
  assert (workdir / tokenizer.VOCAB_FILENAME).read_bytes() == (
      checkpointing.storage.path(source) / tokenizer.VOCAB_FILENAME).read_bytes()
  records = [json.loads(line) for line in open(workdir / 'train_metrics.jsonl')]
  first_loss = next(r['losses'][0] for r in records if r['split'] == 'train_steps')
  # The source model's loss on the fine-tuning run's first batch, computed here.
  config = workdirs.read_config(str(workdir))
  model_config = settings.model_settings(config)
  import flax.linen as nn
  params = weights.restore_params(source, 9, nn.meta.unbox(partitioning.abstract_params(model_config)))
  batches = input_pipeline.process_train_batches(settings.resolve(config).data, str(workdir / tokenizer.VOCAB_FILENAME), workdir, (0,), 1,
                                                 data_seed(config.seed, 0), None)
  sums = steps.eval_step(params, next(iter(batches)), model_config=model_config,
                         label_smoothing=config.label_smoothing)
  print(f'first fine-tuning loss {first_loss:.6f}; the source model on that batch {float(sums["loss"]) / float(sums["tokens"]):.6f}')
  np.testing.assert_allclose(first_loss, float(sums['loss']) / float(sums['tokens']), rtol=1e-5)
  # A source of another shape is refused before anything is written.
  other = subprocess.run(train_command(tmp_path / 'other', corpus, 1, f'--config.init_from={source}',
                                       '--config.model.d_ff=48'), env=subprocess_env(), capture_output=True,
                         text=True, timeout=300)
  errors = [l for l in other.stderr.splitlines() if l.startswith('error: ')]
  assert other.returncode == 1 and len(errors) == 1 and 'holds model.d_ff=32 but this config has 48' in errors[0]
  assert not os.path.exists(tmp_path / 'other' / 'checkpoints' / '1')
