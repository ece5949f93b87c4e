"""Decoding speed: our KV-cache beam search and greedy search vs a decoder that re-runs the whole prefix, and
vs the same weights exported to CTranslate2 (float32 and int8; skipped when ctranslate2 is not installed).

python bench/decode.py   (tiny shape: vocab 8192, d_model 256, 3+3 layers, 4 heads, d_ff 1024, random weights,
64 sources of 20 tokens, exactly 40 generated tokens per sentence, EOS disabled)
Every decoder but the prefix-recomputing baseline runs in turn, 5 rounds, medians. Prints a markdown table (with
each decoder's model GFLOP/s as a fraction of the same run's 2048³ matmul, and the sentences/s it would reach at
that peak); the last line is one JSON object.

python bench/decode.py --against=REV [--rounds=7]
The beam-4 search of this tree against the package at git revision REV (imported beside it, in this process),
and REV's search with its cache never reordered (timing only: wrong translations), on the same weights and
sources, alternating round by round; medians and per-round ratios.

python bench/decode.py --workdir=RUN --sentences=FILE [--references=FILE] [--rounds=3] [--slots=64,128]
                       [--devices=1,8]
Real sentences: a trained model translating FILE (one sentence a line; ends at EOS) with our beam 4 (with each
stopping rule) and greedy search through the Translator's decoding engine (at each slot count, and with its
slots spread over each device count), and with the same weights exported to CTranslate2 float32, alternating;
BLEU against the references; the slots' busy share; the programs' compile time and peak memory.

python bench/decode.py --workdir=RUN --per_step [--rounds=5]
The same trained model's beam 4 step against CTranslate2's at 4 to 2,048 hypotheses (1 to 512 sentences of 14
random source tokens, exactly 40 generated tokens, EOS disabled), alternating: milliseconds a step, medians.
"""

import argparse
import functools
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEVICES = max([int(count) for arg in sys.argv if arg.startswith('--devices=') for count in arg[10:].split(',')] or [1])
if DEVICES > 1 and 'host_platform_device_count' not in os.environ.get('XLA_FLAGS', ''):  # before JAX starts
  os.environ['XLA_FLAGS'] = f'{os.environ.get("XLA_FLAGS", "")} --xla_force_host_platform_device_count={DEVICES}'

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.synthetic import cpu_model  # noqa: E402
from bench.train_step import matmul_peak  # noqa: E402
from configs import base  # noqa: E402
from flax_transformer import search, settings  # noqa: E402
from flax_transformer.constants import EOS_ID  # noqa: E402
from flax_transformer.model import Transformer, TransformerConfig  # noqa: E402

BATCH, SOURCE_LENGTH, OUTPUT_LENGTH = 64, 20, 40
CONFIG = TransformerConfig(vocab_size=8192, d_model=256, num_heads=4, d_ff=1024, num_encoder_layers=3,
                           num_decoder_layers=3, dropout_rate=0.1, max_positions=128)
TOP_K = settings.resolve(base.get_config()).decode.beam_top_k  # the beam's top-k as a run here would choose it


def no_eos(tokens_to_logits):
  def wrapped(*args):  # (ids, steps, cache), or an older revision's (ids, cache)
    logits, cache = tokens_to_logits(*args)
    return logits.at[:, EOS_ID].set(-1e9), cache
  return wrapped


def cached(params, inputs, model, beam_size, output_length=OUTPUT_LENGTH, cache_length=None):
  """Our decoder: KV cache, encoder keys/values once per sentence; exactly `output_length` tokens, from a cache
  of `cache_length` positions (default: output_length), as translation sizes it for input + 50."""
  cache_length = cache_length or output_length
  memory = model.apply({'params': params}, inputs, method=model.memory)
  cache = model.apply({'params': params}, memory, beam_size, cache_length, method=model.init_cache)
  step = lambda ids, steps, c: model.apply({'params': params}, ids, c, steps, method=model.decode_step)
  lengths = jnp.full((inputs.shape[0],), output_length)
  if beam_size == 1:
    return search.greedy_search(no_eos(step), cache, inputs.shape[0], lengths, cache_length, beam_top_k=TOP_K)[0]
  return search.beam_search(no_eos(step), cache, inputs.shape[0], lengths, cache_length, beam_size,
                            reorder_cache=type(model).reorder_cache, beam_top_k=TOP_K)[0]


