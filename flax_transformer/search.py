"""§6.1 decoding: beam search with the GNMT length penalty, and greedy search, on device.

Both are pure functions of a `tokens_to_logits(ids [b·n, 1], cache) -> (logits [b·n, v], cache)`
callback, so any model (or a hand-made table in tests) can drive them. Hypotheses of sentence i
occupy rows i·n … i·n+n-1. When beams are reordered, `reorder_cache(cache, rows [b·n])` makes each
hypothesis continue its parent's; the default gathers every leaf whose leading dimension is b·n and
leaves the others alone. translate_batch passes `Transformer.reorder_cache`, which reorders only each
hypothesis's ancestry table: the flat self-attention cache is never copied, and the encoder keys/values
([b, ...]) are shared by a sentence's beams. Given `select_sentences(cache, sentences)`, the searches drop
finished sentences from the batch in a few phases of halving size (CTranslate2 drops them step by step).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from flax_transformer.constants import EOS_ID, IMPOSSIBLE_SCORE, PAD_ID
from flax_transformer.decoding_settings import BEAM_STOPS, TOP_K


def length_penalty(length, length_penalty_alpha: float):
  """GNMT (Wu et al., 2016): ((5 + |Y|) / 6)^α."""
  return ((5.0 + jnp.asarray(length, jnp.float32)) / 6.0) ** length_penalty_alpha


def _block_size(width: int, k: int) -> int | None:
  """The blocks of top_k's first stage: 32–64 entries, a divisor of the width; None where blocks do not pay."""
  block = next((b for b in range(64, 31, -1) if width % b == 0), None)
  return None if block is None or width < 4 * k * block else block


def top_k(x: jax.Array, k: int, beam_top_k: str = 'lax', excluded: int | None = None):
  """jax.lax.top_k over the last axis of x [r, v] -> (values [r, k], indices [r, k]), in two cheap stages
  (beam_top_k 'two_stage'), or `jax.lax.top_k` itself (beam_top_k 'lax'); a run's 'auto' is made by settings.py.
  `excluded`: a column never chosen (as if it held -inf). k = 1 is an argmax either way.

  XLA:CPU's top-k sorts each whole row; over a vocabulary that costs more than the rest of a beam step.
  The k largest entries lie in the k blocks (of 32–64 entries, a divisor of v) with the largest
  maxima, so the search takes those blocks' maxima, then the top k of the entries of the chosen blocks
  (in index order, so ties resolve to the lowest index, as lax.top_k does).
  """
  if beam_top_k not in TOP_K:
    raise ValueError(f'beam_top_k={beam_top_k!r}: use one of {TOP_K}')
  block = _block_size(x.shape[-1], k)
  if beam_top_k == 'lax' or block is None:
    if excluded is not None:
      x = jnp.where(jnp.arange(x.shape[-1]) == excluded, -jnp.inf, x)
    if k == 1:  # a row's maximum needs no sort: argmax (ties to the lowest index, as lax.top_k)
      index = jnp.argmax(x, axis=-1)[:, None]  # [r, 1]
      return jnp.take_along_axis(x, index, axis=1), index.astype(jnp.int32)
    return jax.lax.top_k(x, k)
  blocks = x.reshape(x.shape[0], -1, block)  # [r, nb, block]
  return _blocked_top_k(blocks, jnp.max(blocks, axis=-1), k, excluded)


def _blocked_top_k(blocks: jax.Array, block_maxima: jax.Array, k: int, excluded: int | None):
  """top_k's two stages over blocks [r, nb, block] whose maxima [r, nb] are given; `excluded` as top_k's.
  Reads only the k chosen blocks of each row."""
  rows, _, block = blocks.shape
  if excluded is not None:  # the maximum of the excluded entry's block without it
    home, within = divmod(excluded, block)
    others = jnp.where(jnp.arange(block) == within, -jnp.inf, blocks[:, home])  # [r, block]
    block_maxima = block_maxima.at[:, home].set(jnp.max(others, axis=-1))
  _, best_blocks = jax.lax.top_k(block_maxima, k)  # [r, k]
  best_blocks = jnp.sort(best_blocks, axis=-1)
  candidates = jnp.take_along_axis(blocks, best_blocks[:, :, None], axis=1).reshape(rows, k * block)  # [r, k·block]
  indices = (best_blocks[:, :, None] * block + jnp.arange(block)).reshape(rows, k * block)  # [r, k·block]
  if excluded is not None:
    candidates = jnp.where(indices == excluded, -jnp.inf, candidates)
  values, position = jax.lax.top_k(candidates, k)  # [r, k]
  return values, jnp.take_along_axis(indices, position, axis=1)


