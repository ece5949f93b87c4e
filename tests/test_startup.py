"""startup.py's own parts: the data stream's seed on a restart, and the banner that says what a run is on and
what it will compile (set-up as a whole runs in tests/test_train_loop.py)."""

import dataclasses

from configs import tiny
from flax_transformer import partitioning, settings, startup


def test_a_restarted_stream_gets_a_seed_of_its_own_and_a_fresh_one_the_runs():
  assert startup.data_seed(7, 0) == 7
  restarted = {startup.data_seed(7, step) for step in (1, 2, 100)} | {startup.data_seed(8, 1)}
  assert len(restarted) == 4 and 7 not in restarted and all(0 <= seed < 2 ** 31 for seed in restarted)
  assert startup.data_seed(7, 100) == startup.data_seed(7, 100)  # every process derives the same


def test_the_banner_names_the_mesh_the_per_device_batch_and_what_selection_is_on():
  config = tiny.get_config()
  config.tokens_per_batch, config.gradient_accumulation_steps = 512, 2
  s = settings.resolve(config, 'cpu')
  mesh = partitioning.create_mesh((2, 2, 2))
  lines = startup.banner(s, mesh, 12_160, 3).splitlines()
  assert lines[0] == 'platform: cpu (cpu), 8 devices (8 on this process); process 0 of 1'
  assert lines[2:3] == ['mesh: data=2 x fsdp=2 x model=2']
  assert lines[3].startswith('model: 12,160 parameters (float32)')
  assert lines[4] == ('batch: 512 tokens per side per step globally, 128 per data-parallel device, 2 '
                      'micro-batch(es); 3 batch shapes to compile')  # data 2 x fsdp 2 devices take rows
  assert len(lines) == 5  # nothing chosen beyond the paper: no selection line
  chosen = dataclasses.replace(s, training=dataclasses.replace(s.training, keep_best=2, best_metric='loss',
                                                               early_stopping_evaluations=3),
                               optimizer=dataclasses.replace(s.optimizer, ema_decay=0.999))
  assert startup.banner(chosen, mesh, 12_160, 3).splitlines()[-1] == (
      'selection: moving average of the weights (decay 0.999), evaluated beside them; the 2 best checkpoints by '
      'validation loss kept; early stopping after 3 evaluations without improvement')