def uncached(params, inputs, model, beam_size):
  """Baseline: every step re-runs the decoder over the whole (fixed-size) prefix; no cache."""
  encoded = model.apply({'params': params}, inputs, method=model.encode)
  encoded_n = jnp.repeat(encoded, beam_size, axis=0)
  inputs_n = jnp.repeat(inputs, beam_size, axis=0)

  def step(ids, steps, c):  # every sentence at the same step: the first one's
    prefix = jax.lax.dynamic_update_slice(c['prefix'], ids, (0, steps[0]))  # [bn, L]: previous tokens so far
    logits = model.apply({'params': params}, encoded_n, inputs_n, jnp.roll(prefix, -1, axis=1),
                         method=model.decode)  # targets shifted back so decoder input == prefix
    return jnp.take(logits, steps[0], axis=1), {'prefix': prefix}

  cache = {'prefix': jnp.zeros((inputs.shape[0] * beam_size, OUTPUT_LENGTH), jnp.int32)}
  lengths = jnp.full((inputs.shape[0],), OUTPUT_LENGTH)
  return search.beam_search(no_eos(step), cache, inputs.shape[0], lengths, OUTPUT_LENGTH, beam_size,
                            beam_top_k=TOP_K)[0]


def decode_flops(beam_size: int, c: TransformerConfig = CONFIG) -> float:
  """Model FLOPs of one cached decoding of BATCH sources: the products a KV-cache decoder cannot avoid.

  Encoder once per sentence, the cross-attention keys/values once per sentence, then per hypothesis and step:
  self-attention q/k/v/o and cross-attention q/o projections, the feed-forward, attention over the prefix
  and the source, and the output projection over the whole vocabulary.
  """
  d, f, v, s = c.d_model, c.d_ff, c.vocab_size, SOURCE_LENGTH
  encoder = BATCH * (s * c.num_encoder_layers * (4 * d * d + 2 * d * f) + c.num_encoder_layers * 2 * s * s * d)
  cross_keys_values = BATCH * s * c.num_decoder_layers * 2 * d * d
  per_step = [c.num_decoder_layers * (6 * d * d + 2 * d * f + 2 * d * (i + 1 + s)) + v * d
              for i in range(OUTPUT_LENGTH)]
  return 2.0 * (encoder + cross_keys_values + BATCH * beam_size * sum(per_step))


def exported(params, model_config, pieces, directory: str, quantization: str = 'float32'):
  """A CTranslate2 translator of these weights (flax_transformer.export) saved under `directory`, one intra-op
  thread per core."""
  import ctranslate2
  from flax_transformer import export
  spec = export.model_spec(jax.device_get(params), model_config, pieces)
  spec.validate()
  spec.optimize(quantization=None if quantization == 'float32' else quantization)
  os.makedirs(directory, exist_ok=True)
  spec.save(directory)
  return ctranslate2.Translator(directory, device='cpu', inter_threads=1, intra_threads=os.cpu_count())


def ctranslate2_runs(params, inputs, directory):
  """CTranslate2 translators of the same weights (flax_transformer.export), timed on the same sources with
  exactly OUTPUT_LENGTH tokens (EOS is allowed only at the limit), one thread per core: name -> function."""
  try:
    import ctranslate2
  except ImportError:
    return {}
  pieces = ['<pad>', '</s>', '<unk>'] + [f'w{i}' for i in range(3, CONFIG.vocab_size)]
  sources = [[pieces[i] for i in row] for row in np.asarray(inputs)]
  runs = {}
  for quantization in ('float32', 'int8'):
    translator = exported(params, CONFIG, pieces, os.path.join(directory, quantization), quantization)
    for beam in (4, 1):
      runs[f'{"beam 4" if beam == 4 else "greedy"}, CTranslate2 {ctranslate2.__version__} {quantization}'] = (
          functools.partial(translator.translate_batch, sources, beam_size=beam, max_batch_size=BATCH,
                            min_decoding_length=OUTPUT_LENGTH, max_decoding_length=OUTPUT_LENGTH), beam)
  return runs