def best_tokens(logits: jax.Array, k: int, beam_top_k: str):
  """Each row's k most probable tokens other than padding and the row's log-normaliser: logits [r, v] ->
  (their logits [r, k], tokens [r, k], logsumexp [r, 1]). Two-stage, the blocks' maxima also give the
  normaliser's shift: the logits are read twice (maxima, exponentials) plus the chosen blocks."""
  block = _block_size(logits.shape[-1], k)
  if beam_top_k == 'lax' or block is None:
    values, tokens = top_k(logits, k, beam_top_k, excluded=PAD_ID)
    return values, tokens, jax.nn.logsumexp(logits, axis=-1, keepdims=True)
  blocks = logits.reshape(logits.shape[0], -1, block)  # [r, nb, block]
  block_maxima = jnp.max(blocks, axis=-1)  # [r, nb]
  shift = jnp.max(block_maxima, axis=-1, keepdims=True)  # [r, 1]
  normaliser = shift + jnp.log(jnp.sum(jnp.exp(logits - shift), axis=-1, keepdims=True))  # [r, 1]
  return (*_blocked_top_k(blocks, block_maxima, k, PAD_ID), normaliser)


def gather_leading_rows(tree, rows):
  """Default `reorder_cache`: leaves with leading dimension len(rows) take rows `rows` [b·n]; others stay."""
  def gather(x):
    if x.ndim and x.shape[0] == rows.shape[0]:
      return jnp.take(x, rows, axis=0)
    return x
  return jax.tree_util.tree_map(gather, tree)


