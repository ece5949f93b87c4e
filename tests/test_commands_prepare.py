"""The prepare program: the vocabulary and the token cache ahead of a run, which then tokenises nothing."""

import json

import jax
import pytest

from flax_transformer import token_cache, train_loop
from flax_transformer.commands import prepare
from tests.helpers import programs
from tests.test_train_loop import small_run


@pytest.mark.slow  # 8 s or more of compilation and steps on 2 cores (the marker)
def test_prepare_then_train_reads_the_cache(tiny_config, tmp_path, monkeypatch):
  config = small_run(tiny_config, tmp_path)
  config.num_train_steps, config.checkpoint_every_steps, config.eval_every_steps = 2, 2, 2
  workdir = tmp_path / 'work'
  flags = [f'--config.{name}={getattr(config, name)}' for name in ('dataset', 'train_source', 'train_target',
                                                                   'eval_source', 'eval_target', 'max_train_length')]
  result = programs.run(prepare.main, ['prepare', '--config=configs/tiny.py', f'--workdir={workdir}', *flags],
                        text=True)
  assert result.returncode == 0, result.stderr[-2000:]
  summary = json.loads(result.stdout.strip().splitlines()[-1])
  assert summary['pairs'] + summary['dropped_too_long'] == 200 and summary['pairs'] > 0
  assert summary['token_cache'] == str(workdir / 'token_cache')
  assert sorted(p.name for p in workdir.iterdir()) == ['sentencepiece.model', 'token_cache']  # no run yet

  def no_tokenising(*args, **kwargs):
    raise AssertionError('the run tokenised the training split again')
  monkeypatch.setattr(token_cache, 'token_table', no_tokenising)
  train_loop.train_and_evaluate(config, str(workdir), jax.local_devices()[:1])
  assert (workdir / 'checkpoints' / '2').is_dir()


def test_prepare_refuses_a_cache_inside_the_data(tiny_config, tmp_path):
  config = small_run(tiny_config, tmp_path)
  flags = [f'--config.{name}={getattr(config, name)}' for name in ('dataset', 'train_source', 'train_target',
                                                                   'eval_source', 'eval_target')]
  result = programs.run(prepare.main, ['prepare', '--config=configs/tiny.py', f'--workdir={tmp_path / "work"}',
                                       f'--config.token_cache={config.train_source}', *flags], text=True)
  errors = [line for line in result.stderr.splitlines() if line.startswith('error: ')]
  assert result.returncode == 1 and len(errors) == 1, result.stderr
  assert f'config.token_cache={config.train_source}' in errors[0] and 'a folder of its own' in errors[0]
  assert not (tmp_path / 'work').exists()

