"""§5.3 Optimizer: Adam(β1 0.9, β2 0.98, ε 1e-9) with the warmup + inverse-square-root schedule.

Optional, not in the paper: `lr_decay='constant'` holds the warmup's peak instead of decaying it as
step^-0.5, and `cooldown_steps` > 0 multiplies the schedule by a linear ramp from 1 to 0 over the last
`cooldown_steps` of `num_train_steps`; together, warmup-hold-cooldown, for runs whose length is fixed in advance.

Optional, not in the paper: `ema_decay` > 0 keeps an exponential moving average of the weights (Marian's
exponential smoothing, OpenNMT-py's average_decay), updated in the train step (`ema_update`).
"""

import dataclasses

import jax.numpy as jnp
import optax

from flax_transformer.settings_fields import setting

DECAYS = {}  # config.lr_decay's names -> the rate after the warmup (step_num, warmup_steps) -> a multiple of
# learning_rate_factor · d_model^-0.5; the warmup's line meets it at warmup_steps


def decay(name: str):
  """A decorator registering a learning-rate decay under `name`, which config.lr_decay then accepts."""
  def register(rate):
    DECAYS[name] = rate
    return rate
  return register


@decay('inverse_sqrt')
def _inverse_sqrt(step_num, warmup_steps):
  """§5.3: step_num^-0.5."""
  return step_num ** -0.5


@decay('constant')
def _constant(step_num, warmup_steps):
  """The warmup's peak held (not in the paper)."""
  return jnp.full_like(step_num, warmup_steps ** -0.5)


LR_DECAYS = tuple(DECAYS)


@dataclasses.dataclass(frozen=True)
class OptimizerSettings:
  """§5.3 the optimizer's settings, config fields of these names."""
  warmup_steps: int = setting('§5.3 warmup_steps: the rate rises linearly for this many steps (4,000).', minimum=0)
  learning_rate_factor: float = setting("Multiplies the paper's schedule (1.0: exactly the paper).", greater=0)
  lr_decay: str = setting("After the warmup: 'inverse_sqrt' (the paper's step^-0.5) or 'constant' (the peak held).",
                          choices=LR_DECAYS, before='inverse_sqrt')
  cooldown_steps: int = setting('> 0: the rate ramps linearly to 0 over the last this-many steps (not the paper).',
                                before=0)
  num_train_steps: int = setting('Optimizer updates of the run (§5.2: 100k for base, 300k for big).', minimum=1)
  adam_b1: float = setting('§5.3 Adam β1 (0.9).', low=0.0, high=1.0)
  adam_b2: float = setting('§5.3 Adam β2 (0.98).', low=0.0, high=1.0)
  adam_eps: float = setting('§5.3 Adam ε (1e-9).', greater=0)
  grad_clip_norm: float = setting('Clips the gradient to this global norm; 0: no clipping (the paper clips none).',
                                  minimum=0)
  max_skipped_steps: int = setting('Consecutive non-finite updates skipped (optax.apply_if_finite) before the run '
                                   'stops.', minimum=0, before=0)
  ema_decay: float = setting('Exponential moving average of the weights, updated every step: ema = d·ema + (1 - d)'
                             '·params (0: none, the paper; e.g. 0.999); evaluated beside the weights, saved with '
                             'them, translated with --weights=ema.', low=0.0, high=1.0, before=0.0)


def warmup_schedule(d_model: int, warmup_steps: int, factor: float = 1.0, decay: str = 'inverse_sqrt'):
  """§5.3 with decay 'inverse_sqrt': lrate(step_num) = factor · d_model^-0.5 · min(step_num^-0.5, step_num ·
  warmup^-1.5), step_num from 1; another registered decay (DECAYS) replaces step_num^-0.5 after the warmup."""
  if decay not in DECAYS:
    raise ValueError(f'decay={decay!r}: must be one of {LR_DECAYS}')
  rate = DECAYS[decay]

  def schedule(step_num):
    step_num = jnp.maximum(jnp.asarray(step_num, jnp.float32), 1.0)
    return factor * d_model**-0.5 * jnp.minimum(rate(step_num, warmup_steps), step_num * warmup_steps**-1.5)

  return schedule


def learning_rate(settings: OptimizerSettings, d_model: int) -> optax.Schedule:
  """The run's learning rate for a model of width `d_model`, indexed by optax's update count (from 0)."""
  paper_schedule = warmup_schedule(d_model, settings.warmup_steps, settings.learning_rate_factor, settings.lr_decay)
  paper = lambda count: paper_schedule(count + 1)  # optax counts updates from 0, the paper from 1.
  schedule = paper
  if settings.cooldown_steps > 0:
    # 1 until update num_train_steps - cooldown_steps, then linearly to 0 at num_train_steps (the last
    # update, number num_train_steps - 1, gets 1/cooldown_steps of the paper's rate).
    ramp = optax.linear_schedule(1.0, 0.0, settings.cooldown_steps, settings.num_train_steps - settings.cooldown_steps)
    schedule = lambda count: paper(count) * ramp(count)
  return schedule


def create_optimizer(settings: OptimizerSettings, d_model: int) -> optax.GradientTransformation:
  """The run's optimizer: Adam on `learning_rate`, optional clipping, non-finite updates skipped."""
  tx = optax.adam(learning_rate(settings, d_model), b1=settings.adam_b1, b2=settings.adam_b2, eps=settings.adam_eps)
  if settings.grad_clip_norm > 0:
    tx = optax.chain(optax.clip_by_global_norm(settings.grad_clip_norm), tx)
  if settings.max_skipped_steps > 0:  # a non-finite gradient skips its update (the loop counts them)
    tx = optax.apply_if_finite(tx, max_consecutive_errors=settings.max_skipped_steps)
  return tx


def ema_update(ema_params, params, decay: float):
  """One step of the weights' exponential moving average: decay · ema + (1 - decay) · params (optax's own
  incremental update; the average keeps the parameters' dtype and sharding)."""
  return optax.incremental_update(params, ema_params, 1.0 - decay)