def phase_sizes(batch: int, smallest: int = 8, compactions: int = 3, least: int = 64) -> list[int]:
  """The batch sizes a search compacts its sentences into as they finish: halving (rounded up to a multiple of
  8) down to `smallest`, at most `compactions` times; [batch] alone for a batch under `least` rows, where a
  compaction saves less than the compilation of another phase costs."""
  sizes = [batch]
  while batch >= least and len(sizes) <= compactions and sizes[-1] >= 2 * smallest:
    sizes.append(-(-sizes[-1] // 2 // 8) * 8)
  return sizes


def select_leading(tree, rows: jax.Array):
  """Default `select_sentences`: every leaf with a leading axis takes rows `rows` [b'] of it (scalars stay)."""
  return jax.tree_util.tree_map(lambda x: jnp.take(x, rows, axis=0) if x.ndim else x, tree)


def _phased(not_done, body, state: dict, done, select_sentences, results: tuple[str, ...]) -> dict:
  """Runs the search loop `body` while `not_done(state, floor)`, in phases of shrinking batch size: once the
  sentences not `done(state)` [b] fit in the next phase's size, the state's sentences (and the cache, through
  `select_sentences(cache, rows)`) are cut to those rows, unfinished ones first; finished sentences' results
  (the state's `results` entries) are final and kept, by original row, in the returned state. Without
  `select_sentences`: one phase, the plain loop."""
  batch = state['origin'].shape[0]
  sizes = phase_sizes(batch) if select_sentences is not None else [batch]
  kept = {name: state[name] for name in results}  # per original row
  for phase in range(len(sizes)):
    floor = sizes[phase + 1] if phase + 1 < len(sizes) else 0  # the next phase's size (0: run to the end)
    state = jax.lax.while_loop(functools.partial(not_done, floor=floor), body, state)
    kept = {name: kept[name].at[state['origin']].set(state[name]) for name in results}
    if floor:
      rows = jnp.argsort(done(state), stable=True)[:floor]  # [floor]: the unfinished first
      state = {k: (select_sentences if k == 'cache' else select_leading)(v, rows) for k, v in state.items()}
  return {**state, **kept}


def beam_search(tokens_to_logits, cache, batch: int, max_lengths: jax.Array, max_output_length: int,
                beam_size: int = 4, length_penalty_alpha: float = 0.6, eos_id: int = EOS_ID,
                reorder_cache=gather_leading_rows, beam_top_k: str = 'lax', num_results: int | None = None,
                select_sentences=None, stop: str = 'bound'):
  """Beam search returning the best hypothesis of each sentence, or its `num_results` best.

  Args:
    tokens_to_logits: (ids [b·n, 1], cache) -> (logits [b·n, v], cache).
    cache: the callback's state for b·n hypotheses (see module docstring).
    batch: b.
    max_lengths: [b] int32, the most tokens (EOS included) each sentence may produce (§6.1: input + 50); 0 for
      a padding row, which is then finished from the start.
    max_output_length: static upper bound of max_lengths (the size of the output and the cache).
    beam_size: n. length_penalty_alpha: the length penalty's exponent α (0 = none).
    reorder_cache: (cache, rows [b·n] int32) -> cache whose hypothesis j holds what row rows[j] held.
    beam_top_k: how each row's best tokens are found ('two_stage' or 'lax'; see top_k).
    num_results: None for the best hypothesis alone; k ≤ n for the k best, the search then running until
      the k-th best finished one (not only the best) beats every live one.
    select_sentences: (cache, sentences [b'] int32) -> the cache of those sentences alone (every hypothesis of
      each), or None. Given, finished sentences leave the batch as the search goes (phase_sizes), as
      CTranslate2 drops them: the same results for less work.
    stop: when a sentence is finished (its results final). 'bound' (tensor2tensor): once its k-th best ended
      hypothesis scores at least what its best live one would at the length limit with no further loss, so
      the result is that of searching to the limit. 'beam_ended' (fairseq, CTranslate2): once n hypotheses
      have ended, a hypothesis counting as ended only when it is among the n best extensions of its step
      (an ending extension ranked below them is dropped).
  Returns:
    (tokens [b, max_output_length] int32, ending with EOS unless cut at the length limit, 0-padded;
     scores [b]: the length-penalised log-probabilities), or with num_results=k: ([b, k, max_output_length],
     [b, k]), best first.
  """
  n, length = beam_size, max_output_length
  kept = num_results or 1
  if not 1 <= kept <= n:
    raise ValueError(f'num_results={num_results} must be between 1 and the beam size {n}')
  if stop not in BEAM_STOPS:
    raise ValueError(f'stop={stop!r}: use one of {BEAM_STOPS}')
  max_lengths = jnp.minimum(jnp.asarray(max_lengths, jnp.int32), length)

  def done(state):  # [b]: finished by the stopping rule, or out of length
    if stop == 'beam_ended':  # n hypotheses have ended (an unfilled slot holds IMPOSSIBLE_SCORE)
      ended = state['finished_scores'][:, n - 1] > IMPOSSIBLE_SCORE / 2
    else:  # no live hypothesis can still beat the k-th best finished one
      best_live_bound = state['live_scores'][:, 0] / length_penalty(state['max_lengths'], length_penalty_alpha)
      ended = state['finished_scores'][:, kept - 1] >= best_live_bound
    return ended | (state['step'] >= state['max_lengths'])

  def not_done(state, floor):
    return (state['step'] < length) & (jnp.sum(~done(state)) > floor)

  body = functools.partial(_beam_step, tokens_to_logits=tokens_to_logits, n=n, alpha=length_penalty_alpha,
                           eos_id=eos_id, reorder_cache=reorder_cache, beam_top_k=beam_top_k, done=done,
                           ended_in_beam=stop == 'beam_ended')
  state = {**_initial_beams(batch, n, length, cache), 'max_lengths': max_lengths, 'origin': jnp.arange(batch)}
  final = _phased(not_done, body, state, done, select_sentences, ('finished_tokens', 'finished_scores'))
  if num_results:
    return final['finished_tokens'][:, :kept, 1:], final['finished_scores'][:, :kept]  # [b, k, L], [b, k]
  return final['finished_tokens'][:, 0, 1:], final['finished_scores'][:, 0]  # [b, L], [b]


def _beam_step(state, *, tokens_to_logits, n: int, alpha: float, eos_id: int, reorder_cache, beam_top_k: str, done,
               ended_in_beam: bool):
  """One step of beam_search: every live hypothesis extended by its best tokens, the n best that go on kept
  live (the cache reordered to them), those that end merged into the n best finished, unless the sentence was
  already `done(state)` [b] (its results are final while the batch goes on). `ended_in_beam`: only extensions
  among the step's n best may end (the others that end are dropped)."""
  step, rows, limits = state['step'], state['origin'].shape[0], state['max_lengths']
  ids = state['live_tokens'][:, :, step].reshape(rows * n, 1)  # [bn, 1]
  logits, new_cache = tokens_to_logits(ids, state['cache'])
  top_scores, top_beam, top_token = _extensions(state['live_scores'], logits, n, beam_top_k)  # [b, 2n] each
  top_tokens = jnp.take_along_axis(state['live_tokens'], top_beam[:, :, None], axis=1)  # [b, 2n, L+1]
  top_tokens = top_tokens.at[:, :, step + 1].set(top_token)
  ends = (top_token == eos_id) | (step + 1 >= limits)[:, None]  # [b, 2n]: EOS, or the length limit
  live_scores, live_pick = jax.lax.top_k(jnp.where(ends, IMPOSSIBLE_SCORE, top_scores), n)  # [b, n]: those that go on
  live_beam = jnp.take_along_axis(top_beam, live_pick, axis=1)  # [b, n]
  parent_rows = (live_beam + jnp.arange(rows)[:, None] * n).reshape(rows * n)  # [bn]
  counted = ends & ~done(state)[:, None]  # [b, 2n]
  if ended_in_beam:  # the n best (top_scores is sorted), and not extensions of the unfilled beams of step 0
    counted &= (jnp.arange(2 * n) < n) & (top_scores > IMPOSSIBLE_SCORE / 2)
  ended_scores = jnp.where(counted, top_scores / length_penalty(step + 1, alpha), IMPOSSIBLE_SCORE)
  finished_scores, finished_tokens = _best_finished(state['finished_scores'], state['finished_tokens'],
                                                    ended_scores, top_tokens, n)
  return {**state, 'step': step + 1, 'live_scores': live_scores,
          'live_tokens': jnp.take_along_axis(top_tokens, live_pick[:, :, None], axis=1),  # [b, n, L+1]
          'finished_tokens': finished_tokens, 'finished_scores': finished_scores,
          'cache': reorder_cache(new_cache, parent_rows)}


def _initial_beams(batch: int, n: int, length: int, cache) -> dict:
  """The search's state before its first step: one live hypothesis a sentence (the start symbol), none finished."""
  return {
      'step': jnp.array(0, jnp.int32),
      'live_tokens': jnp.zeros((batch, n, length + 1), jnp.int32),  # position 0: the start symbol
      'live_scores': jnp.tile(jnp.array([0.0] + [IMPOSSIBLE_SCORE] * (n - 1), jnp.float32), (batch, 1)),  # [b, n]
      'finished_tokens': jnp.zeros((batch, n, length + 1), jnp.int32),
      'finished_scores': jnp.full((batch, n), IMPOSSIBLE_SCORE, jnp.float32),  # length-penalised
      'cache': cache,
  }


def _extensions(live_scores, logits, n: int, beam_top_k: str):
  """The 2n best one-token extensions of each sentence's n live hypotheses (2n always include n that do not
  end): live_scores [b, n], logits [b·n, v] -> (scores [b, 2n], parent beam [b, 2n], token [b, 2n])."""
  batch = live_scores.shape[0]
  # The sentence's best 2n extensions are among each hypothesis's best 2n tokens, and log-softmax keeps a row's
  # order: pick per row on the logits, normalise only the picks (no [bn, v] log-prob array). Padding is never
  # produced.
  per_row = min(2 * n, logits.shape[-1] - 1)
  row_logits, row_tokens, log_normalizer = best_tokens(logits.astype(jnp.float32), per_row, beam_top_k)  # [bn, k]
  row_log_probs = (row_logits - log_normalizer).reshape(batch, n, per_row)  # [b, n, k]
  candidates = (live_scores[:, :, None] + row_log_probs).reshape(batch, n * per_row)  # [b, n·k]
  top_scores, top_index = jax.lax.top_k(candidates, 2 * n)  # [b, 2n]
  top_token = jnp.take_along_axis(row_tokens.reshape(batch, n * per_row), top_index, axis=1)  # [b, 2n]
  return top_scores, top_index // per_row, top_token


def _best_finished(finished_scores, finished_tokens, ended_scores, ended_tokens, n: int):
  """The n best finished hypotheses: those kept so far ([b, n], [b, n, L+1]) merged with those that end at
  this step ([b, 2n] length-penalised, [b, 2n, L+1]; the others at IMPOSSIBLE_SCORE)."""
  merged_scores = jnp.concatenate([finished_scores, ended_scores], axis=1)  # [b, 3n]
  merged_tokens = jnp.concatenate([finished_tokens, ended_tokens], axis=1)  # [b, 3n, L+1]
  scores, pick = jax.lax.top_k(merged_scores, n)  # [b, n]
  return scores, jnp.take_along_axis(merged_tokens, pick[:, :, None], axis=1)


def greedy_search(tokens_to_logits, cache, batch: int, max_lengths: jax.Array, max_output_length: int,
                  eos_id: int = EOS_ID, select_sentences=None, beam_top_k: str = 'lax'):
  """The most probable next token at each step; stops when every sentence has ended (a padding row, whose
  max_lengths is 0, from the start). `select_sentences`: as beam_search's, finished sentences leave the batch.
  `beam_top_k`: how best_tokens finds each row's best token ('two_stage': two passes over the logits).

  Returns (tokens [b, max_output_length] int32, log-probabilities [b]).
  """
  max_lengths = jnp.minimum(jnp.asarray(max_lengths, jnp.int32), max_output_length)
  initial = {'step': jnp.array(0, jnp.int32), 'tokens': jnp.zeros((batch, max_output_length + 1), jnp.int32),
             'ended': max_lengths <= 0, 'scores': jnp.zeros((batch,), jnp.float32), 'cache': cache,
             'max_lengths': max_lengths, 'origin': jnp.arange(batch)}

  def not_done(state, floor):
    return (state['step'] < max_output_length) & (jnp.sum(~state['ended']) > floor)

  def body(state):
    step = state['step']
    logits, cache = tokens_to_logits(state['tokens'][:, step][:, None], state['cache'])  # [b, v]
    best, token, log_normalizer = best_tokens(logits.astype(jnp.float32), 1, beam_top_k)  # [b, 1] each: no padding
    token, log_prob = token[:, 0], best[:, 0] - log_normalizer[:, 0]  # [b]: log-softmax keeps the row's order
    token = jnp.where(state['ended'], PAD_ID, token)
    score = state['scores'] + jnp.where(state['ended'], 0.0, log_prob)
    ended = state['ended'] | (token == eos_id) | (step + 1 >= state['max_lengths'])
    return {**state, 'step': step + 1, 'tokens': state['tokens'].at[:, step + 1].set(token), 'ended': ended,
            'scores': score, 'cache': cache}

  final = _phased(not_done, body, initial, lambda state: state['ended'], select_sentences, ('tokens', 'scores'))
  return final['tokens'][:, 1:], final['scores']


# --- The Transformer as a tokens_to_logits callback ------------------------------------------

def members(model, params) -> tuple[tuple, tuple]:
  """(models, their parameters) of one model (a Transformer and its parameters) or of an ensemble (tuples of
  both)."""
  return (tuple(model), tuple(params)) if isinstance(model, tuple) else ((model,), (params,))


def ensemble_log_probs(logits: list[jax.Array]) -> jax.Array:
  """An ensemble's next-token distribution from its members' logits [..., v]: the mean of their
  log-probabilities (as fairseq's and Marian's ensembles), renormalised, so that it is a distribution whose
  scores read as one model's: log-probabilities [..., v] (float32)."""
  mean = jnp.mean(jnp.stack([jax.nn.log_softmax(x.astype(jnp.float32), axis=-1) for x in logits]), axis=0)
  return jax.nn.log_softmax(mean, axis=-1)


def translate_batch(params, inputs, *, model, beam_size: int, length_penalty_alpha: float, max_extra_length: int,
                    max_output_length: int, beam_top_k: str = 'lax', num_results: int | None = None,
                    beam_stop: str = 'bound'):
  """Pure predict step: inputs [b, s] int32 -> (tokens [b, max_output_length], scores [b]), or with
  num_results=k the k best of each sentence's beam: ([b, k, max_output_length], [b, k]).

  `model` and `params`: one Transformer and its parameters, or an ensemble: a tuple of Transformers (any shapes
  sharing one vocabulary) and a tuple of their parameters, decoded with `ensemble_log_probs`, each member with
  its own cache. Each sentence may produce up to (its source length + max_extra_length) tokens (§6.1); finished
  sentences leave the batch as the search goes (phase_sizes); padding rows (all 0) are finished from the start.
  `beam_stop`: beam_search's stopping rule (BEAM_STOPS).
  Bind model/beam_size/length_penalty_alpha/max_extra_length/max_output_length with functools.partial and jit.
  """
  batch, n = inputs.shape[0], max(beam_size, 1)
  models, member_params = members(model, params)
  caches = {'inputs': inputs, 'members': tuple(
      m.apply({'params': p}, m.apply({'params': p}, inputs, method=m.encode), n, max_output_length,
              method=m.init_cache) for m, p in zip(models, member_params))}
  source_lengths = jnp.sum(inputs > 0, axis=1)  # [b]
  max_lengths = jnp.where(source_lengths > 0, source_lengths + max_extra_length, 0)  # a padding row: none

  def tokens_to_logits(ids, caches):
    outputs = [m.apply({'params': p}, ids, caches['inputs'], c, method=m.decode_step)
               for m, p, c in zip(models, member_params, caches['members'])]
    logits = outputs[0][0] if len(models) == 1 else ensemble_log_probs([logits for logits, _ in outputs])
    return logits, {**caches, 'members': tuple(cache for _, cache in outputs)}

  def reorder_cache(caches, rows):
    return {**caches, 'members': tuple(type(m).reorder_cache(c, rows) for m, c in zip(models, caches['members']))}

  def select_sentences(caches, rows):
    return {'inputs': caches['inputs'][rows],
            'members': tuple(type(m).select_sentences(c, rows) for m, c in zip(models, caches['members']))}

  if beam_size <= 1:
    tokens, scores = greedy_search(tokens_to_logits, caches, batch, max_lengths, max_output_length,
                                   select_sentences=select_sentences, beam_top_k=beam_top_k)
    return (tokens[:, None], scores[:, None]) if num_results else (tokens, scores)
  return beam_search(tokens_to_logits, caches, batch, max_lengths, max_output_length, beam_size,
                     length_penalty_alpha, reorder_cache=reorder_cache, beam_top_k=beam_top_k,
                     num_results=num_results, select_sentences=select_sentences, stop=beam_stop)


@functools.lru_cache(maxsize=None)
def jitted_translate(model, beam_size: int, length_penalty_alpha: float, max_extra_length: int,
                     max_output_length: int, beam_top_k: str = 'lax', num_results: int | None = None,
                     beam_stop: str = 'bound'):
  """One compiled predict step per (model, beam, α, lengths, top-k, results, stopping rule); cached across
  calls."""
  return jax.jit(functools.partial(translate_batch, model=model, beam_size=beam_size,
                                   length_penalty_alpha=length_penalty_alpha,
                                   max_extra_length=max_extra_length, max_output_length=max_output_length,
                                   beam_top_k=beam_top_k, num_results=num_results, beam_stop=beam_stop))


def decode_length(source_length: int, max_extra_length: int, max_positions: int) -> int:
  """A static output length for a padded source length, rounded up to limit recompilation."""
  need = source_length + max_extra_length
  return int(min(max_positions, int(np.ceil(need / 16.0) * 16)))
