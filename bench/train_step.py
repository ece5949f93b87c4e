"""Training-step speed: our jitted step vs a PyTorch nn.Transformer reference, alternating, one invocation.

python bench/train_step.py --shape tiny|base|multi30k [--steps 10] [--threads N] [--batch B] [--length T] [--vocab V]

Shapes (all tokens real, dropout 0.1, Adam(0.9, 0.98, 1e-9), label smoothing 0.1, fp32):
  tiny: vocab 8192, d_model 256, 3+3 layers, 4 heads, d_ff 1024, batch 128 × 32/32
  base: vocab 32768, d_model 512, 6+6 layers, 8 heads, d_ff 2048, batch 64 × 32/32
  multi30k: configs/multi30k.py's model (vocab 6000, d_model 128, 3+3 layers, 4 heads, d_ff 512), batch 128 × 16/16
Model FLOPs = 6 × (non-embedding + output-projection parameters) × target tokens + attention matmuls.
Prints a markdown table; the last line is one JSON object.
"""

import argparse
import functools
import json
import math
import os
import resource
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHAPES = {
    'tiny': dict(vocab=8192, d_model=256, layers=3, heads=4, d_ff=1024, batch=128, length=32),
    'base': dict(vocab=32768, d_model=512, layers=6, heads=8, d_ff=2048, batch=64, length=32),
}


def _multi30k_shape() -> dict:
  """configs/multi30k.py's model (read from the config, so the two cannot drift apart), batch 128 × 16."""
  from configs import multi30k
  m = multi30k.get_config().model
  assert m.num_encoder_layers == m.num_decoder_layers, 'the reference builds equal encoder and decoder depths'
  return dict(vocab=m.vocab_size, d_model=m.d_model, layers=m.num_encoder_layers, heads=m.num_heads, d_ff=m.d_ff,
              batch=128, length=16)


SHAPES['multi30k'] = _multi30k_shape()


def model_flops(s) -> float:
  """plan.analytic_flops of shape `s` with batch × length tokens on each side."""
  from flax_transformer import plan
  from flax_transformer.model import TransformerConfig
  config = TransformerConfig(vocab_size=s['vocab'], d_model=s['d_model'], num_heads=s['heads'], d_ff=s['d_ff'],
                             num_encoder_layers=s['layers'], num_decoder_layers=s['layers'])
  return plan.analytic_flops(config, s['batch'], s['length'], s['length'])


def _median_gflops(product, n: int) -> float:
  """GFLOP/s of an n×n×n matrix product, `product()` running one to completion: median of 5 after a warm-up."""
  product()
  times = []
  for _ in range(5):
    start = time.perf_counter()
    product()
    times.append(time.perf_counter() - start)
  return 2 * n**3 / statistics.median(times) / 1e9


def matmul_peak(jax, jnp, dtype=None, n: int = 2048) -> float:
  """GFLOP/s of one jitted n×n matrix product in `dtype` (default float32), median of 5."""
  a = jnp.ones((n, n), dtype or jnp.float32)
  f = jax.jit(lambda x, y: x @ y)
  return _median_gflops(lambda: f(a, a).block_until_ready(), n)


def torch_matmul_peak(threads: int, n: int = 2048) -> float:
  """GFLOP/s of one n×n float32 product in PyTorch (the reference's GEMM library), median of 5."""
  import torch
  torch.set_num_threads(threads)
  a = torch.ones(n, n)
  return _median_gflops(lambda: a @ a, n)


def build_ours(s, batch, dtype: str = 'float32', max_positions: int = 64):
  """-> (run one step of our jitted train step on `batch`, the jitted step) for shape `s`."""
  import jax
  from configs import base
  from flax_transformer import partitioning, settings, steps, train_state
  config = base.get_config()
  config.model.vocab_size, config.model.d_model, config.model.d_ff = s['vocab'], s['d_model'], s['d_ff']
  config.model.num_heads, config.model.dropout_rate, config.model.max_positions = s['heads'], 0.1, max_positions
  config.model.dtype = dtype
  config.model.num_encoder_layers = config.model.num_decoder_layers = s['layers']
  run = settings.resolve(config)
  model_config = run.model
  mesh = partitioning.create_mesh((1, 1, 1), jax.devices()[:1])
  state, shardings = train_state.create_train_state(model_config, run.optimizer, mesh, jax.random.key(0))
  step = partitioning.jit_train_step(
      functools.partial(steps.train_step, model_config=model_config, label_smoothing=0.1,
                        fused_output_loss=run.training.fused_output_loss), mesh, shardings)
  rng = jax.random.key(1)
  holder = {'state': state}

  def run():
    holder['state'], metrics = step(holder['state'], batch, rng)
    jax.block_until_ready(metrics)

  def memory_analysis():
    """The compiler's own buffer assignment for this step on this device."""
    with partitioning.mesh_context(mesh):
      return step.jitted.lower(holder['state'], batch, rng).compile().memory_analysis()
  run.memory_analysis = memory_analysis
  return run, step


