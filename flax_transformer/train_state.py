"""Where the model and the optimizer meet: the train state (parameters, Adam's moments, the step, and with
config.ema_decay > 0 the weights' moving average), created directly in its sharded layout over a mesh, or as
abstract shapes for ahead-of-time compilation."""

from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax.training import train_state as flax_train_state
from jax.sharding import Mesh

from flax_transformer import optim, partitioning
from flax_transformer.model import Transformer, TransformerConfig
from flax_transformer.optim import OptimizerSettings


class TrainState(flax_train_state.TrainState):
  """Step, parameters and optimizer state, and `ema_params` (the weights' exponential moving average, laid out
  like the parameters) or None. The step is an array, so incrementing it never recompiles."""
  ema_params: Any = None


def _initializer(model_config: TransformerConfig, optimizer: OptimizerSettings):
  model = Transformer(model_config)
  tx = optim.create_optimizer(optimizer, model_config.d_model)

  def init(rng):
    dummy = jnp.ones((1, 1), jnp.int32)
    params = model.init(rng, dummy, dummy)['params']
    ema_params = params if optimizer.ema_decay > 0 else None  # the average starts at the initial weights
    return TrainState.create(apply_fn=model.apply, params=params, tx=tx, ema_params=ema_params)
  return init


def create_train_state(model_config: TransformerConfig, optimizer: OptimizerSettings, mesh: Mesh, rng: jax.Array):
  """Initialises the train state directly in its sharded layout (nothing is built on one device first).

  Returns (state, state_shardings).
  """
  partitioning.check_model_fits_mesh(model_config, mesh)
  init = _initializer(model_config, optimizer)
  shardings = partitioning.logical_to_shardings(jax.eval_shape(init, rng), mesh)
  with partitioning.mesh_context(mesh):
    state = jax.jit(lambda r: nn.meta.unbox(init(r)), out_shardings=shardings)(rng)
  return state, shardings


def abstract_train_state(model_config: TransformerConfig, optimizer: OptimizerSettings, mesh: Mesh):
  """The train state as jax.ShapeDtypeStructs carrying their shardings: for ahead-of-time compilation
  (plan.py), nothing is allocated. Returns (abstract state, state_shardings)."""
  partitioning.check_model_fits_mesh(model_config, mesh)
  boxed = jax.eval_shape(_initializer(model_config, optimizer), jax.random.key(0))
  shardings = partitioning.logical_to_shardings(boxed, mesh)
  abstract = jax.tree_util.tree_map(lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype,
                                                                                sharding=sharding),
                                    nn.meta.unbox(boxed), shardings)
  return abstract, shardings
