"""Pure training and evaluation steps. Bind the configuration with functools.partial (`for_run` binds a run's
settings); jit in partitioning.py."""

import functools

import jax
import jax.numpy as jnp
import optax
from flax import linen as nn

from flax_transformer import losses, optim
from flax_transformer.model import Transformer, TransformerConfig


def split_micro_batches(batch: dict, k: int) -> dict:
  """[B, l] arrays -> [k, B/k, l]: micro-batch i holds rows i, i + k, i + 2k, ... (strided).

  Each device's contiguous block of the batch then holds B/(k·devices) rows of every micro-batch, so no
  micro-step moves rows between devices (a contiguous split would gather each micro-batch's rows from
  the devices holding them).
  """
  return jax.tree_util.tree_map(
      lambda x: nn.with_logical_constraint(x.reshape(x.shape[0] // k, k, *x.shape[1:]).swapaxes(0, 1),
                                           (None, 'batch', 'length')), batch)  # [k, B/k, l]


def train_step(state, batch: dict, rng: jax.Array, *, model_config: TransformerConfig, label_smoothing: float,
               gradient_accumulation_steps: int = 1, fused_output_loss: bool = True, ema_decay: float = 0.0):
  """One optimizer update on `batch` ({'inputs': [B, s], 'targets': [B, t]} int32).

  With gradient_accumulation_steps = k the batch is split into k strided micro-batches of B/k rows whose
  gradients are summed (lax.scan) before one update normalised by all their target tokens.
  `rng` is the run's dropout key; it is folded with the step so every step draws fresh masks.
  fused_output_loss: the pre-softmax projection and the loss share one hand-written gradient
  (losses.projected_loss_and_metrics); False differentiates the logits path with autodiff.
  ema_decay: the decay of the weights' moving average, which a state with `ema_params` updates after the step.
  Returns (new state, metrics {'loss', 'nll', 'accuracy', 'tokens', 'grad_norm'}; the logging hook adds the learning rate).
  """
  model = Transformer(model_config)
  step_rng = jax.random.fold_in(rng, state.step)

  def loss_fn(params, micro_batch, micro_rng):
    inputs, targets = micro_batch['inputs'], micro_batch['targets']
    if fused_output_loss:
      hidden = model.apply({'params': params}, inputs, targets, deterministic=False, rngs={'dropout': micro_rng},
                           method=model.features)  # [b, t, e]
      weight = model.apply({'params': params}, method=model.output_weight)  # [v, e]
      sums = losses.projected_loss_and_metrics(hidden, weight, targets, label_smoothing, model_config.compute_dtype)
    else:
      logits = model.apply({'params': params}, inputs, targets, deterministic=False, rngs={'dropout': micro_rng})
      sums = losses.loss_and_metrics(logits, targets, label_smoothing)
    return sums['loss'], sums

  grad_fn = jax.grad(loss_fn, has_aux=True)
  k = gradient_accumulation_steps
  if k == 1:
    grads, sums = grad_fn(state.params, batch, step_rng)
  else:
    micro_batches = split_micro_batches(batch, k)

    def accumulate(carry, micro):
      index, micro_batch = micro
      grads, sums = grad_fn(state.params, micro_batch, jax.random.fold_in(step_rng, index))
      return jax.tree_util.tree_map(jnp.add, carry, (grads, sums)), None

    zero_grads = jax.tree_util.tree_map(jnp.zeros_like, state.params)
    zero_sums = {name: jnp.zeros((), jnp.float32) for name in ('loss', 'nll', 'correct', 'tokens')}
    (grads, sums), _ = jax.lax.scan(accumulate, (zero_grads, zero_sums), (jnp.arange(k), micro_batches))

  tokens = jnp.maximum(sums['tokens'], 1.0)
  grads = jax.tree_util.tree_map(lambda g: g / tokens, grads)  # Gradient of the per-token mean loss.
  new_state = state.apply_gradients(grads=grads)
  if state.ema_params is not None:
    new_state = new_state.replace(ema_params=optim.ema_update(state.ema_params, new_state.params, ema_decay))
  metrics = {'loss': sums['loss'] / tokens, 'nll': sums['nll'] / tokens, 'accuracy': sums['correct'] / tokens,
             'tokens': sums['tokens'], 'grad_norm': optax.tree.norm(grads)}
  return new_state, metrics


def eval_step(params, batch: dict, *, model_config: TransformerConfig, label_smoothing: float) -> dict:
  """Sums {'loss', 'nll', 'correct', 'tokens'} over the non-padding targets of `batch` (padding rows count 0)."""
  logits = Transformer(model_config).apply({'params': params}, batch['inputs'], batch['targets'], deterministic=True)
  return losses.loss_and_metrics(logits, batch['targets'], label_smoothing)


def for_run(s) -> tuple:
  """(train step, eval step) bound to a run's settings (settings.Settings), for partitioning's jit."""
  train = functools.partial(train_step, model_config=s.model, label_smoothing=s.training.label_smoothing,
                            gradient_accumulation_steps=s.training.gradient_accumulation_steps,
                            fused_output_loss=s.training.fused_output_loss, ema_decay=s.optimizer.ema_decay)
  evaluate = functools.partial(eval_step, model_config=s.model, label_smoothing=s.training.label_smoothing)
  return train, evaluate
