"""§5.4 label-smoothed cross-entropy, weighted by non-padding targets, and token accuracy.

The smoothed target puts `1 - ε` on the reference token and `ε / (V - 1)` on every other
token (tensor2tensor's convention); the loss is the KL divergence to that distribution, so a
perfect model scores 0. It is computed from three reductions over the vocabulary (log-sum-exp,
the reference logit, the sum of logits) so no [batch, length, vocab] one-hot or log-probability
tensor is built beside the logits.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from flax_transformer.model import PAD_ID


def smoothed_target_entropy(vocab_size: int, label_smoothing: float) -> float:
  """-Σ q log q of the smoothed target distribution q (a constant; 0 without smoothing)."""
  confidence = 1.0 - label_smoothing
  low = label_smoothing / (vocab_size - 1)
  return -(confidence * np.log(confidence) + (vocab_size - 1) * low * np.log(low + 1e-20)) if label_smoothing else 0.0


def token_losses(logits: jax.Array, targets: jax.Array, label_smoothing: float,
                 log_normalizer: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """Per-token smoothed loss and plain negative log-likelihood.

  Args:
    logits: [b, t, v] (any float dtype; reduced in float32).
    targets: [b, t] int32.
    log_normalizer: logsumexp(logits, -1) if the caller already has it.
  Returns:
    (smoothed loss [b, t], nll [b, t]), both float32.
  """
  vocab_size = logits.shape[-1]
  logits = logits.astype(jnp.float32)
  if log_normalizer is None:
    log_normalizer = jax.nn.logsumexp(logits, axis=-1)  # [b, t]
  target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]  # [b, t]
  nll = log_normalizer - target_logit  # [b, t]
  if not label_smoothing:
    return nll, nll
  confidence = 1.0 - label_smoothing
  low = label_smoothing / (vocab_size - 1)
  sum_log_probs = jnp.sum(logits, axis=-1) - vocab_size * log_normalizer  # [b, t]: Σ_v log p_v
  cross_entropy = confidence * nll - low * (sum_log_probs + nll)  # [b, t]: -Σ_v q_v log p_v
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
  logits = jnp.einsum('ne,ve->nv', hidden, weight)  # [n, v]
  weights = (targets != PAD_ID).astype(jnp.float32)  # [n]
  log_normalizer = jax.nn.logsumexp(logits, axis=-1)  # [n]
  loss, nll = token_losses(logits, targets, label_smoothing, log_normalizer)
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
  d_hidden = jnp.einsum('nv,ve->ne', d_logits, weight)  # [n, e]
  d_weight = jnp.einsum('ne,nv->ev', hidden, d_logits).T  # [v, e]: contract over tokens, transpose the small side
  return d_hidden, d_weight, None


_projected_sums.defvjp(_projected_sums_fwd, _projected_sums_bwd)


def projected_loss_and_metrics(hidden: jax.Array, weight: jax.Array, targets: jax.Array,
                               label_smoothing: float) -> dict:
  """`loss_and_metrics(hidden @ weightᵀ, targets)` with a hand-written gradient for the projection + loss.

  The pre-softmax projection and the loss are one custom-VJP function: its backward pass builds the
  [n, v] logit gradient in one elementwise pass (softmax minus the smoothed target) and feeds it to the
  two matmuls, where autodiff of the separate pieces makes several passes over [n, v] arrays. Same values
  and gradients as the unfused path (tests/test_losses.py).

  Args:
    hidden: [b, t, e] decoder output (cast to float32); weight: [v, e] output embedding (float32).
    targets: [b, t] int32, 0 = padding.
  Returns: {'loss', 'nll', 'correct', 'tokens'} sums, as loss_and_metrics.
  """
  e = hidden.shape[-1]
  sums = _projected_sums(hidden.reshape(-1, e).astype(jnp.float32), weight.astype(jnp.float32),
                         targets.reshape(-1), label_smoothing)
  return dict(zip(('loss', 'nll', 'correct', 'tokens'), sums))
