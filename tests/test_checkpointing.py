"""Orbax checkpoints: the train state saved and restored, recovery that moves aside only damage, and a whole
checkpoint of another kind (parameters only, another model) refused without being touched."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax_transformer import checkpointing, partitioning, settings, train_state, weights
from flax_transformer.model import Transformer


def test_restore_moves_aside_only_damage_and_stops_when_every_checkpoint_is_damaged(tiny_config, tmp_path, monkeypatch):
  mesh = partitioning.create_mesh((1, 1, 1), jax.devices()[:1])
  state, shardings = train_state.create_train_state(settings.model_settings(tiny_config), settings.resolve(tiny_config).optimizer, mesh,
                                                     jax.random.key(0))
  manager = checkpointing.create_manager(str(tmp_path), 10, asynchronous=False)
  for step in (1, 2):
    checkpointing.save_state(manager, state.replace(step=jnp.int32(step)), {'step': step})
  monkeypatch.setattr(checkpointing.time, 'sleep', lambda seconds: None)
  folder = tmp_path / 'checkpoints'

  def unreachable(*args):
    raise ConnectionError('storage.example.com: connection timed out')
  with monkeypatch.context() as patched:  # a storage error says nothing about the files: nothing renamed
    patched.setattr(checkpointing, 'restore_state', unreachable)
    with pytest.raises(checkpointing.CheckpointRestoreFailed, match=r'checkpoint .*/2 could not be read '
                       r'\(ConnectionError: storage.example.com: connection timed out\) after 3 attempts'):
      checkpointing.restore_latest(manager, state, shardings)
  assert sorted(p.name for p in folder.iterdir()) == ['1', '2']

  (folder / '2.corrupt').mkdir()  # step 2 was damaged once before, and written again since
  (folder / '2' / 'data' / 'process_0.json').write_text('{"step": ')
  restored, data_state, step = checkpointing.restore_latest(manager, state, shardings)
  assert step == 1 and data_state == {'step': 1} and int(restored.step) == 1
  assert sorted(p.name for p in folder.iterdir()) == ['1', '2.corrupt', '2.corrupt.2']

  (folder / '1' / 'data' / 'process_0.json').write_text('')
  manager.reload()
  with pytest.raises(checkpointing.CheckpointDamaged, match=r'every checkpoint in .* is damaged \(steps \[1\] were '
                     r'moved aside as <step>.corrupt\); the run stopped rather than train again from step 0'):
    checkpointing.restore_latest(manager, state, shardings)
  assert sorted(p.name for p in folder.iterdir()) == ['1.corrupt', '2.corrupt', '2.corrupt.2']


def test_a_checkpoint_of_another_kind_is_refused_not_set_aside(small_model_config, tmp_path):
  model = Transformer(small_model_config)
  ids = np.ones((1, 3), np.int32)
  params = nn.meta.unbox(jax.jit(model.init)(jax.random.key(0), ids, ids)['params'])
  weights.save_params(str(tmp_path / 'checkpoints'), 5, params, averaged_steps=[4, 5])
  step = tmp_path / 'checkpoints' / '5'
  assert checkpointing.saved_items(step) == ['params']
  checkpointing.check_kind(step, params, False, tmp_path)  # parameters are what translation needs
  with pytest.raises(checkpointing.CheckpointOfAnotherKind, match=r'checkpoint 5 in .* holds parameters only \(an '
                     r'averaged model\), not a training state; .* --config.init_from='):
    checkpointing.check_kind(step, params, True, tmp_path)
  wider = dataclasses.replace(small_model_config, d_ff=2 * small_model_config.d_ff)
  other = nn.meta.unbox(partitioning.abstract_params(wider))
  with pytest.raises(checkpointing.CheckpointOfAnotherKind, match=r'holds another model \(parameter '
                     r'decoder/feed_forward/wi_bias of shape \(2, 64\) where this model has it of shape \(2, 128\)\)'):
    weights.restore_params(str(tmp_path), 5, other)
  assert checkpointing.available_steps(str(tmp_path)) == [5]  # left where it is