def time_it(fn, *args, repeats=5):
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def package_at(revision: str):
  """The flax_transformer package as it was at git `revision`, importable beside this tree's as
  `baseline_flax_transformer` (its own imports renamed); returns that package's (model, search) modules."""
  directory = tempfile.mkdtemp(prefix='decode_baseline_')
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  archive = subprocess.run(['git', 'archive', revision, 'flax_transformer'], cwd=root, check=True,
                           capture_output=True).stdout
  subprocess.run(['tar', '-x', '-C', directory], input=archive, check=True)
  package = os.path.join(directory, 'baseline_flax_transformer')
  os.rename(os.path.join(directory, 'flax_transformer'), package)
  for folder, _, names in os.walk(package):
    for name in (n for n in names if n.endswith('.py')):
      path = os.path.join(folder, name)
      with open(path) as f:
        text = re.sub(r'\bflax_transformer\b', 'baseline_flax_transformer', f.read())
      with open(path, 'w') as f:
        f.write(text)
  sys.path.insert(0, directory)
  import importlib
  return importlib.import_module('baseline_flax_transformer.model'), importlib.import_module('baseline_flax_transformer.search')


def alternating(runs: dict, args: tuple, rounds: int) -> dict[str, list[float]]:
  """Each run once per round, in turn, for `rounds` rounds (after one warm-up call each): name -> seconds."""
  for fn in runs.values():
    jax.block_until_ready(fn(*args))
  seconds = {name: [] for name in runs}
  for _ in range(rounds):
    for name, fn in runs.items():
      start = time.perf_counter()
      jax.block_until_ready(fn(*args))
      seconds[name].append(time.perf_counter() - start)
  return seconds


def against(revision: str, rounds: int):
  """This tree's beam 4 vs REV's, and REV's without reordering its cache, alternating."""
  import dataclasses
  old_model, old_search = package_at(revision)
  old = old_model.Transformer(old_model.TransformerConfig(**dataclasses.asdict(CONFIG)))
  model = Transformer(CONFIG)
  rng = np.random.default_rng(0)
  inputs = jnp.asarray(rng.integers(3, CONFIG.vocab_size, (BATCH, SOURCE_LENGTH)), jnp.int32)
  params = nn.meta.unbox(model.init(jax.random.key(0), inputs[:1], inputs[:1])['params'])

  def old_cached(params, inputs, reorder):  # REV's decoding API, before the slot engine
    encoded = old.apply({'params': params}, inputs, method=old.encode)
    cache = old.apply({'params': params}, encoded, 4, OUTPUT_LENGTH, method=old.init_cache)
    step = lambda ids, c: old.apply({'params': params}, ids, inputs, c, method=old.decode_step)
    return old_search.beam_search(no_eos(step), cache, BATCH, jnp.full((BATCH,), OUTPUT_LENGTH), OUTPUT_LENGTH, 4,
                                  reorder_cache=reorder, beam_top_k=TOP_K)[0]
  runs = {'this tree': jax.jit(functools.partial(cached, model=model, beam_size=4)),
          f'{revision}': jax.jit(functools.partial(old_cached, reorder=type(old).reorder_cache)),
          f'{revision}, cache never reordered (the copy\'s ceiling; wrong output)':
              jax.jit(functools.partial(old_cached, reorder=lambda c, rows: c))}
  same = np.mean(np.all(np.asarray(runs['this tree'](params, inputs)) == np.asarray(runs[revision](params, inputs)), 1))
  seconds = alternating(runs, (params, inputs), rounds)
  base = seconds['this tree']
  print(f'beam 4, {BATCH} sentences x {OUTPUT_LENGTH} tokens, {rounds} alternating rounds; the same translations as '
        f'{revision} for {same:.0%} of the sentences\n')
  print('| search | sentences/s (median) | this tree / it, per round (min-median-max) |\n|---|---|---|')
  for name, times in seconds.items():
    ratios = sorted(t / b for t, b in zip(times, base))
    print(f'| {name} | {BATCH / statistics.median(times):,.1f} | {ratios[0]:.2f}-{statistics.median(ratios):.2f}-'
          f'{ratios[-1]:.2f}x |')
  print(json.dumps({name: round(BATCH / statistics.median(times), 1) for name, times in seconds.items()}))


