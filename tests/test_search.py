"""Cached decoding equals full recomputation; beam search against brute force."""

import dataclasses
import itertools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax_transformer import attention, engine, search
from flax_transformer.decoding_settings import DecodeSettings
from flax_transformer.model import Transformer
from tests.conftest import random_batch


def test_cached_decoding_equals_full_forward(small_model_config, np_rng):
  batch = random_batch(np_rng, 3, 7, 6, small_model_config.vocab_size)
  model = Transformer(small_model_config)
  params = nn.meta.unbox(jax.jit(model.init)(jax.random.key(0), batch['inputs'], batch['targets'])['params'])
  full = jax.jit(model.apply)({'params': params}, batch['inputs'], batch['targets'])  # [b, t, v]
  memory = model.apply({'params': params}, batch['inputs'], method=model.memory)
  cache = model.apply({'params': params}, memory, 1, 6, method=model.init_cache)
  previous = np.pad(batch['targets'], ((0, 0), (1, 0)))[:, :-1]
  step = jax.jit(lambda ids, cache, t: model.apply({'params': params}, ids, cache, jnp.full((3,), t),
                                                   method=model.decode_step))
  for t in range(6):
    logits, cache = step(previous[:, t:t + 1], cache, t)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(full[:, t]), atol=1e-5, rtol=1e-5)


@pytest.mark.slow  # 8 s or more of compilation and steps on 2 cores (the marker)
def test_decoding_sows_each_layers_attention_like_the_full_forward(small_model_config, np_rng):
  """Incremental decoding runs inside the module tree: every decoder layer's attention weights reach
  `intermediates`, and at step t they equal row t of the teacher-forced pass's weights."""
  batch = random_batch(np_rng, 2, 5, 4, small_model_config.vocab_size)
  model = Transformer(small_model_config)
  params = nn.meta.unbox(jax.jit(model.init)(jax.random.key(0), batch['inputs'], batch['targets'])['params'])
  _, full = model.apply({'params': params}, batch['inputs'], batch['targets'], mutable=['intermediates'])
  full = full['intermediates']['decoder']  # leaves ([N, b, h, t, k],): one scanned stack
  memory = model.apply({'params': params}, batch['inputs'], method=model.memory)
  cache = model.apply({'params': params}, memory, 1, 4, method=model.init_cache)
  previous = np.pad(batch['targets'], ((0, 0), (1, 0)))[:, :-1]
  layers = small_model_config.num_decoder_layers
  for t in range(4):
    (_, cache), sown = model.apply({'params': params}, previous[:, t:t + 1], cache, jnp.full((2,), t),
                                   method=model.decode_step, mutable=['intermediates'])
    for kind, keys in (('self_attention', slice(0, 4)), ('cross_attention', slice(None))):
      per_layer = sown['intermediates']['decoder'][kind]['attention_weights']  # N x [b, h, 1, k]
      assert len(per_layer) == layers
      for i, weights in enumerate(per_layer):
        expected = full[kind]['attention_weights'][0][i][:, :, t]  # [b, h, k]
        np.testing.assert_allclose(np.asarray(weights[:, :, 0, keys]), np.asarray(expected), atol=1e-5)


