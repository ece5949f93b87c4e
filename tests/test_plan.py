"""The capacity plan compiles the real train step for N fake devices and reports consistent figures."""

import pytest

from configs import tiny
from flax_transformer import plan, settings


def test_analytic_flops_match_a_hand_count():
  """One encoder and one decoder layer, d=2, f=4, v=3, 1 sentence of 5 source and 7 target tokens."""
  from flax_transformer.model import TransformerConfig
  config = TransformerConfig(vocab_size=4, d_model=2, num_heads=1, d_ff=4, num_encoder_layers=1,
                             num_decoder_layers=1)
  encoder_weights = 4 * 2 * 2 + 2 * 2 * 4  # Q, K, V, O; two FFN matrices
  decoder_weights = 8 * 2 * 2 + 2 * 2 * 4 + 4 * 2  # + cross-attention's 4 matrices, + the projection
  dense = 6 * (encoder_weights * 5 + decoder_weights * 7)
  attention = 3 * 2 * 2 * 2 * (5 * 5 + 7 * 7 + 7 * 5)  # forward + backward of QKᵀ and AV
  assert plan.analytic_flops(config, 1, 5, 7) == dense + attention


@pytest.mark.slow
def test_a_plan_that_does_not_fit_names_the_mesh_that_does():
  """Parameters that dominate memory (a large vocabulary, short sentences): data parallelism replicates
  them on every device, FSDP splits them 8 ways; a memory limit between the two picks FSDP."""
  config = tiny.get_config()
  config.model.vocab_size = 16384
  config.max_train_length = 8
  config.tokens_per_batch = 64
  config.model.scan_unroll = config.model.num_encoder_layers  # one compilation per mesh: memory and FLOPs alike
  s = settings.resolve(config, 'cpu')
  replicated = plan.total_bytes(plan.compile_step(s, (8, 1, 1)))
  sharded = plan.total_bytes(plan.compile_step(s, (1, 8, 1)))
  assert sharded < replicated
  limit_gb = (sharded + replicated) / 2 / 1e9
  figures = plan.plan(s, 8, (8, 1, 1), device_memory_gb=limit_gb)
  assert figures['fits'] is False
  assert figures['fix']['flags'] == '--mesh=(1, 8, 1)'
  assert figures['fix']['total_bytes_per_device'] <= limit_gb * 1e9