def build_torch(s, batch, threads):
  import numpy as np
  import torch
  torch.set_num_threads(threads)
  torch.manual_seed(0)
  d = s['d_model']

  class Reference(torch.nn.Module):
    def __init__(self):
      super().__init__()
      self.embedding = torch.nn.Embedding(s['vocab'], d)
      self.transformer = torch.nn.Transformer(d, s['heads'], s['layers'], s['layers'], s['d_ff'], dropout=0.1,
                                              batch_first=True)
      position = torch.arange(64)[:, None]
      div = torch.exp(torch.arange(0, d, 2) * (-math.log(10000.0) / d))
      table = torch.zeros(64, d)
      table[:, 0::2], table[:, 1::2] = torch.sin(position * div), torch.cos(position * div)
      self.register_buffer('positions', table)
      self.dropout = torch.nn.Dropout(0.1)

    def embed(self, ids):
      return self.dropout(self.embedding(ids) * math.sqrt(d) + self.positions[:ids.shape[1]])

    def forward(self, src, tgt_in):
      mask = torch.nn.Transformer.generate_square_subsequent_mask(tgt_in.shape[1])
      out = self.transformer(self.embed(src), self.embed(tgt_in), tgt_mask=mask, tgt_is_causal=True)
      return out @ self.embedding.weight.T  # tied pre-softmax projection

  model = Reference().train()
  optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9)
  criterion = torch.nn.CrossEntropyLoss(label_smoothing=0.1)
  src = torch.tensor(np.asarray(batch['inputs']), dtype=torch.long)
  tgt = torch.tensor(np.asarray(batch['targets']), dtype=torch.long)
  tgt_in = torch.cat([torch.zeros_like(tgt[:, :1]), tgt[:, :-1]], 1)

  def run():
    optimizer.zero_grad(set_to_none=True)
    logits = model(src, tgt_in)
    loss = criterion(logits.reshape(-1, s['vocab']), tgt.reshape(-1))
    loss.backward()
    optimizer.step()
  return run


def timed(run, count):
  times = []
  for _ in range(count):
    start = time.perf_counter()
    run()
    times.append(time.perf_counter() - start)
  return times


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument('--shape', choices=sorted(SHAPES), default='tiny')
  parser.add_argument('--steps', type=int, default=10)
  parser.add_argument('--threads', type=int, default=os.cpu_count())
  for name in ('batch', 'length', 'vocab'):
    parser.add_argument(f'--{name}', type=int, help=f"overrides the shape's {name}")
  args = parser.parse_args()
  import jax
  import jax.numpy as jnp
  import numpy as np
  s = dict(SHAPES[args.shape], **{k: getattr(args, k) for k in ('batch', 'length', 'vocab') if getattr(args, k)})
  if s['length'] > 64:
    parser.error(f'--length={s["length"]}: at most 64 (the position tables are built for 64)')
  rng = np.random.default_rng(0)
  batch = {k: rng.integers(3, s['vocab'], (s['batch'], s['length'])).astype(np.int32) for k in ('inputs', 'targets')}
  peak = matmul_peak(jax, jnp)
  ours, jitted = build_ours(s, batch)
  ours()  # compile
  ours()
  our_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
  reference = build_torch(s, batch, args.threads)
  reference()
  torch_peak = torch_matmul_peak(args.threads)
  our_times, ref_times = [], []
  for _ in range(args.steps):  # alternate so both see the same machine noise
    our_times += timed(ours, 1)
    ref_times += timed(reference, 1)
  tokens = s['batch'] * s['length']
  flops = model_flops(s)
  ours_s, ref_s = statistics.median(our_times), statistics.median(ref_times)
  compilations = jitted.jitted._cache_size()
  rows = [('ours (JAX/Flax, jit)', ours_s, f'{our_rss:,.0f}', compilations),
          ('PyTorch nn.Transformer (eager)', ref_s, '', '')]
  print(f'shape {args.shape}: {s}; matmul peak {peak:.0f} GFLOP/s (2048³ float32 jit; the same product in PyTorch: '
        f'{torch_peak:.0f}); median of {args.steps} alternating steps\n')
  print('| implementation | step ms | target tokens/s | GFLOP/s | fraction of matmul peak | peak RSS MB | compilations |')
  print('|---|---|---|---|---|---|---|')
  for name, seconds, rss, compiled in rows:
    gflops = flops / seconds / 1e9
    print(f'| {name} | {seconds * 1e3:.1f} | {tokens / seconds:,.0f} | {gflops:.0f} | {gflops / peak:.2f} | {rss} | '
          f'{compiled} |')
  print(f'| ratio ours / reference | | {ref_s / ours_s:.2f}× | | | | |')
  print(json.dumps({'shape': args.shape, 'batch': s['batch'], 'length': s['length'], 'vocab': s['vocab'],
                    'tokens_per_second': round(tokens / ours_s, 1),
                    'reference_tokens_per_second': round(tokens / ref_s, 1),
                    'peak_fraction': round(flops / ours_s / 1e9 / peak, 3), 'peak_rss_mb': round(our_rss),
                    'compilations': compilations, 'matmul_gflops': round(peak, 1),
                    'reference_matmul_gflops': round(torch_peak, 1)}))


if __name__ == '__main__':
  main()
