"""Mutation check: each one-line departure from the paper must make at least one test fail.

python tools/mutation_check.py [--only=SUBSTRING] [--list] [--workers=2]

Copies the tracked files to a temporary directory, applies one mutation at a time (an exact, unique
one-line replacement), runs the tests that guard it, and prints caught / total and every survivor.
Exit status 1 if any mutation survives. Run before every change to model, layers, losses, optim, decode
or average.
"""

import argparse
import concurrent.futures
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL_TESTS = 'tests/test_model.py tests/test_layers.py'
DECODE_TESTS = 'tests/test_search.py'

# (what departs from the paper, file, original fragment (unique in the file), mutated fragment, tests that catch it)
MUTATIONS = [
    ('Adam beta1 0.9 -> 0.8', 'configs/base.py', 'config.adam_b1 = 0.9', 'config.adam_b1 = 0.8', 'tests/test_optim.py'),
    ('Adam beta2 0.98 -> 0.999', 'configs/base.py', 'config.adam_b2 = 0.98', 'config.adam_b2 = 0.999',
     'tests/test_optim.py'),
    ('Adam epsilon 1e-9 -> 1e-8', 'configs/base.py', 'config.adam_eps = 1e-9', 'config.adam_eps = 1e-8',
     'tests/test_optim.py'),
    ('warmup 4000 -> 8000', 'configs/base.py', 'config.warmup_steps = 4000', 'config.warmup_steps = 8000',
     'tests/test_optim.py'),
    ('schedule exponent -1.5 -> -1.0', 'flax_transformer/optim.py', 'step_num * warmup_steps**-1.5',
     'step_num * warmup_steps**-1.0', 'tests/test_optim.py'),
    ('label smoothing 0.1 -> 0.2', 'configs/base.py', 'config.label_smoothing = 0.1', 'config.label_smoothing = 0.2',
     'tests/test_losses.py tests/test_optim.py'),
    ('embedding scale sqrt(d_model) removed', 'flax_transformer/layers.py', 'return embedded * jnp.sqrt(self.d_model)',
     'return embedded', MODEL_TESTS),
    ('attention scale 1/sqrt(d_k) removed (library path)', 'flax_transformer/attention.py',
     'is_causal=causal, key_value_seq_lengths=lengths,', 'is_causal=causal, key_value_seq_lengths=lengths, scale=1.0,',
     MODEL_TESTS),
    ('attention scale 1/sqrt(d_k) removed (written-out core, decoding caches included)', 'flax_transformer/attention.py',
     'scale = 1.0 / np.sqrt(query.shape[-1])', 'scale = 1.0', MODEL_TESTS + ' ' + DECODE_TESTS),
    ('online softmax keeps the earlier chunks unrescaled (decoding cache)', 'flax_transformer/attention.py',
     'context = context * rescale[..., None] + attention_context(', 'context = context + attention_context(',
     'tests/test_layers.py ' + DECODE_TESTS),
    ('sinusoid base 10000 -> 1000', 'flax_transformer/layers.py', 'np.power(10000.0,', 'np.power(1000.0,',
     MODEL_TESTS),
    ('sin and cos swapped', 'flax_transformer/layers.py', 'table[:, 0::2] = np.sin(position / div_term)',
     'table[:, 0::2] = np.cos(position / div_term)', MODEL_TESTS),
    ('Post-LN turned to Pre-LN on the default path', 'flax_transformer/model.py',
     'return self.norm(x + self.dropout(sublayer(x), deterministic=deterministic))',
     'return x + self.dropout(sublayer(self.norm(x)), deterministic=deterministic)', MODEL_TESTS),
    ('dropout removed from the embedding sum', 'flax_transformer/model.py',
     'x = self.embedding_dropout(x, deterministic=deterministic)', 'x = x', MODEL_TESTS),
    ('dropout removed from sub-layer outputs', 'flax_transformer/model.py',
     'return self.norm(x + self.dropout(sublayer(x), deterministic=deterministic))',
     'return self.norm(x + sublayer(x))', MODEL_TESTS),
    ('attention dropout on by default', 'configs/base.py', 'config.model.attention_dropout_rate = 0.0',
     'config.model.attention_dropout_rate = 0.1', MODEL_TESTS),
    ('decoder self-attention not causal', 'flax_transformer/model.py',
     'self.self_attention(z, None, causal=True,', 'self.self_attention(z, None, causal=False,', MODEL_TESTS),
    ('causal mask off by one (written-out path)', 'flax_transformer/attention.py',
     'allowed = jnp.tril(jnp.ones((query_length, key_length), dtype=bool))',
     'allowed = jnp.tril(jnp.ones((query_length, key_length), dtype=bool), 1)', MODEL_TESTS),
    ('no padding mask in cross-attention', 'flax_transformer/model.py',
     'return self.decoder(y, encoded, attention.key_lengths(inputs), deterministic)',
     'return self.decoder(y, encoded, None, deterministic)', MODEL_TESTS),
    ('target shift off by one', 'flax_transformer/model.py',
     'jnp.pad(targets, ((0, 0), (1, 0)), constant_values=PAD_ID)[:, :-1]',
     'jnp.pad(targets, ((0, 0), (0, 0)), constant_values=PAD_ID)', MODEL_TESTS),
    ('loss normalised by all tokens', 'flax_transformer/losses.py',
     "'correct': jnp.sum(correct * weights), 'tokens': jnp.sum(weights)}",
     "'correct': jnp.sum(correct * weights), 'tokens': jnp.asarray(weights.size, jnp.float32)}",
     'tests/test_losses.py tests/test_steps.py'),
    ('length penalty alpha 0.6 -> 1.0', 'configs/base.py', 'config.length_penalty_alpha = 0.6',
     'config.length_penalty_alpha = 1.0', DECODE_TESTS + ' tests/test_commands_translate.py'),
    ('length penalty (5 + len) / 6 -> len', 'flax_transformer/search.py',
     'return ((5.0 + jnp.asarray(length, jnp.float32)) / 6.0) ** length_penalty_alpha',
     'return jnp.asarray(length, jnp.float32) ** length_penalty_alpha', DECODE_TESTS),
    ('maximum output input + 50 -> + 40', 'configs/base.py', 'config.max_extra_length = 50',
     'config.max_extra_length = 40', DECODE_TESTS + ' tests/test_commands_translate.py'),
    ('beam search stops early on any finished sentence', 'flax_transformer/search.py',
     "lambda s: ~jnp.all(strategy.done(s))",
     "lambda s: ~jnp.any(strategy.done(s))",
     DECODE_TESTS),
    ("beam_stop='beam_ended' counts every ending extension, not only the step's n best", 'flax_transformer/search.py',
     '    counted &= (jnp.arange(2 * n) < n) & (top_scores > IMPOSSIBLE_SCORE / 2)',
     '    counted &= top_scores > IMPOSSIBLE_SCORE / 2', DECODE_TESTS),
    ('a done sentence goes on collecting ended hypotheses while the other slots run', 'flax_transformer/search.py',
     '    counted = ends & ~done[:, None]  # [S, 2n]', '    counted = ends  # [S, 2n]', DECODE_TESTS),
    ('constrained beam search keeps the best-scoring hypotheses, not the banks in turn', 'flax_transformer/search.py',
     'turn = jnp.where(valid, _ranks(scores, progress, valid) * (total + 1) + (total - progress), NOT_MET)',
     'turn = jnp.where(valid, _ranks(scores, progress * 0, valid), NOT_MET)', DECODE_TESTS),
    ('constrained beam search ranks an output cut short of its phrases with those that hold them',
     'flax_transformer/search.py', 'jnp.where(ended_met, ended_scores, ended_scores + UNMET)', 'ended_scores',
     DECODE_TESTS),
    ('checkpoint averaging over k + 1', 'flax_transformer/weights.py', '    if len(trees) == count:',
     '    if len(trees) == count + 1:', 'tests/test_weights.py'),
    ('every reordered hypothesis handed its sentence\'s first beam', 'flax_transformer/search.py',
     'parent_rows = (live_beam + jnp.arange(slots)[:, None] * n)', 'parent_rows = (live_beam * 0 + jnp.arange(slots)[:, None] * n)',
     DECODE_TESTS),
    ('three-way embedding tie broken (output projection)', 'flax_transformer/model.py',
     'return self.target_embedding.embedding', 'return jax.lax.stop_gradient(self.target_embedding.embedding) * 0.5',
     MODEL_TESTS + ' tests/test_steps.py'),
]
# A config value is guarded by the table of the paper's values as well.
MUTATIONS = [(n, p, o, m, f'tests/test_configs.py {t}' if p.startswith('configs/') else t)
             for n, p, o, m, t in MUTATIONS]


