"""The loss against a hand computation and against optax's one-hot cross-entropy."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from flax_transformer import losses


def test_loss_equals_hand_computation():
  logits = np.array([[[2.0, 0.5, -1.0, 0.0], [0.1, 0.2, 0.3, 0.4], [5.0, 0.0, 0.0, 0.0]]], np.float32)
  targets = np.array([[2, 3, 0]], np.int32)  # last position is padding
  eps, vocab = 0.1, 4
  total = 0.0
  for t in range(2):  # only the non-padding positions
    log_p = logits[0, t] - np.log(np.exp(logits[0, t]).sum())
    q = np.full(vocab, eps / (vocab - 1))
    q[targets[0, t]] = 1 - eps
    total += -(q * log_p).sum() + (q * np.log(q)).sum()  # KL(q || p)
  sums = losses.loss_and_metrics(jnp.asarray(logits), jnp.asarray(targets), eps)
  np.testing.assert_allclose(float(sums['loss']), total, rtol=1e-5)
  assert float(sums['tokens']) == 2.0
  assert float(sums["correct"]) == 1.0  # argmaxes 0 and 3 against targets 2 and 3


def test_loss_matches_optax_and_counts_correct(np_rng):
  logits = np_rng.normal(size=(3, 5, 11)).astype(np.float32)
  targets = np_rng.integers(1, 11, size=(3, 5)).astype(np.int32)
  targets[0, 3:] = 0
  eps = 0.1
  smoothed = optax.smooth_labels(np.eye(11)[targets], 0.0)
  smoothed = smoothed * (1 - eps) + (1 - smoothed) * eps / 10
  reference = optax.softmax_cross_entropy(logits, smoothed) + (smoothed * np.log(smoothed)).sum(-1)
  nll = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
  weights = targets != 0
  sums = losses.loss_and_metrics(jnp.asarray(logits), jnp.asarray(targets), eps)
  np.testing.assert_allclose(float(sums['loss']), float((reference * weights).sum()), rtol=1e-5)
  np.testing.assert_allclose(float(sums['nll']), float((nll * weights).sum()), rtol=1e-5)
  assert float(sums['correct']) == float(((logits.argmax(-1) == targets) * weights).sum())


def test_without_smoothing_loss_is_nll(np_rng):
  logits = np_rng.normal(size=(2, 3, 7)).astype(np.float32)
  targets = np.array([[1, 2, 3], [4, 5, 0]], np.int32)
  sums = losses.loss_and_metrics(jnp.asarray(logits), jnp.asarray(targets), 0.0)
  # The negative log-likelihood of the 5 non-padding targets, by hand in float64.
  log_p = logits.astype(np.float64) - np.log(np.exp(logits.astype(np.float64)).sum(-1, keepdims=True))
  nll = -sum(log_p[b, t, targets[b, t]] for b in range(2) for t in range(3) if targets[b, t])
  np.testing.assert_allclose(float(sums['loss']), nll, rtol=1e-5)
  np.testing.assert_allclose(float(sums['nll']), nll, rtol=1e-5)


def test_paper_bleu_splits_compounds():
  from flax_transformer import scoring
  assert scoring.split_compounds('Rhein-Main-Gebiet ist groß') == 'Rhein ##AT##-##AT## Main ##AT##-##AT## Gebiet ist groß'
  perfect, label = scoring.paper_bleu(['Das Rhein-Main-Gebiet ist groß.'], ['Das Rhein-Main-Gebiet ist groß.'])
  assert abs(perfect - 100.0) < 1e-9 and 'compound splitting' in label
  partial, _ = scoring.paper_bleu(['Das Rhein-Gebiet ist sehr groß.'], ['Das Rhein-Main-Gebiet ist groß.'])
  sacre, _ = scoring.bleu(['Das Rhein-Gebiet ist sehr groß.'], ['Das Rhein-Main-Gebiet ist groß.'])
  assert 0 < partial < 100 and partial != sacre  # the split pieces count as matches


@pytest.mark.parametrize('eps', [0.0, 0.1])
def test_fused_projection_loss_matches_autodiff(np_rng, eps):
  """The hand-written VJP of projection + loss gives autodiff's values and gradients (loss and nll)."""
  hidden = jnp.asarray(np_rng.normal(size=(3, 5, 8)), jnp.float32)
  weight = jnp.asarray(np_rng.normal(size=(13, 8)) * 0.5, jnp.float32)
  targets = np_rng.integers(1, 13, size=(3, 5)).astype(np.int32)
  targets[1, 2:] = 0
  targets = jnp.asarray(targets)

  def unfused(h, w):
    return losses.loss_and_metrics(jnp.einsum('bte,ve->btv', h, w), targets, eps)

  def fused(h, w):
    return losses.projected_loss_and_metrics(h, w, targets, eps)

  expected, got = unfused(hidden, weight), jax.jit(fused)(hidden, weight)
  for name in ('loss', 'nll', 'correct', 'tokens'):
    np.testing.assert_allclose(float(got[name]), float(expected[name]), rtol=1e-5, err_msg=name)
  for name in ('loss', 'nll'):
    for argnum in (0, 1):
      want = jax.grad(lambda h, w: unfused(h, w)[name], argnum)(hidden, weight)
      have = jax.jit(jax.grad(lambda h, w: fused(h, w)[name], argnum))(hidden, weight)
      np.testing.assert_allclose(np.asarray(have), np.asarray(want), rtol=1e-4, atol=1e-6, err_msg=f'{name} {argnum}')
  # A mixed cotangent (as the loss and a metric both reach the objective) adds up.
  mixed = lambda f: jax.grad(lambda h: f(h, weight)['loss'] + 0.5 * f(h, weight)['nll'])(hidden)
  np.testing.assert_allclose(np.asarray(mixed(fused)), np.asarray(mixed(unfused)), rtol=1e-4, atol=1e-6)
