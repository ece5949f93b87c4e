"""The pure train step learns, and sharded steps equal single-device steps."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax_transformer import settings, train_state
from flax_transformer import partitioning, steps
from tests.conftest import random_batch


def make_step(config, model_config, mesh):
  state, shardings = train_state.create_train_state(model_config, settings.resolve(config).optimizer, mesh,
                                                     jax.random.key(config.seed, impl=config.dropout_rng_impl))
  step = functools.partial(steps.train_step, model_config=model_config, label_smoothing=config.label_smoothing,
                           gradient_accumulation_steps=config.gradient_accumulation_steps,
                           ema_decay=config.ema_decay)
  return state, partitioning.jit_train_step(step, mesh, shardings)


@pytest.mark.slow  # 8 s or more of compilation and steps on 2 cores (the marker)
def test_first_loss_is_log_vocab_and_one_batch_is_overfit(tiny_config, np_rng):
  tiny_config.label_smoothing = 0.0
  tiny_config.model.dropout_rate = 0.0
  tiny_config.model.vocab_size = 2048  # log V ≫ the 0.5 nats that N(0, d^-0.5) tied logits add at init
  tiny_config.warmup_steps = 30
  # Peak 0.016: a smooth descent. At 4× this (peak 0.065) the loss oscillated between 0.5 and 4 and where it
  # stood at step 200 depended on the CPU's vector ISA (AVX-512: 2.07, AVX2: 0.46) through round-off alone.
  tiny_config.learning_rate_factor = 0.5
  model_config = settings.model_settings(tiny_config)
  mesh = partitioning.create_mesh((1, 1, 1), jax.devices()[:1])
  state, train_step = make_step(tiny_config, model_config, mesh)
  batch = random_batch(np_rng, 8, 10, 10, model_config.vocab_size)
  rng = jax.random.key(0)
  losses = []
  for _ in range(200):
    state, metrics = train_step(state, batch, rng)
    losses.append(float(metrics['loss']))
  print(f'first loss {losses[0]:.3f} (log V = {np.log(model_config.vocab_size):.3f}), after 200 steps {losses[-1]:.4f}')
  assert abs(losses[0] / np.log(model_config.vocab_size) - 1) < 0.10
  assert losses[-1] < 0.02 * losses[0]  # seen: 0.002 with either ISA
  assert int(state.step) == 200
  assert train_step.jitted._cache_size() == 1  # one compilation for one batch shape


@pytest.mark.slow  # 8 s or more of compilation and steps on 2 cores (the marker)
def test_the_weights_moving_average_is_the_closed_form(tiny_config, np_rng):
  """With decay d, after k steps from the initial weights p_0: ema_k = d^k p_0 + (1 - d) Σ_i d^(k-i) p_i, the
  p_i being the weights after step i; sharded like the parameters, on a 4-device mesh."""
  tiny_config.ema_decay, k = 0.8, 5
  model_config = settings.model_settings(tiny_config)
  mesh = partitioning.create_mesh((4, 1, 1), jax.devices()[:4])
  state, train_step = make_step(tiny_config, model_config, mesh)
  assert jax.tree_util.tree_all(jax.tree_util.tree_map(lambda e, p: e.sharding == p.sharding, state.ema_params,
                                                        state.params))
  weights = [jax.device_get(state.params)]
  for i in range(k):
    state, _ = train_step(state, random_batch(np_rng, 8, 7, 6, model_config.vocab_size), jax.random.key(0))
    weights.append(jax.device_get(state.params))
  d = tiny_config.ema_decay
  expected = jax.tree_util.tree_map(lambda *p: d ** k * p[0] + (1 - d) * sum(d ** (k - i) * p[i] for i in range(1, k + 1)),
                                    *weights)
  for name, got, want in zip(jax.tree_util.tree_leaves_with_path(state.ema_params), jax.tree_util.tree_leaves(state.ema_params),
                             jax.tree_util.tree_leaves(expected)):
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-7, err_msg=jax.tree_util.keystr(name[0]))
  assert not np.allclose(np.asarray(jax.tree_util.tree_leaves(state.ema_params)[0]),
                         jax.tree_util.tree_leaves(state.params)[0])  # the average lags the weights


@pytest.mark.slow  # 8 s or more of compilation and steps on 2 cores (the marker)
@pytest.mark.parametrize('mesh_shape', [(1, 1, 1), (8, 1, 1)])
def test_gradient_accumulation_equals_one_big_batch(tiny_config, np_rng, mesh_shape):
  tiny_config.model.dropout_rate = 0.0
  tiny_config.model.num_encoder_layers = tiny_config.model.num_decoder_layers = 1  # compile time
  model_config = settings.model_settings(tiny_config)
  mesh = partitioning.create_mesh(mesh_shape, jax.devices()[:np.prod(mesh_shape)])
  batch = random_batch(np_rng, 32, 7, 6, model_config.vocab_size)
  state, train_step = make_step(tiny_config, model_config, mesh)
  full, full_metrics = train_step(state, batch, jax.random.key(0))
  tiny_config.gradient_accumulation_steps = 4
  state, train_step = make_step(tiny_config, model_config, mesh)
  accumulated, accumulated_metrics = train_step(state, batch, jax.random.key(0))
  np.testing.assert_allclose(float(full_metrics['loss']), float(accumulated_metrics['loss']), rtol=1e-5)
  for a, b in zip(jax.tree_util.tree_leaves(full.params), jax.tree_util.tree_leaves(accumulated.params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-4)


def _token_gathers(tiny_config, np_rng) -> list[str]:
  """The all-gathers of int32 (token) arrays in the compiled k=4 step on an 8-way data-parallel mesh."""
  tiny_config.gradient_accumulation_steps = 4
  tiny_config.model.num_encoder_layers = tiny_config.model.num_decoder_layers = 1  # compile time
  model_config = settings.model_settings(tiny_config)
  mesh = partitioning.create_mesh((8, 1, 1))
  state, train_step = make_step(tiny_config, model_config, mesh)
  batch = random_batch(np_rng, 32, 7, 6, model_config.vocab_size)
  with partitioning.mesh_context(mesh):
    hlo = train_step.jitted.lower(state, batch, jax.random.key(0)).compile().as_text()
  return re.findall(r'= s32\[[^\]]*\][^ ]* all-gather[^\n]*', hlo)


@pytest.mark.slow  # 8 s or more of compilation and steps on 2 cores (the marker)
def test_accumulation_keeps_each_device_rows(tiny_config, np_rng, monkeypatch):
  assert _token_gathers(tiny_config, np_rng) == []  # strided micro-batches: no token moves between devices
  # The check can fail: contiguous micro-batches gather each one's rows from the devices holding them.
  monkeypatch.setattr(steps, 'split_micro_batches', lambda batch, k: jax.tree_util.tree_map(
      lambda x: x.reshape(k, x.shape[0] // k, *x.shape[1:]), batch))
  assert _token_gathers(tiny_config, np_rng)


@pytest.mark.slow  # 8 s or more of compilation and steps on 2 cores (the marker)
@pytest.mark.parametrize('share_embeddings,pre_norm', [(True, False), (False, True)])
def test_fused_output_loss_step_equals_autodiff_step(tiny_config, np_rng, share_embeddings, pre_norm):
  tiny_config.model.share_embeddings, tiny_config.model.pre_norm = share_embeddings, pre_norm
  tiny_config.model.dropout_rate = 0.1  # same masks on both paths
  tiny_config.model.num_encoder_layers = tiny_config.model.num_decoder_layers = 1  # compile time; the head is tested
  model_config = settings.model_settings(tiny_config)
  mesh = partitioning.create_mesh((1, 1, 1), jax.devices()[:1])
  batch = random_batch(np_rng, 8, 7, 6, model_config.vocab_size)
  results = []
  for fused in (True, False):
    state, shardings = train_state.create_train_state(model_config, settings.resolve(tiny_config).optimizer, mesh, jax.random.key(0))
    step = functools.partial(steps.train_step, model_config=model_config, label_smoothing=0.1,
                             fused_output_loss=fused)
    results.append(partitioning.jit_train_step(step, mesh, shardings)(state, batch, jax.random.key(1)))
  (fused_state, fused_metrics), (plain_state, plain_metrics) = results
  for name in ('loss', 'nll', 'accuracy', 'grad_norm'):
    np.testing.assert_allclose(float(fused_metrics[name]), float(plain_metrics[name]), rtol=1e-5, err_msg=name)
  # Adam's first update is lr · g / (|g| + eps): an element whose gradient nearly cancels takes the round-off
  # of the two paths' different summation orders into its step. Seen: 1 of 1024 entries off by 2.5e-6
  # (AVX-512) after one step of lr 0.0079. A wrong fused gradient moves many entries by a sizeable part of
  # that lr; 5e-5 (0.6% of it) tells the two apart.
  for a, b in zip(jax.tree_util.tree_leaves(fused_state.params), jax.tree_util.tree_leaves(plain_state.params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=5e-5, rtol=1e-5)


def _sharded_setup(tiny_config, small_model_config, np_rng):
  tiny_config.model = tiny_config.model.__class__(small_model_config.__dict__)
  tiny_config.model.num_encoder_layers = tiny_config.model.num_decoder_layers = 1  # compile time
  tiny_config.model.dropout_rate = 0.1  # dropout masks must not depend on the mesh either
  # Adam's update m / (sqrt(v) + eps) is ±lr for any gradient element far below eps = 1e-9 in size, so the
  # round-off of a different reduction order (per mesh) can flip the sign of a near-zero element's whole
  # update. Seen with eps 1e-9: 1 of 1024 entries of one kernel off by 1.7e-4 after 2 steps (CI failed on it).
  # With eps 1e-6 such elements move by about lr · g / eps instead, and a mesh's round-off stays small.
  tiny_config.adam_eps = 1e-6
  return tiny_config, settings.model_settings(tiny_config), random_batch(np_rng, 8, 9, 7, 64)


def _two_steps(config, model_config, batch, shape):
  devices = jax.devices()[:1] if shape == (1, 1, 1) else jax.devices()
  mesh = partitioning.create_mesh(shape, devices)
  state, train_step = make_step(config, model_config, mesh)
  for _ in range(2):
    state, metrics = train_step(state, batch, jax.random.key(3, impl=config.dropout_rng_impl))
  return float(metrics['loss']), jax.device_get((state.params, state.opt_state))


@pytest.fixture(scope='module')
def single_device_result():
  from configs import tiny
  from tests.conftest import small_model_config
  config, model_config, batch = _sharded_setup(tiny.get_config(), small_model_config.__wrapped__(),
                                               np.random.default_rng(0))
  return _two_steps(config, model_config, batch, (1, 1, 1))


@pytest.mark.slow  # 8 s or more of compilation and steps on 2 cores (the marker)
@pytest.mark.parametrize('mesh_shape', [(8, 1, 1), (2, 4, 1), (2, 1, 4), (1, 8, 1), (2, 2, 2)])
def test_sharded_step_equals_single_device(tiny_config, small_model_config, mesh_shape, single_device_result):
  assert len(jax.devices()) == 8, 'tests run with XLA_FLAGS=--xla_force_host_platform_device_count=8'
  config, model_config, batch = _sharded_setup(tiny_config, small_model_config, np.random.default_rng(0))
  loss_n, trees_n = _two_steps(config, model_config, batch, mesh_shape)
  loss_1, trees_1 = single_device_result
  print(f'mesh {mesh_shape}: loss {loss_n:.6f} vs 1 device {loss_1:.6f}')
  np.testing.assert_allclose(loss_n, loss_1, rtol=1e-5)
  params_1, opt_1 = trees_1
  params_n, opt_n = trees_n
  for a, b in zip(jax.tree_util.tree_leaves(opt_1), jax.tree_util.tree_leaves(opt_n)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5)
  worst = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
              for a, b in zip(jax.tree_util.tree_leaves(params_1), jax.tree_util.tree_leaves(params_n)))
  print(f'mesh {mesh_shape}: largest parameter difference {worst:.2e}')
  # Adam still turns a cancelling gradient sum's round-off into a part of that element's step: seen up to
  # 2.9e-5 (AVX2) and 1.7e-5 (AVX-512) after 2 steps whose learning rates sum to 0.017. A sharding bug moves
  # many entries by a sizeable part of that 0.017; 1e-4 (0.6% of it) tells the two apart.
  for a, b in zip(jax.tree_util.tree_leaves(params_1), jax.tree_util.tree_leaves(params_n)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4, rtol=1e-5)


def _lowered_train_step(tiny_config, dtype, fused):
  tiny_config.model.dtype = dtype
  model_config = settings.model_settings(tiny_config)
  mesh = partitioning.create_mesh((1, 1, 1), jax.devices()[:1])
  state, shardings = train_state.create_train_state(model_config, settings.resolve(tiny_config).optimizer, mesh, jax.random.key(0))
  step = partitioning.jit_train_step(
      functools.partial(steps.train_step, model_config=model_config, label_smoothing=0.1, fused_output_loss=fused),
      mesh, shardings)
  batch = random_batch(np.random.default_rng(0), 8, 9, 7, model_config.vocab_size)
  with partitioning.mesh_context(mesh):
    return state, step.jitted.lower(state, batch, jax.random.key(0)).as_text()


def float32_dot_products(stablehlo: str) -> list[str]:
  """The dot_general ops of lowered StableHLO that multiply float32 values: a float32 operand, and no stated
  algorithm that rounds the operands to bf16 (layers.float32_accumulating_einsum states one)."""
  dots = [line for line in stablehlo.splitlines() if 'stablehlo.dot_general' in line]
  operands = lambda line: re.search(r':\s*\((tensor<[^>]*>), (tensor<[^>]*>)\)', line).groups()
  return [line for line in dots
          if any(t.endswith('xf32>') for t in operands(line)) and 'lhs_precision_type = bf16' not in line]


@pytest.mark.parametrize('fused', [True, pytest.param(False, marks=pytest.mark.slow)])
def test_bfloat16_step_has_no_float32_dot_products(tiny_config, fused):
  """Every matrix product of the bf16 step (forward and backward, attention and output projection included)
  takes bf16 inputs; the float32 step, counted the same way, has only float32 ones."""
  state, bf16_text = _lowered_train_step(tiny_config, 'bfloat16', fused)
  left = float32_dot_products(bf16_text)
  total = bf16_text.count('stablehlo.dot_general')
  print(f'bf16 step (fused_output_loss={fused}): {len(left)} float32 dot products of {total}')
  assert total > 40 and left == []
  # Parameters and Adam moments stay float32 under bf16 compute.
  assert {leaf.dtype for leaf in jax.tree_util.tree_leaves((state.params, state.opt_state))
          if leaf.ndim} == {np.dtype('float32')}
  _, f32_text = _lowered_train_step(tiny_config, 'float32', fused)
  assert len(float32_dot_products(f32_text)) == f32_text.count('stablehlo.dot_general') == total


def _window_means(tiny_config, dtype: str, seeds, batches, count=200, window=25) -> np.ndarray:
  """[len(seeds), count // window]: mean losses of each window of `count` steps cycling over `batches`, one run
  per dropout seed, all from the same initial parameters, the seeds' runs side by side in one vmapped step."""
  tiny_config.model.dtype = dtype
  model_config = settings.model_settings(tiny_config)
  mesh = partitioning.create_mesh((1, 1, 1), jax.devices()[:1])
  initial, _ = train_state.create_train_state(model_config, settings.resolve(tiny_config).optimizer, mesh,
                                              jax.random.key(tiny_config.seed, impl=tiny_config.dropout_rng_impl))
  step = functools.partial(steps.train_step, model_config=model_config, label_smoothing=tiny_config.label_smoothing,
                           gradient_accumulation_steps=1, ema_decay=0.0)
  each_seed = jax.jit(jax.vmap(step, in_axes=(0, None, 0)), donate_argnums=0)
  state = jax.tree_util.tree_map(lambda x: jnp.stack([x] * len(seeds)), initial)  # [seeds, ...] per leaf
  keys = jnp.stack([jax.random.key(seed, impl='rbg') for seed in seeds])
  losses = []
  with partitioning.mesh_context(mesh):
    for i in range(count):
      state, metrics = each_seed(state, batches[i % len(batches)], keys)
      losses.append(metrics['loss'])  # [seeds]
  return np.asarray(jax.device_get(losses)).T.reshape(len(seeds), count // window, window).mean(axis=2)


@pytest.mark.slow
def test_bfloat16_training_tracks_float32(tiny_config):
  """200 tiny-config steps (dropout on, the same 4 batches) from the same start, for 6 dropout seeds in each
  format. Such runs drift apart chaotically (a memorisation task), so the bounds come from the seed spread
  and bf16's precision, not from one machine's curve:
  - in the first window, before the drift, bf16 stays within one bf16 rounding unit (2^-8) of float32;
  - in every window, bf16 and float32 runs with the same seed differ on average by less than float32 runs
    with different seeds do: rounding to bf16 moves the curve less than another dropout seed does."""
  tiny_config.warmup_steps = 30
  tiny_config.learning_rate_factor = 0.5
  tiny_config.model.vocab_size = 256
  rng = np.random.default_rng(0)
  batches = [random_batch(rng, 16, 10, 10, 256) for _ in range(4)]
  seeds = (1, 2, 3, 4, 5, 6)
  f32 = _window_means(tiny_config, 'float32', seeds, batches)  # [seeds, windows]
  bf16 = _window_means(tiny_config, 'bfloat16', seeds, batches)
  paired_gap = np.abs(bf16 - f32).mean(axis=0)  # same seed, other format
  seed_gap = np.mean([np.abs(f32[i] - f32[j]) for i in range(len(seeds)) for j in range(i)], axis=0)
  first_window_gap = np.abs(bf16[:, 0] / f32[:, 0] - 1).max()
  for name, curves in (('float32', f32), ('bfloat16', bf16)):
    print(f'{name:>8} window means over seeds: ' + ' '.join(f'{x:.3f}' for x in curves.mean(axis=0)))
  print('same seed, bf16 vs float32:  ' + ' '.join(f'{x:.3f}' for x in paired_gap))
  print('float32, seed vs other seed: ' + ' '.join(f'{x:.3f}' for x in seed_gap))
  print(f'first window: largest relative bf16 gap {first_window_gap:.2e} (bf16 rounding unit {2**-8:.2e}); '
        f'largest gap ratio {(paired_gap / seed_gap).max():.2f}')
  assert (f32[:, -1] < 0.5 * f32[:, 0]).all() and (bf16[:, -1] < 0.5 * bf16[:, 0]).all()  # both learn
  assert first_window_gap < 2**-8
  assert (paired_gap < seed_gap).all()