def _table_model(table):
  """tokens_to_logits from a fixed table: logits depend on (previous token, step)."""
  table = jnp.asarray(table)  # [steps, vocab(prev), vocab(next)]

  def tokens_to_logits(ids, steps, cache):
    return table[jnp.repeat(steps, ids.shape[0] // steps.shape[0]), ids[:, 0]], cache
  return tokens_to_logits


def _brute_force(table, max_length, alpha):
  """Best length-penalised score over every sequence that ends with EOS or at the length limit."""
  log_probs = np.asarray(jax.nn.log_softmax(jnp.asarray(table)))  # the model's distribution; pad never chosen
  vocab = table.shape[-1]
  best, best_seq = -np.inf, None
  for length in range(1, max_length + 1):
    for seq in itertools.product(range(2, vocab), repeat=length - 1):
      for last in range(1, vocab):
        if length < max_length and last != 1:
          continue  # shorter sequences must end with EOS
        full = list(seq) + [last]
        prev, score = 0, 0.0
        for step, token in enumerate(full):
          score += log_probs[step, prev, token]
          prev = token
        score /= ((5 + length) / 6) ** alpha
        if score > best:
          best, best_seq = score, full
  return best, best_seq


@pytest.mark.parametrize('alpha', [0.0, 0.6, 2.0])
def test_beam_search_finds_the_brute_force_optimum(alpha):
  rng = np.random.default_rng(int(alpha * 10))
  vocab, max_length, batch = 4, 4, 3
  tables = [rng.normal(size=(max_length, vocab, vocab)).astype(np.float32) * 2 for _ in range(batch)]
  for b, table in enumerate(tables):
    beam = 3 ** (max_length - 1) * 2  # wide enough to be exhaustive
    cache = {'rows': jnp.zeros((beam,))}
    tokens, scores = jax.jit(lambda c: search.beam_search(_table_model(table), c, 1, jnp.array([max_length]),
                                                          max_length, beam, alpha))(cache)
    expected_score, expected_seq = _brute_force(table, max_length, alpha)
    np.testing.assert_allclose(float(scores[0]), expected_score, rtol=1e-5)
    got = [int(t) for t in tokens[0] if t]
    assert got == expected_seq



def _beam_ended_reference(log_probs, max_length, beam, alpha):
  """fairseq's and CTranslate2's beam search, per sentence, in plain Python: each step takes the 2n best
  extensions; those among the n best that end (EOS, or the length limit) are finished, the n best that do not
  end go on; the sentence stops once n have finished. log_probs [steps, vocab(prev), vocab(next)]."""
  live, finished = [((), 0.0)], []
  for step in range(max_length):
    extensions = sorted(((seq + (token,), score + log_probs[step, seq[-1] if seq else 0, token])
                         for seq, score in live for token in range(1, log_probs.shape[-1])), key=lambda e: -e[1])
    live = []
    for rank, (seq, score) in enumerate(extensions[:2 * beam]):
      if seq[-1] == 1 or step + 1 == max_length:
        if rank < beam:
          finished.append((score / ((5 + len(seq)) / 6) ** alpha, seq))
      elif len(live) < beam:
        live.append((seq, score))
    if len(finished) >= beam:
      break
  return max(finished)


def _refilled(strategy, tokens_to_logits, limits, slots: int, order) -> tuple[np.ndarray, np.ndarray]:
  """The strategy over `slots` slots, sentences started in `order` as slots free up, one step at a time (the
  engine's host loop, on a table model whose cache names each slot's sentence): (tokens [b, kept, L], scores).
  As in the engine, done slots are read and refilled only once two are done (or all), so a done slot is stepped
  on with the others meanwhile and its results must not change."""
  length = int(max(limits))
  state = {**strategy.initial(slots, length), 'cache': {'sentence': jnp.zeros((slots * strategy.width,), jnp.int32)}}
  step = jax.jit(lambda state: strategy.step(state, tokens_to_logits, search.gather_leading_rows))

  @jax.jit
  def start(state, slot, sentence, limit):
    rows = jnp.arange(strategy.width) + slot * strategy.width
    return strategy.start({**state, 'cache': {'sentence': state['cache']['sentence'].at[rows].set(sentence)}},
                          slot[None], limit[None], search.sentence_inputs(1, length))
  tokens = np.zeros((len(limits), strategy.kept, length), np.int32)
  scores = np.zeros((len(limits), strategy.kept), np.float32)
  queue, occupant = list(order), {}
  while queue or occupant:
    for slot in range(slots):
      if slot not in occupant and queue:
        occupant[slot] = queue.pop(0)
        state = start(state, jnp.int32(slot), jnp.int32(occupant[slot]), jnp.int32(limits[occupant[slot]]))
    state = step(state)
    output, done = strategy.output(state), np.asarray(strategy.done(state))
    finished = [slot for slot in occupant if done[slot]]
    for slot in finished if len(finished) >= min(2, len(occupant)) else ():
      i = occupant.pop(slot)
      tokens[i], scores[i] = np.asarray(output[0][slot]), np.asarray(output[1][slot])
  return tokens, scores


def test_the_beam_ended_rule_is_fairseqs_and_ctranslate2s_in_refilled_slots():
  """beam_stop='beam_ended' against a plain implementation of fairseq's rule, on 64 sentences (each its own
  table) of different length limits decoded through 8 slots in a shuffled order, so that they finish apart and
  sentences start in slots mid-way through others; the default rule returns something else for some of them
  (α = 2 favours the longer outputs it goes on to find)."""
  rng = np.random.default_rng(7)
  batch, vocab, beam, alpha, length = 64, 6, 3, 2.0, 8
  tables = rng.normal(size=(batch, length, vocab, vocab)).astype(np.float32) * 2
  limits = rng.integers(2, length + 1, size=batch)

  def tokens_to_logits(ids, steps, cache):
    return jnp.asarray(tables)[cache['sentence'], jnp.repeat(steps, beam), ids[:, 0]], cache

  def search_with(stop):
    strategy = search.BeamSearch(beam, alpha, stop=stop)
    return _refilled(strategy, tokens_to_logits, limits, 8, rng.permutation(batch))

  log_probs = np.asarray(jax.nn.log_softmax(jnp.asarray(tables)))
  expected = [_beam_ended_reference(log_probs[i], int(limits[i]), beam, alpha) for i in range(batch)]
  tokens, scores = search_with('beam_ended')
  for i, (score, seq) in enumerate(expected):
    assert tuple(int(t) for t in tokens[i, 0] if t) == seq, i
    np.testing.assert_allclose(float(scores[i, 0]), score, rtol=1e-5)
  bound_tokens, _ = search_with('bound')
  assert sum(tuple(int(t) for t in bound_tokens[i, 0] if t) != seq for i, (_, seq) in enumerate(expected)) >= 3


def test_beam_one_and_batch_order(small_model_config, np_rng):
  """Beam 1 is not greedy decoding in general (a finished short hypothesis can win on its length-penalised
  score), so it is checked against the search that recomputes every prefix; and rows keep their order."""
  batch = random_batch(np_rng, 4, 6, 5, small_model_config.vocab_size)
  model = Transformer(small_model_config)
  params = nn.meta.unbox(jax.jit(model.init)(jax.random.key(2), batch['inputs'], batch['targets'])['params'])
  run = lambda inputs, beam: engine.jitted_translate(model, beam, 0.6, 5, 12)(params, inputs)
  beam_1, _ = run(batch['inputs'], 1)
  expected, _ = jax.jit(lambda p, x: _uncached_beam_search(model, p, x, 1, 0.6, 5, 12))(params, batch['inputs'])
  np.testing.assert_array_equal(np.asarray(beam_1), np.asarray(expected))
  beam_4, _ = run(batch['inputs'], 4)
  reversed_4, _ = run(batch['inputs'][::-1], 4)
  np.testing.assert_array_equal(np.asarray(beam_4), np.asarray(reversed_4)[::-1])
  lengths = (np.asarray(beam_4) > 0).sum(1)
  assert np.all(lengths <= (batch['inputs'] > 0).sum(1) + 5)


def _uncached_beam_search(model, params, inputs, beam_size, alpha, max_extra, length):
  """Reference: beam search whose every step re-runs the decoder over the hypothesis's whole prefix."""
  encoded = model.apply({'params': params}, inputs, method=model.encode)
  encoded_n, inputs_n = jnp.repeat(encoded, beam_size, axis=0), jnp.repeat(inputs, beam_size, axis=0)

  def step(ids, steps, cache):
    steps = jnp.repeat(steps, beam_size)[:, None]  # [bn, 1]
    prefix = jnp.where(jnp.arange(length) == steps, ids, cache['prefix'])  # [bn, L]
    logits = model.apply({'params': params}, encoded_n, inputs_n, jnp.roll(prefix, -1, axis=1),
                         method=model.decode)  # decoder input == prefix
    return jnp.take_along_axis(logits, steps[:, :, None], axis=1)[:, 0], {'prefix': prefix}

  cache = {'prefix': jnp.zeros((inputs.shape[0] * beam_size, length), jnp.int32)}
  max_lengths = jnp.sum(inputs > 0, axis=1) + max_extra
  return search.beam_search(step, cache, inputs.shape[0], max_lengths, length, beam_size, alpha)


def test_cached_beam_search_equals_recomputing_every_prefix(small_model_config):
  """Reordered beams must carry their parents' self-attention keys/values (the cache is layer-stacked)."""
  # Few tokens and untied output weights: random weights then give varied outputs whose beams reorder.
  config = dataclasses.replace(small_model_config, vocab_size=20, share_embeddings=False)
  batch = random_batch(np.random.default_rng(0), 6, 7, 5, config.vocab_size)
  model = Transformer(config)
  params = nn.meta.unbox(jax.jit(model.init)(jax.random.key(4), batch['inputs'], batch['targets'])['params'])
  inputs = jnp.asarray(batch['inputs'])
  expected, expected_scores = jax.jit(lambda p, x: _uncached_beam_search(model, p, x, 4, 0.6, 6, 16))(params, inputs)
  for method in ('two_stage', 'lax'):  # the CPU choice and the GPU/TPU choice (platforms.py) agree
    cached, cached_scores = engine.jitted_translate(model, 4, 0.6, 6, 16, method)(params, inputs)
    np.testing.assert_array_equal(np.asarray(cached), np.asarray(expected))
    np.testing.assert_allclose(np.asarray(cached_scores), np.asarray(expected_scores), rtol=1e-4, atol=1e-5)

  # The comparison is sensitive: a search that never moves the cache finds other translations.
  def stale(params, inputs):
    memory = model.apply({'params': params}, inputs, method=model.memory)
    cache = model.apply({'params': params}, memory, 4, 16, method=model.init_cache)
    step = lambda ids, steps, c: model.apply({'params': params}, ids, c, steps, method=model.decode_step)
    return search.beam_search(step, cache, inputs.shape[0], jnp.sum(inputs > 0, 1) + 6, 16, 4, 0.6,
                              reorder_cache=lambda c, rows: c)[0]
  assert not np.array_equal(np.asarray(jax.jit(stale)(params, inputs)), np.asarray(expected))


@pytest.mark.parametrize('ties', [False, True])
@pytest.mark.parametrize('width,excluded', [(64 * 80, None), (6000, 0), (6000, 77)])  # blocks of 64; of 60
def test_blocked_top_k_equals_lax_top_k(ties, width, excluded):
  """Beam search's two-stage top-k returns exactly lax.top_k's values and indices, ties included, also with a
  column left out (padding, in the beam search)."""
  rng = np.random.default_rng(0)
  shape = (16, width)
  # Integers below 1000: the 8 largest of 5120 often tie, within and across blocks.
  x = rng.integers(0, 1000, shape).astype(np.float32) if ties else rng.normal(size=shape).astype(np.float32)
  if excluded is not None:
    x[:, excluded] = x.max() + 1  # every row's largest entry, left out all the same
    x[3, excluded + 1] = x.max() + 1  # beside it, in its block: row 3's best
  values, indices = jax.jit(search.top_k, static_argnums=(1, 2, 3))(x, 8, 'two_stage', excluded)
  if excluded is not None:
    x[:, excluded] = -np.inf
  expected_values, expected_indices = jax.lax.top_k(x, 8)
  np.testing.assert_array_equal(values, expected_values)
  np.testing.assert_array_equal(indices, expected_indices)


@pytest.mark.slow  # 8 s or more of compilation and steps on 2 cores (the marker)
def test_a_two_model_beam_search_finds_the_brute_force_optimum_of_the_ensemble():
  """Two tiny Transformers of different shapes: the ensemble's beam search (wide enough to be exhaustive) returns
  the sequence whose length-penalised sum of ensemble log-probabilities (the renormalised mean of the two models'
  log-probabilities, each from its own teacher-forced pass) is the best of every sequence up to the length limit."""
  from flax_transformer.model import TransformerConfig
  vocab, alpha, extra = 5, 0.6, 2
  configs = [TransformerConfig(vocab_size=vocab, d_model=d, num_heads=h, d_ff=2 * d, num_encoder_layers=1,
                               num_decoder_layers=layers, max_positions=16, share_embeddings=False, dropout_rate=0.0)
             for d, h, layers in ((16, 2, 2), (8, 1, 1))]
  inputs = np.array([[3, 1], [4, 1]], np.int32)  # one token and EOS: at most 2 + 2 output tokens
  models = tuple(Transformer(c) for c in configs)
  params = tuple(nn.meta.unbox(jax.jit(m.init)(jax.random.key(i + 7), inputs, inputs)['params']) for i, m in enumerate(models))
  tokens, scores = engine.jitted_translate(models, (vocab - 2) ** 3, alpha, extra, 4)(params, inputs)
  max_length = 2 + extra
  candidates = [list(seq) + [last] for length in range(1, max_length + 1)
                for seq in itertools.product(range(2, vocab), repeat=length - 1)
                for last in range(1, vocab) if length == max_length or last == 1]
  targets = np.zeros((len(candidates), max_length), np.int32)
  for i, candidate in enumerate(candidates):
    targets[i, :len(candidate)] = candidate
  sources = np.repeat(inputs, len(candidates), axis=0)  # every candidate of each row, in one pass per model
  logs = [np.asarray(jax.nn.log_softmax(m.apply({'params': p}, sources, np.tile(targets, (len(inputs), 1))), axis=-1))
          for m, p in zip(models, params)]  # [rows · candidates, t, v]
  q = np.asarray(jax.nn.log_softmax((logs[0] + logs[1]) / 2, axis=-1)).reshape(len(inputs), len(candidates), max_length, vocab)
  for row in range(len(inputs)):
    totals = [sum(q[row, i, t, y] for t, y in enumerate(c)) / ((5 + len(c)) / 6) ** alpha
              for i, c in enumerate(candidates)]
    best = int(np.argmax(totals))
    assert [int(t) for t in tokens[row] if t] == candidates[best]
    np.testing.assert_allclose(float(scores[row]), totals[best], rtol=1e-4)


def _teacher_forced_scores(model, params, inputs, tokens, alpha):
  """Length-penalised log p(tokens [b, k, L] | inputs [b, s]) of each hypothesis, under teacher forcing."""
  b, k, length = tokens.shape
  flat, sources = tokens.reshape(b * k, length), np.repeat(inputs, k, axis=0)
  log_probs = jax.nn.log_softmax(model.apply({'params': params}, sources, flat).astype(jnp.float32))  # [bk, L, v]
  chosen = np.take_along_axis(np.asarray(log_probs), flat[:, :, None], axis=2)[:, :, 0]
  lengths = (flat > 0).sum(1)
  return (np.where(flat > 0, chosen, 0.0).sum(1) / ((5.0 + lengths) / 6.0) ** alpha).reshape(b, k)


def test_every_hypothesis_of_the_k_best_scores_its_own_tokens_under_teacher_forcing(small_model_config):
  """Whatever the cache layout, each of the beam's k = n returned hypotheses must score what the model gives
  its own tokens: a hypothesis that read another's keys and values (a wrong ancestry) scores otherwise. The
  beams here diverge and reorder; a search that never reorders its cache fails this check."""
  config = dataclasses.replace(small_model_config, vocab_size=20, share_embeddings=False)
  inputs = random_batch(np.random.default_rng(1), 8, 7, 5, config.vocab_size)['inputs']
  model, n, alpha = Transformer(config), 4, 0.6
  params = nn.meta.unbox(jax.jit(model.init)(jax.random.key(5), inputs, inputs)['params'])
  tokens, scores = engine.jitted_translate(model, n, alpha, 6, 16, num_results=n)(params, inputs)
  np.testing.assert_allclose(np.asarray(scores), _teacher_forced_scores(model, params, inputs, np.asarray(tokens), alpha),
                             rtol=1e-4, atol=1e-4)

  def stale(params, inputs):  # every hypothesis keeps the ancestry of the row it sits in
    memory = model.apply({'params': params}, inputs, method=model.memory)
    cache = model.apply({'params': params}, memory, n, 16, method=model.init_cache)
    step = lambda ids, steps, c: model.apply({'params': params}, ids, c, steps, method=model.decode_step)
    return search.beam_search(step, cache, inputs.shape[0], jnp.sum(inputs > 0, 1) + 6, 16, n, alpha,
                              reorder_cache=lambda c, rows: c, num_results=n)
  tokens, scores = jax.jit(stale)(params, inputs)
  wrong = ~np.isclose(np.asarray(scores), _teacher_forced_scores(model, params, inputs, np.asarray(tokens), alpha),
                      rtol=1e-4, atol=1e-4)
  assert wrong.sum() >= 0.25 * wrong.size, wrong.sum()


def _hlo_computations(text: str) -> dict[str, list[str]]:
  """An optimized HLO module's computations: name -> its instruction lines."""
  blocks, name = {}, None
  for line in text.splitlines():
    head = re.match(r'^(?:ENTRY )?%([\w.\-]+) ', line)
    if head:
      name = head.group(1)
      blocks[name] = []
    elif name:
      blocks[name].append(line)
  return blocks


def test_no_step_of_the_compiled_beam_search_writes_a_whole_cache_buffer(small_model_config):
  """In the compiled while loop, every instruction that produces a self-attention cache buffer is the in-place
  write of this step's slots (a scatter, or a fusion whose root is one or a dynamic-update-slice): no copy, no
  gather of the cache
  (the copying layout's reorder shows up here as gather fusions and copies of every layer's buffers)."""
  b, n, length = 8, 4, 16
  model = Transformer(small_model_config)
  inputs = np.ones((b, 7), np.int32)
  params = nn.meta.unbox(jax.jit(model.init)(jax.random.key(0), inputs, inputs)['params'])
  text = engine.jitted_translate(model, n, 0.6, 6, length).lower(params, inputs).compile().as_text()
  h, d = small_model_config.num_heads, small_model_config.d_model // small_model_config.num_heads
  chunks, width = length // attention.chunk_steps(n), attention.chunk_steps(n) * n
  shapes = {f'f32[{chunks},{b},{h},{d},{width}]', f'f32[{chunks},{b},{h},{width},{d}]'}
  blocks = _hlo_computations(text)
  bodies = set(re.findall(r'while\([^\n]*?body=%([\w.\-]+)', text))
  assert bodies and any(shape in line for body in bodies for line in blocks[body] for shape in shapes)
  whole = []
  for line in (line for body in bodies for line in blocks[body]):
    produced = re.match(r'\s*(?:ROOT )?%[\w.\-]+ = (\w+\[[\d,]*\])\{[^}]*\} ([\w\-]+)\(', line)
    if not produced or produced.group(1) not in shapes or produced.group(2) in ('parameter', 'get-tuple-element',
                                                                                   'bitcast', 'tuple'):
      continue
    if produced.group(2) == 'scatter':
      continue
    if produced.group(2) == 'fusion':
      called = blocks[re.search(r'calls=%([\w.\-]+)', line).group(1)]
      root = next(l for l in called if l.strip().startswith('ROOT'))
      if ' dynamic-update-slice(' in root or ' scatter(' in root:
        continue
    whole.append(line.strip()[:160])
  assert whole == []


@pytest.mark.parametrize('beam,results', [(1, None), (4, None), (4, 2)])
def test_slots_refilled_in_any_order_give_each_sentence_its_own_search(small_model_config, beam, results):
  """56 sentences of varied lengths (and blank ones) through 8 slots, admitted two at a time as slots free up,
  in two different orders: each sentence gets the tokens and scores of a search in which every sentence has a
  slot of its own from start to end, and of a search of it alone."""
  config = dataclasses.replace(small_model_config, vocab_size=20, share_embeddings=False)
  inputs = random_batch(np.random.default_rng(2), 64, 9, 5, config.vocab_size)['inputs']
  inputs[56:] = 0  # blank sentences: no slot, no result
  model = Transformer(config)
  params = nn.meta.unbox(jax.jit(model.init)(jax.random.key(6), inputs, inputs)['params'])
  encoded = [[int(t) for t in row if t > 1] for row in inputs]
  strategy = search.strategy_for(DecodeSettings(beam_size=beam, beam_top_k='two_stage'), results)
  length = engine.decode_length(16, 4, config.max_positions)
  whole = engine.jitted_translate(model, beam, 0.6, 4, length, 'two_stage', results)(params, np.pad(inputs, ((0, 0), (0, 7))))
  whole_tokens, whole_scores = (np.asarray(x).reshape(64, -1, *x.shape[2 if results else 1:]) for x in whole)
  lengths = (whole_tokens[:56, 0] > 0).sum(-1)
  assert lengths.max() - lengths.min() >= 5  # they do end apart
  order = np.random.default_rng(3).permutation(64)
  for sentences in (encoded, [encoded[i] for i in order]):
    rows = list(range(64)) if sentences is encoded else list(order)
    got = engine.Engine(model, params, strategy, slots=8, admit_rows=2, max_extra_length=4,
                        max_positions=config.max_positions).run(sentences)
    for position, i in enumerate(rows):
      if i >= 56:
        assert got[position] == []
        continue
      assert len(got[position]) == (results or 1)
      for j, (tokens, score) in enumerate(got[position]):
        np.testing.assert_array_equal(tokens, whole_tokens[i, j], err_msg=f'sentence {i}')
        np.testing.assert_allclose(score, whole_scores[i, j], rtol=1e-5, atol=1e-5)
  alone = engine.Engine(model, params, strategy, slots=8, max_extra_length=4, max_positions=config.max_positions)
  for i in (0, 17):
    (tokens, score), *_ = alone.run([encoded[i]])[0]
    np.testing.assert_array_equal(tokens, whole_tokens[i, 0])


# --- Sampling ------------------------------------------------------------------------------

def _renormalised(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
  """The distribution sampling should draw from, written out in numpy: softmax(logits / T) without the padding
  token, cut to the k most probable, then to the most probable whose mass reaches p, renormalised."""
  probabilities = np.exp(logits / temperature - np.max(logits / temperature))
  probabilities[0] = 0.0  # PAD_ID is never drawn
  order = np.argsort(-probabilities)
  keep = np.zeros(len(logits), bool)
  keep[order[:top_k or len(logits) - 1]] = True
  nucleus = probabilities * keep / np.sum(probabilities * keep)
  mass = 0.0
  for token in order:
    if keep[token] and mass >= top_p:
      keep[token] = False
    mass += nucleus[token]
  return probabilities * keep / np.sum(probabilities * keep)


@pytest.mark.parametrize('temperature,top_k,top_p', [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.0, 0, 0.6), (1.5, 6, 0.8)])
def test_sampling_draws_from_the_tempered_top_k_top_p_distribution(temperature, top_k, top_p):
  """4,096 first tokens (512 sentences × 8 samples, each its own key) of a model whose every step gives the same
  12 logits: their counts fit the distribution written out in numpy (chi-square below its 1 - 1e-6 quantile: a
  bound from the sample size, not a tolerance), and no token outside it is ever drawn."""
  from scipy import stats
  logits = np.array([0.3, 2.0, 1.6, 1.1, 0.9, 0.6, 0.2, -0.1, -0.5, -0.9, 1.4, -2.0], np.float32)
  sentences, samples = 512, 8
  strategy = search.SamplingSearch(samples, temperature, top_k, top_p)

  def tokens_to_logits(ids, steps, cache):
    return jnp.broadcast_to(logits, (ids.shape[0], logits.size)), cache
  given = search.sentence_inputs(sentences, 1, search.sentence_keys(7, range(sentences)))
  tokens, scores = jax.jit(lambda given: search.run_to_end(strategy, tokens_to_logits, jnp.zeros(()),
                                                           jnp.ones((sentences,)), 1, given=given))(given)
  first = np.asarray(tokens)[:, :, 0].reshape(-1)
  counts = np.bincount(first, minlength=logits.size)
  expected = _renormalised(logits.astype(np.float64), temperature, top_k, top_p)
  assert counts[expected == 0].sum() == 0
  support = expected > 0
  statistic = np.sum((counts[support] - first.size * expected[support]) ** 2 / (first.size * expected[support]))
  bound = stats.chi2.ppf(1 - 1e-6, support.sum() - 1)
  print(f'T={temperature} k={top_k} p={top_p}: {support.sum()} tokens, chi-square {statistic:.1f} < {bound:.1f}')
  assert statistic < bound
  log_probabilities = logits - np.log(np.sum(np.exp(logits)))  # the model's own: the score of each sample
  np.testing.assert_allclose(np.asarray(scores).reshape(-1), log_probabilities[first], rtol=1e-5)


@pytest.mark.slow  # 8 s or more of compilation and steps on 2 cores (the marker)
def test_a_sentences_samples_depend_on_the_seed_and_its_number_alone(small_model_config):
  """40 sentences, 3 samples each at temperature 1.5 and top-p 0.9, through 8 slots in one order and 32 in
  another, on one device and on two: each sentence gets the same samples (its key comes from the seed and its
  number); another seed gives others; a temperature near 0 gives greedy search's tokens and scores."""
  config = dataclasses.replace(small_model_config, vocab_size=20, share_embeddings=False)
  inputs = random_batch(np.random.default_rng(3), 40, 9, 5, config.vocab_size)['inputs']
  model = Transformer(config)
  params = nn.meta.unbox(jax.jit(model.init)(jax.random.key(6), inputs, inputs)['params'])
  encoded = [[int(t) for t in row if t > 1] for row in inputs]
  order = np.random.default_rng(0).permutation(len(encoded))

  def sampled(strategy, slots, mesh=None, seed=5, shuffled=False):
    indices = order if shuffled else np.arange(len(encoded))
    placed = jax.device_put(params, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())) if mesh else params
    decoder = engine.Engine(model, placed, strategy, slots=slots, max_extra_length=4, max_positions=64, mesh=mesh)
    results = decoder.run([encoded[i] for i in indices], keys=search.sentence_keys(seed, indices))
    found = [None] * len(encoded)
    for i, result in zip(indices, results):
      found[i] = [(np.trim_zeros(np.asarray(tokens), 'b').tolist(), score) for tokens, score in result]
    return found
  sampling = search.SamplingSearch(3, 1.5, 0, 0.9)
  first = sampled(sampling, 8)
  assert len({tuple(map(tuple, (t for t, _ in samples))) for samples in first}) > 30  # they do differ
  assert any(len({tuple(t) for t, _ in samples}) > 1 for samples in first)  # within a sentence too
  for other in (sampled(sampling, 32, shuffled=True), sampled(sampling, 8, engine.decoding_mesh(2), shuffled=True)):
    for mine, theirs in zip(first, other):
      assert [t for t, _ in mine] == [t for t, _ in theirs]
      np.testing.assert_allclose([s for _, s in mine], [s for _, s in theirs], rtol=1e-5, atol=1e-5)
  assert [[t for t, _ in s] for s in sampled(sampling, 8, seed=6)] != [[t for t, _ in s] for s in first]
  cold = sampled(search.SamplingSearch(1, 1e-6), 8)
  greedy = sampled(search.GreedySearch(), 8)
  assert [[t for t, _ in s] for s in cold] == [[t for t, _ in s] for s in greedy]
  np.testing.assert_allclose([s[0][1] for s in cold], [s[0][1] for s in greedy], rtol=1e-5)


# --- Target prefixes -------------------------------------------------------------------------

def _twenty_token_model(small_model_config, sentences: int, seed: int, key: int):
  """A random model over 20 tokens and `sentences` random source sentences of up to 7 tokens: (config, model,
  params, inputs [b, 7], each sentence's ids without EOS and padding)."""
  config = dataclasses.replace(small_model_config, vocab_size=20, share_embeddings=False)
  inputs = random_batch(np.random.default_rng(seed), sentences, 7, 5, config.vocab_size)['inputs']
  model = Transformer(config)
  params = nn.meta.unbox(jax.jit(model.init)(jax.random.key(key), inputs, inputs)['params'])
  return config, model, params, inputs, [[int(t) for t in row if t > 1] for row in inputs]


@pytest.mark.slow  # 8 s or more of compilation and steps on 2 cores (the marker)
def test_a_forced_prefix_begins_every_output_and_scores_as_teacher_forcing(small_model_config):
  """12 sentences through 8 slots, two in three with a prefix of 1 or 2 random tokens, by beam search (its 4
  best), greedy search and sampling (3 samples): every returned output begins with its prefix and scores what
  teacher forcing gives its tokens; a sentence with an empty prefix decodes as with no prefixes at all."""
  config, model, params, inputs, encoded = _twenty_token_model(small_model_config, 12, seed=4, key=7)
  rng = np.random.default_rng(0)
  prefixes = [list(rng.integers(3, config.vocab_size, 1 + i % 2)) if i % 3 else [] for i in range(12)]
  keys = search.sentence_keys(1, range(12))
  run = lambda strategy, prefixes: engine.Engine(model, params, strategy, slots=8, max_extra_length=5,
                                                 max_positions=64).run(encoded, keys=keys, prefixes=prefixes)
  for strategy in (search.BeamSearch(4, 0.6, num_results=4, prefixed=True), search.GreedySearch(prefixed=True),
                   search.SamplingSearch(3, 1.2, prefixed=True)):
    found = run(strategy, prefixes)
    tokens = np.stack([np.stack([t for t, _ in results]) for results in found])  # [12, k, L]
    expected = _teacher_forced_scores(model, params, inputs, tokens, getattr(strategy, 'length_penalty_alpha', 0.0))
    np.testing.assert_allclose([[s for _, s in results] for results in found], expected, rtol=1e-4, atol=1e-4)
    for i, prefix in enumerate(prefixes):
      assert all(t[:len(prefix)].tolist() == prefix for t in tokens[i]), (strategy, i, prefix, tokens[i])
  plain = run(dataclasses.replace(strategy, prefixed=False), None)  # sampling, as every strategy forces alike
  assert all([t.tolist() for t, _ in found[i]] == [t.tolist() for t, _ in plain[i]] for i in range(0, 12, 3))
  assert any(found[i][0][0].tolist() != plain[i][0][0].tolist() for i in range(12) if i % 3)  # the prefix did force


# --- Lexical constraints ---------------------------------------------------------------------

def _contains(tokens: list, phrases: list, ordered: bool) -> bool:
  """Whether `tokens` holds every phrase as a run of tokens (ordered: each after the previous one's end)."""
  start = 0
  for phrase in phrases:
    at = next((i for i in range(start if ordered else 0, len(tokens) - len(phrase) + 1)
               if tokens[i:i + len(phrase)] == phrase), None)
    if at is None:
      return False
    start = at + len(phrase)
  return True


def _constrained_brute_force(table, max_length, alpha, phrases, ordered):
  """_brute_force over the sequences a constrained search may return: those that contain the phrases and end
  with EOS or at the length limit, else (none does) those cut at the limit."""
  log_probs = np.asarray(jax.nn.log_softmax(jnp.asarray(table)))
  best, best_seq = (-np.inf, False), None
  for length in range(1, max_length + 1):
    for body in itertools.product(range(2, table.shape[-1]), repeat=length - 1):
      for last in range(1, table.shape[-1]):
        full = list(body) + [last]
        met = _contains(full, phrases, ordered)
        if (length < max_length and last != 1) or (last == 1 and not met):
          continue
        score = sum(log_probs[step, prev, token] for step, (prev, token) in enumerate(zip([0] + full, full)))
        score /= ((5 + length) / 6) ** alpha
        if (met, score) > best[::-1]:
          best, best_seq = (score, met), full
  return best[0], best_seq


@pytest.mark.parametrize('ordered', [False, True])
def test_constrained_beam_search_finds_the_brute_force_optimum(ordered):
  """Ten random tables over 3 tokens and EOS, up to 6 tokens, with one or two random phrases of one or two tokens
  (repeats and overlaps included): a beam wide enough to be exhaustive returns the best-scoring sequence that
  contains them (ordered: one after the other), or is cut at the limit, found by enumerating every sequence."""
  rng = np.random.default_rng(11 + ordered)
  vocab, max_length = 5, 6
  beam = 3 ** (max_length - 1) * 2
  strategy = search.ConstrainedBeamSearch(beam, 0.6, phrases=2, phrase_length=2, ordered=ordered)

  @jax.jit
  def run(table, given):
    return search.run_to_end(strategy, _table_model(table), {'rows': jnp.zeros((beam,))}, jnp.array([max_length]),
                             max_length, given=given)
  for trial in range(10):
    table = rng.normal(size=(max_length, vocab, vocab)).astype(np.float32) * 2
    phrases = [[int(t) for t in rng.integers(2, vocab, rng.integers(1, 3))] for _ in range(rng.integers(1, 3))]
    tokens, scores = run(table, search.sentence_inputs(1, max_length, constraints=[phrases], constraint_shape=(2, 2)))
    expected_score, expected_seq = _constrained_brute_force(table, max_length, 0.6, phrases, ordered)
    assert [int(t) for t in tokens[0, 0] if t] == expected_seq, (trial, phrases)
    np.testing.assert_allclose(float(scores[0, 0]), expected_score, rtol=1e-5)


def test_a_beam_of_four_meets_every_constraint_the_length_limit_leaves_room_for():
  """32 random tables (a sentence each, 10 tokens and EOS, up to 12 tokens) with one to three random phrases of one
  to three tokens (at most 9 tokens: room in 12), searched at once in 32 slots by a beam of 4, unordered and
  ordered: every output contains its phrases, whether it ends with EOS or at the length limit."""
  rng = np.random.default_rng(3)
  slots, vocab, max_length, n = 32, 12, 12, 4
  tables = rng.normal(size=(slots, max_length, vocab, vocab)).astype(np.float32)
  constraints = [[[int(t) for t in rng.integers(2, vocab, rng.integers(1, 4))] for _ in range(rng.integers(1, 4))]
                 for _ in range(slots)]

  def tokens_to_logits(ids, steps, cache):  # row r holds a hypothesis of slot r // n
    rows = jnp.arange(ids.shape[0])
    return jnp.asarray(tables)[rows // n, steps[rows // n], ids[:, 0]], cache
  for ordered in (False, True):
    strategy = search.ConstrainedBeamSearch(n, 0.6, phrases=4, phrase_length=4, ordered=ordered)
    given = search.sentence_inputs(slots, max_length, constraints=constraints, constraint_shape=(4, 4))
    tokens, _ = jax.jit(lambda given: search.run_to_end(strategy, tokens_to_logits, jnp.zeros(()),
                                                        jnp.full((slots,), max_length), max_length, given=given))(given)
    outputs = [[t for t in row.tolist() if t > 1] for row in np.asarray(tokens)[:, 0]]
    assert sum(1 in row for row in np.asarray(tokens)[:, 0].tolist()) >= slots // 3  # many end with EOS
    for output, phrases in zip(outputs, constraints):
      assert _contains(output, phrases, ordered), (ordered, phrases, output)


@pytest.mark.slow  # 8 s or more of compilation and steps on 2 cores (the marker)
def test_constraints_in_refilled_slots_score_their_tokens_and_leave_other_sentences_as_they_were(
    small_model_config):
  """16 sentences through 8 slots of a small random model, beam 4 (its 2 best), three in four with one to three
  phrases of one to three random tokens, unordered and ordered: every returned output scores what teacher
  forcing gives its tokens, one that ends with EOS contains its phrases, the outputs hold far more of the
  phrases than unconstrained ones, and a sentence without phrases decodes as BeamSearch decodes it."""
  config, model, params, inputs, encoded = _twenty_token_model(small_model_config, 16, seed=5, key=8)
  rng = np.random.default_rng(1)
  constraints = [[[int(t) for t in rng.integers(3, config.vocab_size, rng.integers(1, 4))]
                  for _ in range(rng.integers(1, 4))] if i % 4 else [] for i in range(16)]
  run = lambda strategy, constraints=None: engine.Engine(model, params, strategy, slots=8, max_extra_length=8,
                                                         max_positions=64).run(encoded, constraints=constraints)
  plain = run(search.BeamSearch(4, 0.6, num_results=2))
  met = lambda found: sum(_contains(results[0][0].tolist(), [phrase], False)
                          for results, phrases in zip(found, constraints) for phrase in phrases)
  assert search.constraint_shape(constraints) == (4, 4)
  for ordered in (False, True):
    found = run(search.ConstrainedBeamSearch(4, 0.6, num_results=2, ordered=ordered, phrases=4, phrase_length=4),
                constraints)
    tokens = np.stack([np.stack([t for t, _ in results]) for results in found])  # [16, 2, L]
    expected = _teacher_forced_scores(model, params, inputs, tokens, 0.6)
    np.testing.assert_allclose([[s for _, s in results] for results in found], expected, rtol=1e-4, atol=1e-4)
    for i, phrases in enumerate(constraints):
      for output in (t.tolist() for t in tokens[i]):
        assert 1 not in output or _contains(output[:output.index(1)], phrases, ordered), (ordered, i, output)
      if not phrases:
        assert [t.tolist() for t, _ in found[i]] == [t.tolist() for t, _ in plain[i]]
        np.testing.assert_allclose([s for _, s in found[i]], [s for _, s in plain[i]], rtol=1e-5)
    print(f'ordered={ordered}: {met(found)} of {sum(map(len, constraints))} phrases met, {met(plain)} unconstrained')
    assert met(found) == sum(map(len, constraints))