def tracked_files() -> list[str]:
  return subprocess.run(['git', 'ls-files'], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()


def run_mutation(copy: str, mutation) -> tuple[bool, float]:
  """Applies `mutation` in `copy`, runs its tests, restores the file; (caught, seconds)."""
  _, path, original, mutated, tests = mutation
  full = os.path.join(copy, path)
  with open(full) as f:
    text = f.read()
  if text.count(original) != 1:
    raise SystemExit(f'error: {path} holds {text.count(original)} copies of {original!r}; update MUTATIONS')
  with open(full, 'w') as f:
    f.write(text.replace(original, mutated))
  env = dict(os.environ, XLA_FLAGS='--xla_force_host_platform_device_count=8', PYTHONPATH=copy)
  start = time.perf_counter()
  try:
    result = subprocess.run([sys.executable, '-m', 'pytest', '-x', '-q', '-p', 'no:cacheprovider', *tests.split()],
                            cwd=copy, env=env, capture_output=True, text=True, timeout=1800)
  finally:
    with open(full, 'w') as f:
      f.write(text)
  return result.returncode != 0, time.perf_counter() - start


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--only', default='', help='Run the mutations whose name contains this.')
  parser.add_argument('--list', action='store_true', help='List the mutations and exit.')
  parser.add_argument('--workers', type=int, default=2,
                      help='Mutations tested at once, each in its own copy (compilation runs on one core).')
  args = parser.parse_args()
  chosen = [m for m in MUTATIONS if args.only in m[0]]
  if args.list:
    print('\n'.join(f'{m[0]}  [{m[1]}]' for m in chosen))
    return 0
  for name, path, original, _, _ in chosen:  # every line still where it was, before minutes of tests
    with open(os.path.join(ROOT, path)) as f:
      if f.read().count(original) != 1:
        raise SystemExit(f'error: {path} no longer holds {original!r} once (mutation {name!r}); update MUTATIONS')
  with tempfile.TemporaryDirectory() as root:
    copies = queue.Queue()  # one copy of the repository per worker: a worker mutates only its own
    for worker in range(args.workers):
      copy = os.path.join(root, str(worker))
      for name in tracked_files():
        os.makedirs(os.path.dirname(os.path.join(copy, name)), exist_ok=True)
        shutil.copy2(os.path.join(ROOT, name), os.path.join(copy, name))
      copies.put(copy)

    def run(mutation):
      copy = copies.get()
      try:
        return run_mutation(copy, mutation)
      finally:
        copies.put(copy)

    survivors = []
    print('| mutation | caught | seconds |\n|---|---|---|', flush=True)
    with concurrent.futures.ThreadPoolExecutor(args.workers) as pool:
      for mutation, (caught, seconds) in zip(chosen, pool.map(run, chosen)):
        print(f'| {mutation[0]} | {"yes" if caught else "**no**"} | {seconds:.0f} |', flush=True)
        if not caught:
          survivors.append(mutation[0])
  print(f'caught {len(chosen) - len(survivors)} / {len(chosen)}; survivors: {", ".join(survivors) or "none"}')
  return 1 if survivors else 0


if __name__ == '__main__':
  sys.exit(main())
