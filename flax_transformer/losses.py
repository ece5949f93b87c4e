"""§5.4 label-smoothed cross-entropy, weighted by non-padding targets, and token accuracy.

The smoothed target puts `1 - ε` on the reference token and `ε / (V - 1)` on every other
token (tensor2tensor's convention); the loss is the KL divergence to that distribution, so a
perfect model scores 0. Two forms with the same values and gradients (tests/test_losses.py):
`loss_and_metrics` through optax and autodiff (evaluation, and training on GPU/TPU), and
`projected_loss_and_metrics`, which fuses the pre-softmax projection with the loss under one
hand-written gradient (training on CPU; config.fused_output_loss).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from flax_transformer.layers import float32_accumulating_einsum
from flax_transformer.constants import PAD_ID


def smoothed_target_entropy(vocab_size: int, label_smoothing: float) -> float:
  """-Σ q log q of the smoothed target distribution q (a constant; 0 without smoothing)."""
  confidence = 1.0 - label_smoothing
  low = label_smoothing / (vocab_size - 1)
  return -(confidence * np.log(confidence) + (vocab_size - 1) * low * np.log(low + 1e-20)) if label_smoothing else 0.0


def token_losses(logits: jax.Array, targets: jax.Array, label_smoothing: float) -> tuple[jax.Array, jax.Array]:
  """Per-token smoothed loss and plain negative log-likelihood, through optax (the autodiff path).

  Args:
    logits: [b, t, v] (any float dtype; reduced in float32).
    targets: [b, t] int32.
  Returns:
    (smoothed loss [b, t], nll [b, t]), both float32.
  """
  vocab_size = logits.shape[-1]
  logits = logits.astype(jnp.float32)
  nll = optax.softmax_cross_entropy_with_integer_labels(logits, targets)  # [b, t]
  if not label_smoothing:
    return nll, nll
  low = label_smoothing / (vocab_size - 1)
  smoothed = jax.nn.one_hot(targets, vocab_size, dtype=jnp.float32) * (1.0 - label_smoothing - low) + low  # [b, t, v]
  cross_entropy = optax.softmax_cross_entropy(logits, smoothed)  # [b, t]: -Σ_v q_v log p_v
  return cross_entropy - smoothed_target_entropy(vocab_size, label_smoothing), nll


def reduced_token_losses(logits: jax.Array, targets: jax.Array, label_smoothing: float,
                         log_normalizer: jax.Array) -> tuple[jax.Array, jax.Array]:
  """`token_losses` from three reductions over the vocabulary (log-sum-exp, the reference logit, the sum of
  logits): no [n, v] target or log-probability array beside the logits. logits [n, v] float32."""
  vocab_size = logits.shape[-1]
  target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]  # [n]
  nll = log_normalizer - target_logit  # [n]
  if not label_smoothing:
    return nll, nll
  confidence = 1.0 - label_smoothing
  low = label_smoothing / (vocab_size - 1)
  sum_log_probs = jnp.sum(logits, axis=-1) - vocab_size * log_normalizer  # [n]: Σ_v log p_v
  cross_entropy = confidence * nll - low * (sum_log_probs + nll)  # [n]: -Σ_v q_v log p_v
  return cross_entropy - smoothed_target_entropy(vocab_size, label_smoothing), nll


def loss_and_metrics(logits: jax.Array, targets: jax.Array, label_smoothing: float) -> dict:
  """Sums over non-padding target tokens of [b, t] `targets`: normalise on the host (or by 'tokens').

  Returns {'loss', 'nll', 'correct', 'tokens'}, float32 scalars.
  """
  weights = (targets != PAD_ID).astype(jnp.float32)  # [b, t]
  loss, nll = token_losses(logits, targets, label_smoothing)
  correct = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)  # [b, t]
  return {'loss': jnp.sum(loss * weights), 'nll': jnp.sum(nll * weights),
          'correct': jnp.sum(correct * weights), 'tokens': jnp.sum(weights)}


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _projected_sums(hidden, weight, targets, label_smoothing):
  return _projected_sums_fwd(hidden, weight, targets, label_smoothing)[0]


def _projected_sums_fwd(hidden, weight, targets, label_smoothing):
  logits = float32_accumulating_einsum('ne,ve->nv', hidden, weight, hidden.dtype)  # [n, v] float32
  weights = (targets != PAD_ID).astype(jnp.float32)  # [n]
  log_normalizer = jax.nn.logsumexp(logits, axis=-1)  # [n]
  loss, nll = reduced_token_losses(logits, targets, label_smoothing, log_normalizer)
  correct = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
  sums = (jnp.sum(loss * weights), jnp.sum(nll * weights), jnp.sum(correct * weights), jnp.sum(weights))
  return sums, (hidden, weight, targets, logits, log_normalizer)


def _projected_sums_bwd(label_smoothing, residuals, cotangents):
  hidden, weight, targets, logits, log_normalizer = residuals
  g_loss, g_nll = cotangents[0], cotangents[1]  # 'correct' and 'tokens' have no gradient
  vocab_size = logits.shape[-1]
  weights = (targets != PAD_ID).astype(jnp.float32)[:, None]  # [n, 1]
  confidence, low = (1.0 - label_smoothing, label_smoothing / (vocab_size - 1)) if label_smoothing else (1.0, 0.0)
  is_target = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 1) == targets[:, None]  # [n, v]
  probs = jnp.exp(logits - log_normalizer[:, None])  # [n, v]
  # d(-Σ q log p)/dlogits = p - q, for the smoothed q (loss) and the one-hot q (nll); one fused pass.
  smoothed = jnp.where(is_target, confidence, low)
  one_hot = is_target.astype(jnp.float32)
  d_logits = weights * (g_loss * (probs - smoothed) + g_nll * (probs - one_hot))  # [n, v]
  # Both products in the inputs' dtype (bf16 under mixed precision), accumulated in float32.
  d_hidden = float32_accumulating_einsum('nv,ve->ne', d_logits, weight, hidden.dtype)  # [n, e]
  d_weight = float32_accumulating_einsum('ne,nv->ev', hidden, d_logits, hidden.dtype).T  # [v, e]: transpose the small side
  return d_hidden.astype(hidden.dtype), d_weight.astype(weight.dtype), None


_projected_sums.defvjp(_projected_sums_fwd, _projected_sums_bwd)


def projected_loss_and_metrics(hidden: jax.Array, weight: jax.Array, targets: jax.Array,
                               label_smoothing: float, dtype=jnp.float32) -> dict:
  """`loss_and_metrics(hidden @ weightᵀ, targets)` with a hand-written gradient for the projection + loss.

  The pre-softmax projection and the loss are one custom-VJP function: its backward pass builds the
  [n, v] logit gradient in one elementwise pass (softmax minus the smoothed target) and feeds it to the
  two matmuls, where autodiff of the separate pieces makes several passes over [n, v] arrays. Same values
  and gradients as the unfused path (tests/test_losses.py).

  Args:
    hidden: [b, t, e] decoder output; weight: [v, e] output embedding (float32 parameters).
    targets: [b, t] int32, 0 = padding.
    dtype: the products' input dtype (the model's compute dtype); logits and the loss are float32.
  Returns: {'loss', 'nll', 'correct', 'tokens'} sums, as loss_and_metrics.
  """
  e = hidden.shape[-1]
  sums = _projected_sums(hidden.reshape(-1, e).astype(dtype), weight.astype(dtype),
                         targets.reshape(-1), label_smoothing)
  return dict(zip(('loss', 'nll', 'correct', 'tokens'), sums))