def real_sentences(workdir: str, sentences_path: str, references_path: str | None, rounds: int,
                   slots: tuple[int, ...] | None = None, device_counts: tuple[int, ...] = (1,)):
  """A trained model on real sentences (EOS ends each), beam 4 and greedy: ours through the Translator vs
  CTranslate2 float32 on the exported model, alternating; BLEU against `references_path`; the decoding
  program's peak memory (XLA's buffer assignment, largest batch)."""
  from flax_transformer import engine, parallel_text, scoring, search
  from flax_transformer.sentence_batches import encode_sentences
  from flax_transformer.translator import Translator
  sentences = parallel_text.read_lines(sentences_path)
  references = parallel_text.read_lines(references_path) if references_path else None
  slots = slots or (Translator.from_workdir(workdir).decoding.decode_slots,)
  translator = Translator.from_workdir(workdir, beam_size=4, decode_slots=slots[0])
  beam_ended = Translator.from_workdir(workdir, beam_size=4, beam_stop='beam_ended', decode_slots=slots[0])
  runs, translators = {}, {}
  for count, devices in [(count, 1) for count in slots] + [(slots[0], d) for d in device_counts if d > 1]:
    named = ('' if len(slots) == 1 else f', {count} slots') + ('' if devices == 1 else f', {devices} devices')
    models = {'beam 4': Translator.from_workdir(workdir, beam_size=4, decode_slots=count, devices=devices),
              "beam 4, beam_stop='beam_ended'": Translator.from_workdir(workdir, beam_size=4, beam_stop='beam_ended',
                                                                         decode_slots=count, devices=devices),
              'greedy': Translator.from_workdir(workdir, beam_size=1, decode_slots=count, devices=devices)}
    for name, model in models.items():
      key = name.replace('beam 4', f'beam 4, ours{named}', 1) if name != 'greedy' else f'greedy, ours{named}'
      runs[key], translators[key] = functools.partial(model.translate, sentences), model
  try:
    import ctranslate2
    processor = translator.processor
    pieces = [processor.id_to_piece(i) for i in range(processor.get_piece_size())]
    ct2 = exported(translator.params, translator.model_config, pieces, tempfile.mkdtemp(prefix='decode_ct2_'))
    tokens = [processor.encode(s, out_type=str) for s in sentences]
    limit = translator.max_extra_length

    def ct2_run(beam):  # batched by tokens, as ours
      return [processor.decode(r.hypotheses[0]) for r in ct2.translate_batch(
          tokens, beam_size=beam, length_penalty=translator.length_penalty_alpha, min_decoding_length=0,
          max_batch_size=translator.eval_tokens_per_batch, batch_type='tokens',
          max_decoding_length=max(map(len, tokens)) + limit)]
    for beam in (4, 1):
      search_name = 'beam 4' if beam > 1 else 'greedy'
      runs[f'{search_name}, CTranslate2 {ctranslate2.__version__} float32'] = functools.partial(ct2_run, beam)
  except ImportError:
    pass
  outputs = {name: fn() for name, fn in runs.items()}  # warm-up: every length shape compiled
  for model in translators.values():
    model.decoding_counts.clear()
  seconds = {name: [] for name in runs}
  for _ in range(rounds):
    for name, fn in runs.items():
      start = time.perf_counter()
      fn()
      seconds[name].append(time.perf_counter() - start)
  print(f'{len(sentences)} sentences of {sentences_path}, {rounds} alternating rounds; ours through '
        f'{translator.decoding.decode_slots} slots, CTranslate2 in batches of {translator.eval_tokens_per_batch} '
        f'source tokens; {cpu_model()}, {len(os.sched_getaffinity(0))} cores\n')
  print('| decoder | sentences/s (median) | output tokens | BLEU |\n|---|---|---|---|')
  for name in runs:
    words = sum(len(translator.processor.encode(t)) for t in outputs[name])
    score = (f'{scoring.bleu(outputs[name], references, translator.settings.decode.bleu_tokenize)[0]:.2f}'
             if references else '-')
    print(f'| {name} | {len(sentences) / statistics.median(seconds[name]):,.1f} | {words:,} | {score} |')
  for name, model in translators.items():
    counts = model.decoding_counts
    print(f'| {name}: sentence-steps of a round / slot-steps | {counts["sentence_steps"] // rounds:,} / '
          f'{counts["slot_steps"] // rounds:,} ({counts["sentence_steps"] / max(counts["slot_steps"], 1):.0%} busy), '
          f'{counts["calls"] // rounds} calls | | |')
  for name in runs:
    theirs = [other for other in runs if 'CTranslate2' in other and other.split(',')[0] == name.split(',')[0]]
    if 'CTranslate2' not in name and theirs:
      ratios = sorted(b / a for a, b in zip(seconds[name], seconds[theirs[0]]))
      agree = np.mean([a == b for a, b in zip(outputs[name], outputs[theirs[0]])])
      print(f'| {name} / CTranslate2, per round (min-median-max) | {ratios[0]:.2f}-{statistics.median(ratios):.2f}-'
            f'{ratios[-1]:.2f}x | same output for {agree:.0%} | |')
  encoded = encode_sentences(translator.processor, sentences)
  for name, model in (('beam 4', translator), ("beam 4, beam_stop='beam_ended'", beam_ended), ('greedy', translator)):
    beam = 1 if name == 'greedy' else 4
    strategy = search.strategy_for(model.decoding.replace(beam_size=beam))
    shape = engine.Engine(model.model, model.params, strategy, slots=model.decoding.decode_slots,
                          max_extra_length=model.max_extra_length, max_positions=model.max_positions).shape(encoded)
    programs = shape.programs
    state = programs.empty(model.params)
    rows = np.zeros((shape.admit_rows,), np.int32)
    widths = sorted({-(-(len(ids) + 1) // engine.SOURCE_ROUNDING) * engine.SOURCE_ROUNDING for ids in encoded if ids})
    jax.clear_caches()  # compiled afresh: the first translation's cost
    start = time.perf_counter()
    programs.empty.lower(model.params).compile()
    for width in widths:  # at most as many as the translation meets
      inputs = np.zeros((shape.slots, width), np.int32)
      programs.encode.lower(model.params, inputs).compile()
      given = search.sentence_inputs(shape.admit_rows, shape.max_output_length)
      programs.admit.lower(model.params, state, programs.encode(model.params, inputs), rows, rows, given).compile()
    compiled = programs.generate.lower(model.params, state, np.int32(1), np.int32(1 << 30)).compile()
    seconds = time.perf_counter() - start
    memory = compiled.memory_analysis()  # generate's: the decoding program
    peak = memory.temp_size_in_bytes + memory.argument_size_in_bytes + memory.output_size_in_bytes
    print(f'\n{name}: {shape.slots} slots, sources padded to {shape.source_length}, outputs up to '
          f'{shape.max_output_length}; its {2 + 2 * len(widths)} programs compiled in {seconds:.1f} s; peak memory of the decoding '
          f'program (XLA buffers): {peak / 2**20:,.0f} MiB')


def per_step(workdir: str, rounds: int):
  """Milliseconds a beam-4 step of the trained model at each batch size, ours against CTranslate2 float32 on
  the exported model, with the same forced length (what the real-sentence table's batches run through as
  their sentences finish)."""
  from flax_transformer import engine
  from flax_transformer.translator import Translator
  translator = Translator.from_workdir(workdir, beam_size=4)
  model, params, source_length = translator.model, translator.params, 14
  cache_length = engine.decode_length(source_length, translator.max_extra_length, translator.max_positions)
  program = jax.jit(functools.partial(cached, model=model, beam_size=4, cache_length=cache_length))
  processor = translator.processor
  pieces = [processor.id_to_piece(i) for i in range(processor.get_piece_size())]
  ct2 = exported(params, translator.model_config, pieces, tempfile.mkdtemp(prefix='decode_ct2_'))
  rng = np.random.default_rng(0)
  print(f'beam 4, {OUTPUT_LENGTH} forced steps from {source_length}-token sources, cache of {cache_length} '
        f'positions; medians of {rounds} alternating rounds\n')
  print('| sentences | hypotheses | ours, ms a step | CTranslate2 float32, ms a step | ours / CTranslate2 time |'
        '\n|---|---|---|---|---|')
  for batch in (8, 16, 32, 64, 128, 256, 512):  # the slot counts the engine runs; CTranslate2's batches pass through them
    inputs = rng.integers(3, translator.model_config.vocab_size, (batch, source_length)).astype(np.int32)
    sources = [[pieces[i] for i in row] for row in inputs]
    runs = {'ours': functools.partial(program, params, inputs),
            'ct2': functools.partial(ct2.translate_batch, sources, beam_size=4, max_batch_size=batch,
                                     min_decoding_length=OUTPUT_LENGTH, max_decoding_length=OUTPUT_LENGTH)}
    for fn in runs.values():
      jax.block_until_ready(fn())
    seconds = {name: [] for name in runs}
    for _ in range(rounds):
      for name, fn in runs.items():
        start = time.perf_counter()
        jax.block_until_ready(fn())
        seconds[name].append(time.perf_counter() - start)
    ours, theirs = (statistics.median(seconds[name]) / OUTPUT_LENGTH * 1e3 for name in runs)
    print(f'| {batch} | {4 * batch:,} | {ours:.2f} | {theirs:.2f} | {ours / theirs:.2f} |')


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--against', help='a git revision whose beam search to time beside this tree\'s')
  parser.add_argument('--workdir', help='a trained run to translate --sentences with')
  parser.add_argument('--sentences', help='source sentences, one a line (plain or .gz)')
  parser.add_argument('--references', help='their reference translations, for BLEU beside the speed')
  parser.add_argument('--per_step', action='store_true', help='with --workdir: a beam step at each batch size')
  parser.add_argument('--rounds', type=int, default=7)
  parser.add_argument('--devices', default='1', help='with --sentences: ours also spread over these device counts '
                      '(comma-separated; on a CPU, XLA makes that many devices of its cores: the same work split, '
                      'so the ratio shows what sharding costs)')
  parser.add_argument('--slots', default='', help='with --sentences: our decoder at each of these slot counts '
                      '(comma-separated; default: the run\'s decode_slots)')
  args = parser.parse_args()
  if args.workdir and args.per_step:
    return per_step(args.workdir, args.rounds)
  if args.against:
    return against(args.against, args.rounds)
  if args.workdir:
    slots = tuple(int(count) for count in args.slots.split(',')) if args.slots else None
    devices = tuple(int(count) for count in args.devices.split(','))
    return real_sentences(args.workdir, args.sentences, args.references, args.rounds, slots, devices)
  model = Transformer(CONFIG)
  rng = np.random.default_rng(0)
  inputs = jnp.asarray(rng.integers(3, CONFIG.vocab_size, (BATCH, SOURCE_LENGTH)), jnp.int32)
  params = nn.meta.unbox(model.init(jax.random.key(0), inputs[:1], inputs[:1])['params'])
  runs = {
      'beam 4, KV cache (ours)': jax.jit(functools.partial(cached, model=model, beam_size=4)),
      'greedy, KV cache (ours)': jax.jit(functools.partial(cached, model=model, beam_size=1)),
      'beam 4, KV cache of 80 positions (ours)': jax.jit(functools.partial(cached, model=model, beam_size=4,
                                                                        cache_length=2 * OUTPUT_LENGTH)),
      'greedy, KV cache of 80 positions (ours)': jax.jit(functools.partial(cached, model=model, beam_size=1,
                                                                        cache_length=2 * OUTPUT_LENGTH)),
      'beam 4, no cache (re-run prefix)': jax.jit(functools.partial(uncached, model=model, beam_size=4)),
  }
  tokens = np.asarray(runs['beam 4, KV cache (ours)'](params, inputs))
  assert (tokens > 0).sum(1).min() == OUTPUT_LENGTH, 'every sentence must produce exactly 40 tokens'
  same = np.mean(np.all(tokens == np.asarray(runs['beam 4, no cache (re-run prefix)'](params, inputs)), axis=1))
  beams = {name: 1 if 'greedy' in name else 4 for name in runs}
  timed = {name: functools.partial(fn, params, inputs) for name, fn in runs.items() if 'no cache' not in name}
  with tempfile.TemporaryDirectory() as directory:
    for name, (fn, beam) in ctranslate2_runs(params, inputs, directory).items():
      timed[name], beams[name] = fn, beam
    rounds = alternating(timed, (), 5)  # in turn, so that no entry alone meets a slow phase of the machine
  seconds = {name: time_it(fn, params, inputs, repeats=3) if 'no cache' in name else statistics.median(rounds[name])
             for name, fn in runs.items()}
  seconds.update((name, statistics.median(times)) for name, times in rounds.items() if name not in runs)
  peak = matmul_peak(jax, jnp)
  print(f'matmul peak {peak:.0f} GFLOP/s (2048³ float32 jit, this run); model FLOPs per {BATCH} sentences: '
        f'{decode_flops(4) / 1e9:.1f} G at beam 4, {decode_flops(1) / 1e9:.1f} G greedy\n')
  print('| decoder | sentences/s | µs per generated token | model GFLOP/s | fraction of matmul peak | '
        'sentences/s at the peak |\n|---|---|---|---|---|---|')
  for name, s in seconds.items():
    gflops = decode_flops(beams[name]) / s / 1e9
    print(f'| {name} | {BATCH / s:,.1f} | {s / (BATCH * OUTPUT_LENGTH) * 1e6:,.1f} | {gflops:.0f} | '
          f'{gflops / peak:.2f} | {BATCH * peak * 1e9 / decode_flops(beams[name]):,.0f} |')
  beam, greedy, beam80, greedy80, nocache = (BATCH / seconds[k] for k in runs)
  print(f'| cache speed-up at beam 4 | {beam / nocache:.1f}× | | | | |')
  for name in seconds:
    if 'CTranslate2' in name and 'float32' in name:
      ours, ours80 = (beam, beam80) if name.startswith('beam') else (greedy, greedy80)
      print(f'| ours / {name} (40; 80 cache positions) | {ours / (BATCH / seconds[name]):.2f}×; '
            f'{ours80 / (BATCH / seconds[name]):.2f}× | | | | |')
  print(f'\nbeam 4 with and without the cache give the same output for {same:.0%} of the sentences')
  print(json.dumps({'beam4_sentences_per_second': round(beam, 1), 'greedy_sentences_per_second': round(greedy, 1),
                    'beam4_cache80_sentences_per_second': round(beam80, 1),
                    'greedy_cache80_sentences_per_second': round(greedy80, 1),
                    'nocache_beam4_sentences_per_second': round(nocache, 1), 'matmul_gflops': round(peak, 1)}))


if __name__ == '__main__':
  main()
