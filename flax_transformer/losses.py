"""§5.4 label-smoothed cross-entropy, weighted by non-padding targets, and token accuracy.

The smoothed target puts `1 - ε` on the reference token and `ε / (V - 1)` on every other
token (tensor2tensor's convention); the loss is the KL divergence to that distribution, so a
perfect model scores 0. It is computed from three reductions over the vocabulary (log-sum-exp,
the reference logit, the sum of logits) so no [batch, length, vocab] one-hot or log-probability
tensor is built beside the logits.
"""

import jax
import jax.numpy as jnp
import numpy as np

from flax_transformer.model import PAD_ID


def smoothed_target_entropy(vocab_size: int, label_smoothing: float) -> float:
  """-Σ q log q of the smoothed target distribution q (a constant; 0 without smoothing)."""
  confidence = 1.0 - label_smoothing
  low = label_smoothing / (vocab_size - 1)
  return -(confidence * np.log(confidence) + (vocab_size - 1) * low * np.log(low + 1e-20)) if label_smoothing else 0.0


def token_losses(logits: jax.Array, targets: jax.Array, label_smoothing: float) -> tuple[jax.Array, jax.Array]:
  """Per-token smoothed loss and plain negative log-likelihood.

  Args:
    logits: [b, t, v] (any float dtype; reduced in float32).
    targets: [b, t] int32.
  Returns:
    (smoothed loss [b, t], nll [b, t]), both float32.
  """
  vocab_size = logits.shape[-1]
  logits = logits.astype(jnp.float32)
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
