"""configs/base.py and configs/big.py carry the paper's values (Table 3, §5.1–5.4, §6.1)."""

import os

import numpy as np
import optax
import pytest

from configs import base, big
from flax_transformer import settings
from flax_transformer import optim


@pytest.mark.parametrize('name,module,sizes,dropout,steps,average', [
    ('base', base, (512, 8, 2048, 6), 0.1, 100_000, 5),
    ('big', big, (1024, 16, 4096, 6), 0.3, 300_000, 20),
])
def test_paper_values(name, module, sizes, dropout, steps, average):
  config = module.get_config()
  m = config.model
  assert (m.d_model, m.num_heads, m.d_ff, m.num_encoder_layers) == sizes and m.num_decoder_layers == sizes[3]
  assert m.dropout_rate == dropout and m.attention_dropout_rate == 0.0  # §5.4: residual dropout only
  assert not m.pre_norm and m.share_embeddings and not m.learned_positions  # §3.1, §3.4, §3.5
  assert (config.adam_b1, config.adam_b2, config.adam_eps) == (0.9, 0.98, 1e-9)  # §5.3
  assert config.warmup_steps == 4000 and config.learning_rate_factor == 1.0 and config.lr_decay == 'inverse_sqrt'
  assert config.label_smoothing == 0.1 and config.tokens_per_batch == 25_000  # §5.4, §5.1
  assert config.num_train_steps == steps and config.average_last == average  # §5.2, §6.1
  assert (config.beam_size, config.length_penalty_alpha, config.max_extra_length) == (4, 0.6, 50)  # §6.1
  assert config.grad_clip_norm == 0.0 and config.cooldown_steps == 0
  settings.model_settings(config)  # and the architecture builds from it


def test_base_optimizer_applies_the_papers_first_update():
  config = base.get_config()
  tx, schedule = optim.create_optimizer(settings.resolve(config).optimizer, config.model.d_model), optim.learning_rate(settings.resolve(config).optimizer, config.model.d_model)
  g = np.array([0.5, -2.0, 1e-9], np.float32)
  updates, _ = tx.update({'w': g}, tx.init({'w': np.zeros(3, np.float32)}), {'w': np.zeros(3, np.float32)})
  # Step 1 of Adam(0.9, 0.98, 1e-9): m̂ = g, v̂ = g², update = -lr · g / (|g| + 1e-9), lr = 512^-0.5 · 4000^-1.5.
  rate = 512 ** -0.5 * 4000 ** -1.5
  np.testing.assert_allclose(np.asarray(updates['w']), -rate * g / (np.abs(g.astype(np.float64)) + 1e-9), rtol=1e-5)
  assert isinstance(tx, optax.GradientTransformation) and float(schedule(0)) == pytest.approx(rate, rel=1e-6)


def test_package_pins_equal_the_requirements_files():
  """pyproject.toml (pip install -e .[cuda12|tpu|test]) and requirements*.txt (CI) pin the same versions."""
  import os
  import tomllib
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

  def pins(name):
    with open(os.path.join(root, name)) as f:
      lines = [line.split('#')[0].strip() for line in f]
    return sorted(line for line in lines if line and not line.startswith('-r'))

  with open(os.path.join(root, 'pyproject.toml'), 'rb') as f:
    project = tomllib.load(f)['project']
  assert sorted(project['dependencies']) == pins('requirements.txt')
  assert sorted(project['optional-dependencies']['test']) == pins('requirements-test.txt')
  jax_version = next(p for p in project['dependencies'] if p.startswith('jax=='))[len('jax=='):]
  assert project['optional-dependencies']['cuda12'] == [f'jax[cuda12]=={jax_version}']
  assert project['optional-dependencies']['tpu'] == [f'jax[tpu]=={jax_version}']


@pytest.mark.slow
def test_a_missing_config_file_is_a_one_line_error(tmp_path):
  import subprocess
  import sys
  from tests.conftest import ROOT, subprocess_env
  result = subprocess.run([sys.executable, os.path.join(ROOT, 'train.py'), '--config=configs/no_such.py',
                           f'--workdir={tmp_path}'], env=subprocess_env(), capture_output=True, text=True, timeout=120,
                          cwd=ROOT)
  assert result.returncode == 1
  assert result.stderr.strip().splitlines()[-1] == (
      "error: --config=configs/no_such.py cannot be loaded ([Errno 2] No such file or directory: "
      "'configs/no_such.py'); give a config file such as configs/base.py, with :ARGUMENT after it if the file takes one")
  assert os.listdir(tmp_path) == []
