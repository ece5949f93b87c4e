"""§5.3 learning-rate schedule and Adam settings."""

import numpy as np
import pytest
import optax
from flax_transformer import optim, settings


def test_schedule_equals_the_formula():
  schedule = optim.warmup_schedule(512, 4000)
  for step in (1, 4000, 100_000):
    expected = 512**-0.5 * min(step**-0.5, step * 4000**-1.5)
    np.testing.assert_allclose(float(schedule(step)), expected, rtol=1e-6)
  assert float(schedule(4000)) > float(schedule(3999)) and float(schedule(4000)) > float(schedule(4001))


def test_optimizer_starts_at_paper_step_one(tiny_config):
  tx, schedule = optim.create_optimizer(settings.resolve(tiny_config).optimizer, 16), optim.learning_rate(settings.resolve(tiny_config).optimizer, 16)
  np.testing.assert_allclose(float(schedule(0)), 16**-0.5 * 1 * 10**-1.5, rtol=1e-6)
  # Two Adam updates by hand with §5.3's beta1 = 0.9, beta2 = 0.98, epsilon = 1e-9 and the schedule's first
  # two rates; epsilon matters because the first gradient's last entry is 1e-9.
  gradients = [np.array([0.5, -2.0, 1e-9], np.float64), np.array([0.1, 3.0, -1e-9], np.float64)]
  m, v, params = np.zeros(3), np.zeros(3), np.ones(3)
  expected = []
  for t, g in enumerate(gradients, 1):
    m, v = 0.9 * m + 0.1 * g, 0.98 * v + 0.02 * g ** 2
    rate = 16 ** -0.5 * min(t ** -0.5, t * 10 ** -1.5)
    params = params - rate * (m / (1 - 0.9 ** t)) / (np.sqrt(v / (1 - 0.98 ** t)) + 1e-9)
    expected.append(params.copy())
  state = tx.init({'w': np.ones(3, np.float32)})
  current = {'w': np.ones(3, np.float32)}
  for g, want in zip(gradients, expected):
    updates, state = tx.update({'w': g.astype(np.float32)}, state, current)
    current = optax.apply_updates(current, updates)
    np.testing.assert_allclose(np.asarray(current['w']), want, rtol=1e-6)


def test_gradient_clipping_is_a_switch(tiny_config):
  plain = optim.create_optimizer(settings.resolve(tiny_config).optimizer, 16)
  tiny_config.grad_clip_norm = 1.0
  clipped = optim.create_optimizer(settings.resolve(tiny_config).optimizer, 16)
  params = {'w': np.ones(3, np.float32)}
  gradients = [{'w': np.array([1e3, 0.0, 0.0], np.float32)}, {'w': np.array([1.0, 0.5, 0.0], np.float32)}]

  def run(tx, clip_by_hand):
    state, out = tx.init(params), []
    for g in gradients:
      if clip_by_hand:
        g = {'w': g['w'] / max(1.0, np.linalg.norm(g['w']))}
      updates, state = tx.update(g, state, params)
      out.append(np.asarray(updates['w']))
    return np.stack(out)

  np.testing.assert_allclose(run(clipped, False), run(plain, True), rtol=1e-5)
  assert not np.allclose(run(plain, False), run(plain, True), rtol=1e-3)


def test_cooldown_ramps_the_paper_rate_linearly_to_zero(tiny_config):
  tiny_config.num_train_steps, tiny_config.warmup_steps, tiny_config.cooldown_steps = 100, 10, 40
  schedule = optim.learning_rate(settings.resolve(tiny_config).optimizer, 16)
  paper = optim.warmup_schedule(16, 10)
  for count in (0, 9, 30, 60, 61, 80, 99):  # optax update count; the paper's step is count + 1
    by_hand = float(paper(count + 1)) * min(1.0, (100 - count) / 40)
    np.testing.assert_allclose(float(schedule(count)), by_hand, rtol=1e-6)
  assert float(schedule(100)) == 0.0 and float(schedule(99)) > 0.0


def test_constant_decay_holds_the_warmup_peak_then_cools_down(tiny_config):
  tiny_config.num_train_steps, tiny_config.warmup_steps, tiny_config.cooldown_steps = 100, 10, 40
  tiny_config.lr_decay = 'constant'
  schedule = optim.learning_rate(settings.resolve(tiny_config).optimizer, 16)
  peak = 16**-0.5 * 10**-0.5
  for count in (0, 4, 9, 30, 59, 60, 80, 99):  # the paper's linear warmup, the peak held, then the ramp
    by_hand = min(peak, 16**-0.5 * (count + 1) * 10**-1.5) * min(1.0, (100 - count) / 40)
    np.testing.assert_allclose(float(schedule(count)), by_hand, rtol=1e-6)
  paper = optim.warmup_schedule(16, 10)
  assert float(schedule(9)) == pytest.approx(float(paper(10))) and float(schedule(30)) > float(paper(31)) * 1.5


def test_unknown_lr_decay_is_a_config_error(tiny_config):
  from flax_transformer.errors import ConfigError
  tiny_config.lr_decay = 'cosine'
  with pytest.raises(ConfigError, match=r"config.lr_decay='cosine': must be one of inverse_sqrt, constant"):
    settings.check(tiny_config)


def test_cooldown_longer_than_the_run_is_a_config_error(tiny_config):
  from flax_transformer.errors import ConfigError
  tiny_config.cooldown_steps = tiny_config.num_train_steps + 1
  with pytest.raises(ConfigError, match=r'config.cooldown_steps=\d+: must be an integer from 0'):
    settings.check(tiny_config)
