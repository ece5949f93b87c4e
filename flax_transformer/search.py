"""Decoding strategies over slots: §6.1 beam search with the GNMT length penalty, greedy search, and sampling.

A strategy decodes a fixed number of slots, each one sentence's hypotheses at its own step, so that a slot
whose sentence is done can take the next sentence while the others go on (engine.py keeps them full). Each is
one class with the same five pure functions (`Strategy`): the state of empty slots, a sentence started in
chosen slots, one step of every slot, which slots are done, and their results; a new strategy is one more
class and a function building it from the decoding settings, registered under its name (`registered`; the
name also goes in decoding_settings.STRATEGIES, which config, flags and the Translator accept). A step
drives the model through a callback `tokens_to_logits(ids [S·n, 1], steps [S], cache) -> (logits [S·n, v],
cache)`, so any model (or a hand-made table in tests) can drive it: hypotheses of slot i
occupy rows i·n … i·n+n-1, at position steps[i]. When beams are reordered, `reorder_cache(cache, rows [S·n])`
makes each hypothesis continue its parent's; the default gathers every leaf whose leading dimension is S·n and
leaves the others alone; the Transformer's reorders only each hypothesis's ancestry table (model.py).
"""

import dataclasses

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
  """Default `reorder_cache`: leaves with leading dimension len(rows) take rows `rows` [S·n]; others stay."""
  def gather(x):
    if x.ndim and x.shape[0] == rows.shape[0]:
      return jnp.take(x, rows, axis=0)
    return x
  return jax.tree_util.tree_map(gather, tree)


def _written(tokens: jax.Array, positions: jax.Array, values: jax.Array) -> jax.Array:
  """tokens [S, ..., L+1] with each slot's `values` [S, ...] at its own position `positions` [S] (one past the
  end: unchanged)."""
  at = jnp.arange(tokens.shape[-1]) == positions.reshape((-1,) + (1,) * (tokens.ndim - 1))  # [S, 1.., L+1]
  return jnp.where(at, values[..., None], tokens)


def _set_rows(x: jax.Array, rows: jax.Array, value) -> jax.Array:
  """x with slots `rows` [P] set to `value`; a row index of len(x) (a padding row) is left out."""
  return x.at[rows].set(value, mode='drop')


def sentence_inputs(count: int, length: int, keys=None, prefixes=None, constraints=None,
                    constraint_shape: tuple[int, int] = (1, 1)) -> dict:
  """What `count` sentences bring to Strategy.start for outputs of up to `length` tokens: keys [count, 2]
  uint32 (default zeros); their prefixes (lists of ids, default none) as 'prefix' [count, length + 1] int32 and
  'prefix_lengths' [count]; their constraints (per sentence a list of phrases, each a list of ids; default none)
  as 'phrases' [count, C, P] int32 and 'phrase_lengths' [count, C] (0: no phrase), (C, P) = constraint_shape
  (constraint_shape); numpy arrays."""
  prefix, lengths = np.zeros((count, length + 1), np.int32), np.zeros((count,), np.int32)
  for i, ids in enumerate(prefixes or ()):
    prefix[i, :len(ids)], lengths[i] = ids, len(ids)
  phrases, phrase_lengths = np.zeros((count, *constraint_shape), np.int32), np.zeros((count, constraint_shape[0]), np.int32)
  for i, sentence_phrases in enumerate(constraints or ()):
    for c, ids in enumerate(sentence_phrases):
      phrases[i, c, :len(ids)], phrase_lengths[i, c] = ids, len(ids)
  keys = np.zeros((count, 2), np.uint32) if keys is None else np.asarray(keys, np.uint32)
  return {'keys': keys, 'prefix': prefix, 'prefix_lengths': lengths, 'phrases': phrases,
          'phrase_lengths': phrase_lengths}


def constraint_shape(constraints) -> tuple[int, int] | None:
  """The static (phrases, tokens a phrase) a constrained search of these constraints (per sentence a list of
  phrases, each a list of ids) runs with, each a power of two (a few shapes, a few compilations); None where no
  sentence has one."""
  counts = [len(phrases) for phrases in constraints or ()]
  if not any(counts):
    return None
  longest = max(len(ids) for phrases in constraints for ids in phrases)
  return 1 << (max(counts) - 1).bit_length(), 1 << (longest - 1).bit_length()


def _prefix_state(slots: int, length: int) -> dict:
  return {'prefix': jnp.zeros((slots, length + 1), jnp.int32), 'prefix_lengths': jnp.zeros((slots,), jnp.int32)}


def _start_prefix(state: dict, rows, given: dict) -> dict:
  return {'prefix': _set_rows(state['prefix'], rows, given['prefix']),
          'prefix_lengths': _set_rows(state['prefix_lengths'], rows, given['prefix_lengths'])}


def forced(state: dict, logits: jax.Array, width: int):
  """A step's logits [S·n, v] in slots still inside their prefix: every token but the prefix's next one at
  IMPOSSIBLE_SCORE. Returns (those logits, forcing [S·n, 1] bool, the raw logits' log-normaliser [S·n, 1] where
  forcing), the normaliser computed only on steps where some slot is forcing."""
  step = state['step']
  forcing = jnp.repeat(step < state['prefix_lengths'], width)[:, None]  # [Sn, 1]
  token = jnp.repeat(jnp.take_along_axis(state['prefix'], step[:, None], axis=1), width, axis=0)  # [Sn, 1]

  def force(logits):
    allowed = ~forcing | (jnp.arange(logits.shape[-1]) == token)
    return jnp.where(allowed, logits, IMPOSSIBLE_SCORE), jax.nn.logsumexp(logits, axis=-1, keepdims=True)
  masked, normaliser = jax.lax.cond(jnp.any(forcing), force,
                                    lambda logits: (logits, jnp.zeros(forcing.shape, logits.dtype)), logits)
  return masked, forcing, normaliser


class Strategy:
  """How each slot decodes its sentence: one class per strategy, with these pure functions of the search state
  (a dict of [S, ...] arrays plus the model's 'cache'), all jit-compatible. `width` is the hypotheses a slot
  holds (rows of the model's step), `kept` the results it returns."""
  width = 1
  kept = 1
  random = False  # draws random numbers: each sentence needs its own key (sentence_keys)

  def initial(self, slots: int, length: int) -> dict:
    """The state of `slots` empty slots (each done) for outputs of up to `length` tokens; no 'cache'."""
    raise NotImplementedError

  def start(self, state: dict, rows: jax.Array, max_lengths: jax.Array, given: dict) -> dict:
    """Slots `rows` [P] (len(slots): a padding row, left out) begin a sentence that may produce up to
    `max_lengths` [P] tokens, EOS included (0: none, the slot is done at once). `given` (sentence_inputs):
    'keys' [P, 2] uint32, each sentence's random key (sentence_keys) for a strategy that draws (`random`);
    'prefix' [P, L + 1] and 'prefix_lengths' [P], the tokens its output must begin with (`prefixed`)."""
    raise NotImplementedError

  def step(self, state: dict, tokens_to_logits, reorder_cache) -> dict:
    """One step of every slot; a done slot's results stay as they are."""
    raise NotImplementedError

  def done(self, state: dict) -> jax.Array:
    """[S] bool: the slot's results are final."""
    raise NotImplementedError

  def output(self, state: dict) -> tuple[jax.Array, jax.Array]:
    """(tokens [S, kept, L] int32, ending with EOS unless cut at the length limit, 0-padded; scores [S, kept]),
    best first."""
    raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class BeamSearch(Strategy):
  """Beam search returning each sentence's best hypothesis, or its `num_results` best.

  beam_size: n. length_penalty_alpha: the length penalty's exponent α (0 = none). beam_top_k: how each row's
  best tokens are found ('two_stage' or 'lax'; see top_k). num_results: None for the best hypothesis alone;
  k ≤ n for the k best, the search then running until the k-th best finished one (not only the best) beats
  every live one. stop: when a sentence is done (its results final). 'bound' (tensor2tensor): once its k-th
  best ended hypothesis scores at least what its best live one would at the length limit with no further loss,
  so the result is that of searching to the limit. 'beam_ended' (fairseq, CTranslate2): once n hypotheses have
  ended, a hypothesis counting as ended only when it is among the n best extensions of its step (an ending
  extension ranked below them is dropped).
  """
  beam_size: int = 4
  length_penalty_alpha: float = 0.6
  beam_top_k: str = 'lax'
  num_results: int | None = None
  stop: str = 'bound'
  eos_id: int = EOS_ID
  prefixed: bool = False  # sentences may bring prefixes (`forced`); False: the step has no forcing at all

  def __post_init__(self):
    if not 1 <= (self.num_results or 1) <= self.beam_size:
      raise ValueError(f'num_results={self.num_results} must be between 1 and the beam size {self.beam_size}')
    if self.stop not in BEAM_STOPS:
      raise ValueError(f'stop={self.stop!r}: use one of {BEAM_STOPS}')

  width = property(lambda self: self.beam_size)
  kept = property(lambda self: self.num_results or 1)

  def initial(self, slots, length):
    n = self.beam_size
    return {
        'step': jnp.zeros((slots,), jnp.int32),
        'max_lengths': jnp.zeros((slots,), jnp.int32),  # 0: an empty slot, done
        'live_tokens': jnp.zeros((slots, n, length + 1), jnp.int32),  # position 0: the start symbol
        'live_scores': jnp.full((slots, n), IMPOSSIBLE_SCORE, jnp.float32),  # [S, n]
        'finished_tokens': jnp.zeros((slots, n, length + 1), jnp.int32),
        'finished_scores': jnp.full((slots, n), IMPOSSIBLE_SCORE, jnp.float32),  # length-penalised
        **_prefix_state(slots, length),
    }

  def start(self, state, rows, max_lengths, given):
    """One live hypothesis (the start symbol), none finished."""
    first = jnp.array([0.0] + [IMPOSSIBLE_SCORE] * (self.beam_size - 1), jnp.float32)
    return {**state, **_start_prefix(state, rows, given), 'step': _set_rows(state['step'], rows, 0),
            'max_lengths': _set_rows(state['max_lengths'], rows, max_lengths),
            'live_tokens': _set_rows(state['live_tokens'], rows, 0),
            'live_scores': _set_rows(state['live_scores'], rows, first),
            'finished_tokens': _set_rows(state['finished_tokens'], rows, 0),
            'finished_scores': _set_rows(state['finished_scores'], rows, IMPOSSIBLE_SCORE)}

  def done(self, state):
    n, kept = self.beam_size, self.kept
    if self.stop == 'beam_ended':  # n hypotheses have ended (an unfilled slot holds IMPOSSIBLE_SCORE)
      ended = state['finished_scores'][:, n - 1] > IMPOSSIBLE_SCORE / 2
    else:  # no live hypothesis can still beat the k-th best finished one
      best_live_bound = jnp.max(state['live_scores'], axis=1) / length_penalty(state['max_lengths'], self.length_penalty_alpha)
      ended = state['finished_scores'][:, kept - 1] >= best_live_bound
    return ended | (state['step'] >= state['max_lengths'])

  def step(self, state, tokens_to_logits, reorder_cache=gather_leading_rows):
    """Every live hypothesis extended by its best tokens, the n best that go on kept live (the cache reordered
    to them), those that end merged into the n best finished, unless the slot was already done. With
    stop='beam_ended' only extensions among the step's n best may end (the others that end are dropped)."""
    n, alpha = self.beam_size, self.length_penalty_alpha
    step, limits = state['step'], state['max_lengths']  # [S] each
    slots, done = step.shape[0], self.done(state)
    ids = jnp.take_along_axis(state['live_tokens'], step[:, None, None], axis=2).reshape(slots * n, 1)  # [Sn, 1]
    logits, new_cache = tokens_to_logits(ids, step, state['cache'])
    forcing = normaliser = None
    if self.prefixed:
      logits, forcing, normaliser = forced(state, logits.astype(jnp.float32), n)
    top_scores, top_beam, top_token = _extensions(state['live_scores'], logits, n, self.beam_top_k, forcing,
                                                  normaliser)  # [S, 2n] each
    top_tokens = jnp.take_along_axis(state['live_tokens'], top_beam[:, :, None], axis=1)  # [S, 2n, L+1]
    top_tokens = _written(top_tokens, step + 1, top_token)
    ends = (top_token == self.eos_id) | (step + 1 >= limits)[:, None]  # [S, 2n]: EOS, or the length limit
    live_scores, live_pick = jax.lax.top_k(jnp.where(ends, IMPOSSIBLE_SCORE, top_scores), n)  # [S, n]: go on
    live_beam = jnp.take_along_axis(top_beam, live_pick, axis=1)  # [S, n]
    parent_rows = (live_beam + jnp.arange(slots)[:, None] * n).reshape(slots * n)  # [Sn]
    counted = ends & ~done[:, None]  # [S, 2n]
    if self.stop == 'beam_ended':  # the n best (top_scores is sorted), not extensions of step 0's unfilled beams
      counted &= (jnp.arange(2 * n) < n) & (top_scores > IMPOSSIBLE_SCORE / 2)
    ended_scores = jnp.where(counted, top_scores / length_penalty(step + 1, alpha)[:, None], IMPOSSIBLE_SCORE)
    finished_scores, finished_tokens = _best_finished(state['finished_scores'], state['finished_tokens'],
                                                      ended_scores, top_tokens, n)
    return {**state, 'step': jnp.where(done, step, step + 1), 'live_scores': live_scores,
            'live_tokens': jnp.take_along_axis(top_tokens, live_pick[:, :, None], axis=1),  # [S, n, L+1]
            'finished_tokens': finished_tokens, 'finished_scores': finished_scores,
            'cache': reorder_cache(new_cache, parent_rows)}

  def output(self, state):
    kept = self.kept
    return state['finished_tokens'][:, :kept, 1:], state['finished_scores'][:, :kept]  # [S, k, L], [S, k]


def _extensions(live_scores, logits, n: int, beam_top_k: str, forcing, normaliser):
  """The 2n best one-token extensions of each sentence's n live hypotheses (2n always include n that do not
  end): live_scores [S, n], logits [S·n, v] (`forced`'s, with its `forcing` rows and their `normaliser`) ->
  (scores [S, 2n], parent beam [S, 2n], token [S, 2n])."""
  slots = live_scores.shape[0]
  # The sentence's best 2n extensions are among each hypothesis's best 2n tokens, and log-softmax keeps a row's
  # order: pick per row on the logits, normalise only the picks (no [Sn, v] log-prob array). Padding is never
  # produced.
  per_row = min(2 * n, logits.shape[-1] - 1)
  row_logits, row_tokens, log_normalizer = best_tokens(logits.astype(jnp.float32), per_row, beam_top_k)  # [Sn, k]
  if forcing is not None:  # a forced token scores under the raw logits
    log_normalizer = jnp.where(forcing, normaliser, log_normalizer)
  row_log_probs = (row_logits - log_normalizer).reshape(slots, n, per_row)  # [S, n, k]
  candidates = (live_scores[:, :, None] + row_log_probs).reshape(slots, n * per_row)  # [S, n·k]
  top_scores, top_index = jax.lax.top_k(candidates, 2 * n)  # [S, 2n]
  top_token = jnp.take_along_axis(row_tokens.reshape(slots, n * per_row), top_index, axis=1)  # [S, 2n]
  return top_scores, top_index // per_row, top_token


def _best_finished(finished_scores, finished_tokens, ended_scores, ended_tokens, n: int):
  """The n best finished hypotheses: those kept so far ([S, n], [S, n, L+1]) merged with those that end at
  this step ([S, 2n] length-penalised, [S, 2n, L+1]; the others at IMPOSSIBLE_SCORE)."""
  merged_scores = jnp.concatenate([finished_scores, ended_scores], axis=1)  # [S, 3n]
  merged_tokens = jnp.concatenate([finished_tokens, ended_tokens], axis=1)  # [S, 3n, L+1]
  scores, pick = jax.lax.top_k(merged_scores, n)  # [S, n]
  return scores, jnp.take_along_axis(merged_tokens, pick[:, :, None], axis=1)


NOT_MET = 2 ** 30  # ConstrainedBeamSearch's 'met_at' of a phrase not (yet) in the output
UNMET = IMPOSSIBLE_SCORE / 10  # added to the rank of an output cut at the length limit before meeting every phrase


def _suffix_matches(window: jax.Array, window_start: jax.Array, phrases: jax.Array, phrase_lengths: jax.Array):
  """How much of each phrase each hypothesis's output ends with: window [S, M, P] (its last P tokens, the first
  at position window_start [S]; positions < 1 hold no output token), phrases [S, C, P] and their lengths [S, C]
  -> [S, M, C]: the longest k such that the output's last k tokens are the phrase's first k (KMP's state, read
  off the window, so a phrase is found wherever it occurs, overlaps included)."""
  p = window.shape[-1]
  k = jnp.arange(1, p + 1)[:, None]  # [P(k), 1]: a suffix's length
  j = jnp.arange(p)[None, :]  # [1, P(j)]: a position in the phrase
  index = jnp.clip(p - k + j, 0, p - 1)  # [P(k), P(j)]: the window's token compared with phrase token j
  relevant = j < k
  exists = (window_start[:, None] + jnp.arange(p)) >= 1  # [S, P]
  suffixes = window[:, :, index]  # [S, M, P(k), P(j)]
  equal = (suffixes[:, :, None] == phrases[:, None, :, None, :]) & exists[:, index][:, None, None]  # [S, M, C, Pk, Pj]
  matches = jnp.all(equal | ~relevant, axis=-1) & (k[:, 0] <= phrase_lengths[:, None, :, None])  # [S, M, C, Pk]
  return jnp.max(jnp.where(matches, k[:, 0], 0), axis=-1)  # [S, M, C]


def _ranks(scores: jax.Array, groups: jax.Array, eligible: jax.Array) -> jax.Array:
  """Each candidate's rank by score [S, M] among the eligible candidates of its group (groups [S, M]; ties: the
  earlier first)."""
  m = scores.shape[1]
  earlier = jnp.arange(m)[None, :] < jnp.arange(m)[:, None]  # [M(i), M(j)]: j before i
  better = (scores[:, None, :] > scores[:, :, None]) | ((scores[:, None, :] == scores[:, :, None]) & earlier)
  return jnp.sum(better & eligible[:, None, :] & (groups[:, None, :] == groups[:, :, None]), axis=-1)


@dataclasses.dataclass(frozen=True)
class ConstrainedBeamSearch(BeamSearch):
  """Beam search whose outputs contain given phrases (lexical constraints): Hu et al. (2019), "Improved Lexically
  Constrained Decoding for Translation and Monolingual Rewriting", dynamic beam allocation as fairseq's
  LexicallyConstrainedBeamSearch. Chosen over grid beam search (Hokamp & Liu, 2017), whose beam grows with the
  constraints' tokens, and over Post & Vilar's (2018) first DBA, whose candidates are the same but whose
  bookkeeping is per hypothesis on the host: here it is arrays of fixed shape, one compiled step for any
  constraints.

  Each step's candidates are the sentence's 2n best extensions, each hypothesis's best token and each
  hypothesis's next token of every phrase it has not met; each candidate's progress (the tokens of met phrases
  plus those of the phrase under way) puts it in a bank, and the n that go on are taken from the banks in turn,
  most progress first, each bank's best first, so hypotheses that met more constraints are kept beside those
  that score best. A hypothesis may end (EOS) only once it has met every phrase; one cut at the length limit
  ends as it is, ranked below every output that met them all. A phrase is met where its tokens occur in a row in the output (wherever it begins: each
  hypothesis keeps, per phrase, how much of it the output ends with); `ordered`: only after the previous phrase
  ended (fairseq's ordered constraints). `phrases`, `phrase_length`: the static shape (constraint_shape) of a
  slot's phrases; a slot with none searches as BeamSearch does.
  """
  phrases: int = 1
  phrase_length: int = 1
  ordered: bool = False

  def initial(self, slots, length):
    n, c, p = self.beam_size, self.phrases, self.phrase_length
    return {**super().initial(slots, length), 'phrases': jnp.zeros((slots, c, p), jnp.int32),
            'phrase_lengths': jnp.zeros((slots, c), jnp.int32),
            'matched': jnp.zeros((slots, n, c), jnp.int32),  # [S, n, C]: how much of each phrase the output ends with
            'met_at': jnp.full((slots, n, c), NOT_MET, jnp.int32),  # [S, n, C]: where each phrase was first met
            'finished_raw': jnp.full((slots, n), IMPOSSIBLE_SCORE, jnp.float32)}  # [S, n]: their scores

  def start(self, state, rows, max_lengths, given):
    state = super().start(state, rows, max_lengths, given)
    return {**state, 'phrases': _set_rows(state['phrases'], rows, given['phrases']),
            'phrase_lengths': _set_rows(state['phrase_lengths'], rows, given['phrase_lengths']),
            'matched': _set_rows(state['matched'], rows, 0), 'met_at': _set_rows(state['met_at'], rows, NOT_MET),
            'finished_raw': _set_rows(state['finished_raw'], rows, IMPOSSIBLE_SCORE)}

  def output(self, state):
    kept = self.kept
    return state['finished_tokens'][:, :kept, 1:], state['finished_raw'][:, :kept]  # [S, k, L], [S, k]

  def step(self, state, tokens_to_logits, reorder_cache=gather_leading_rows):
    n, alpha, p = self.beam_size, self.length_penalty_alpha, self.phrase_length
    step, limits, live_scores = state['step'], state['max_lengths'], state['live_scores']  # [S], [S], [S, n]
    phrases, phrase_lengths = state['phrases'], state['phrase_lengths']  # [S, C, P], [S, C]
    slots, done = step.shape[0], self.done(state)
    ids = jnp.take_along_axis(state['live_tokens'], step[:, None, None], axis=2).reshape(slots * n, 1)  # [Sn, 1]
    logits, new_cache = tokens_to_logits(ids, step, state['cache'])
    logits = logits.astype(jnp.float32)
    forcing = normaliser = None
    if self.prefixed:
      logits, forcing, normaliser = forced(state, logits, n)
    per_row = min(2 * n, logits.shape[-1] - 1)
    row_logits, row_tokens, log_normalizer = best_tokens(logits, per_row, self.beam_top_k)  # [Sn, k], [Sn, 1]
    if forcing is not None:
      log_normalizer = jnp.where(forcing, normaliser, log_normalizer)
    row_log_probs = (row_logits - log_normalizer).reshape(slots, n, per_row)  # [S, n, k]
    row_tokens = row_tokens.reshape(slots, n, per_row)
    # The candidates [S, M]: the 2n best extensions, each hypothesis's best token, its next token of each phrase.
    best_scores, best_index = jax.lax.top_k((live_scores[:, :, None] + row_log_probs).reshape(slots, -1), 2 * n)
    met = (state['met_at'] < NOT_MET) | (phrase_lengths[:, None, :] == 0)  # [S, n, C]
    wanted = ~met
    if self.ordered:  # only the first phrase not met
      wanted &= jnp.cumsum(wanted, axis=-1) == 1
    next_tokens = jnp.take_along_axis(phrases[:, None], jnp.minimum(state['matched'], p - 1)[..., None],
                                      axis=3)[..., 0]  # [S, n, C]
    next_log_probs = (jnp.take_along_axis(logits.reshape(slots, n, -1), next_tokens, axis=2)
                      - log_normalizer.reshape(slots, n, 1))  # [S, n, C]
    hypotheses = jnp.broadcast_to(jnp.arange(n)[None, :, None], next_tokens.shape)  # [S, n, C]
    scores = jnp.concatenate([best_scores, live_scores + row_log_probs[:, :, 0],
                              jnp.where(wanted, live_scores[:, :, None] + next_log_probs, IMPOSSIBLE_SCORE
                                        ).reshape(slots, -1)], axis=1)  # [S, M]
    beams = jnp.concatenate([best_index // per_row, hypotheses[:, :, 0], hypotheses.reshape(slots, -1)], axis=1)
    tokens = jnp.concatenate([jnp.take_along_axis(row_tokens.reshape(slots, -1), best_index, axis=1),
                              row_tokens[:, :, 0], next_tokens.reshape(slots, -1)], axis=1)  # [S, M]
    written = _written(jnp.take_along_axis(state['live_tokens'], beams[:, :, None], axis=1), step + 1,
                       tokens)  # [S, M, L+1]
    # Each candidate's phrases: how much of each its output now ends with, where each was first met.
    window_start = step + 2 - p  # [S]: the first of the output's last p positions (step + 1: the new token)
    window = jnp.take_along_axis(written, jnp.clip(window_start[:, None] + jnp.arange(p), 0)[:, None, :], axis=2)
    matched = _suffix_matches(window, window_start, phrases, phrase_lengths)  # [S, M, C]
    met_at = jnp.take_along_axis(state['met_at'], beams[:, :, None], axis=1)  # [S, M, C]
    completes = (matched == phrase_lengths[:, None, :]) & (phrase_lengths[:, None, :] > 0) & (met_at == NOT_MET)
    if self.ordered:  # the previous phrase ended before this one began
      previous = jnp.concatenate([jnp.full_like(met_at[..., :1], -1), met_at[..., :-1]], axis=-1)
      completes &= (previous <= (step + 1)[:, None, None] - phrase_lengths[:, None, :]) | (
          phrase_lengths[:, None, :] == 0)
    met_at = jnp.where(completes, (step + 1)[:, None, None], met_at)
    met = (met_at < NOT_MET) | (phrase_lengths[:, None, :] == 0)  # [S, M, C]
    under_way = ~met & ((jnp.cumsum(~met, axis=-1) == 1) if self.ordered else True)
    progress = (jnp.sum(jnp.where(met, phrase_lengths[:, None, :], 0), axis=-1)
                + jnp.max(jnp.where(under_way, matched, 0), axis=-1))  # [S, M]: the bank
    # Which candidates may be taken: possible, not one already listed, no EOS before every phrase is met.
    m = scores.shape[1]
    possible = scores > IMPOSSIBLE_SCORE / 2
    same = (beams[:, :, None] == beams[:, None, :]) & (tokens[:, :, None] == tokens[:, None, :])  # [S, M(i), M(j)]
    repeated = jnp.any(same & possible[:, None, :] & (jnp.arange(m)[None, :] < jnp.arange(m)[:, None]), axis=-1)
    valid = possible & ~repeated & ~((tokens == self.eos_id) & ~jnp.all(met, axis=-1))  # [S, M]
    ends = (tokens == self.eos_id) | (step + 1 >= limits)[:, None]  # [S, M]
    # The step's 2n: the banks in turn, the best of each bank (most progress first), then the second of each, ...
    # (without constraints: the 2n best, as BeamSearch's). Those that end are finished, the first n others go on.
    total = self.phrases * self.phrase_length
    turn = jnp.where(valid, _ranks(scores, progress, valid) * (total + 1) + (total - progress), NOT_MET)  # distinct
    turns, chosen = jax.lax.top_k(-turn, 2 * n)  # [S, 2n], in turn
    chosen_valid, chosen_ends = -turns < NOT_MET, jnp.take_along_axis(ends, chosen, axis=1)
    order, first = jax.lax.top_k(-jnp.where(chosen_valid & ~chosen_ends, jnp.arange(2 * n), NOT_MET), n)  # [S, n]
    live_pick = jnp.take_along_axis(chosen, first, axis=1)  # [S, n]
    live_scores = jnp.where(-order < NOT_MET, jnp.take_along_axis(scores, live_pick, axis=1), IMPOSSIBLE_SCORE)
    parent_rows = (jnp.take_along_axis(beams, live_pick, axis=1) + jnp.arange(slots)[:, None] * n).reshape(-1)
    counted = chosen_valid & chosen_ends & ~done[:, None]  # [S, 2n]
    if self.stop == 'beam_ended':  # among the step's first n
      counted &= jnp.arange(2 * n) < n
    ended_scores = jnp.where(counted, jnp.take_along_axis(scores, chosen, axis=1)
                             / length_penalty(step + 1, alpha)[:, None], IMPOSSIBLE_SCORE)  # [S, 2n]
    ended_met = jnp.take_along_axis(jnp.all(met, axis=-1), chosen, axis=1)  # [S, 2n]
    # The n best finished, those that met every phrase first ('finished_scores' ranks, 'finished_raw' is the score).
    ranking = jnp.concatenate([state['finished_scores'], jnp.where(ended_met, ended_scores, ended_scores + UNMET)], 1)
    finished_scores, merged = jax.lax.top_k(ranking, n)  # [S, n]
    finished = lambda old, new: jnp.take_along_axis(jnp.concatenate([old, new], axis=1),
                                                    merged.reshape(merged.shape + (1,) * (old.ndim - 2)), axis=1)
    pick = live_pick[:, :, None]
    return {**state, 'step': jnp.where(done, step, step + 1), 'live_scores': live_scores,
            'live_tokens': jnp.take_along_axis(written, pick, axis=1), 'finished_scores': finished_scores,
            'finished_raw': finished(state['finished_raw'], ended_scores),
            'finished_tokens': finished(state['finished_tokens'], jnp.take_along_axis(written, chosen[:, :, None], 1)),
            'matched': jnp.take_along_axis(matched, pick, axis=1),
            'met_at': jnp.take_along_axis(met_at, pick, axis=1), 'cache': reorder_cache(new_cache, parent_rows)}


@dataclasses.dataclass(frozen=True)
class GreedySearch(Strategy):
  """The most probable next token at each step, until EOS or the length limit; the score is the sum of the
  chosen tokens' log-probabilities. beam_top_k: how best_tokens finds each row's best token ('two_stage': two
  passes over the logits)."""
  beam_top_k: str = 'lax'
  eos_id: int = EOS_ID
  prefixed: bool = False  # as BeamSearch's

  def initial(self, slots, length):
    return {'step': jnp.zeros((slots,), jnp.int32), 'max_lengths': jnp.zeros((slots,), jnp.int32),
            'tokens': jnp.zeros((slots, length + 1), jnp.int32), 'ended': jnp.ones((slots,), bool),
            'scores': jnp.zeros((slots,), jnp.float32), **_prefix_state(slots, length)}

  def start(self, state, rows, max_lengths, given):
    return {**state, **_start_prefix(state, rows, given), 'step': _set_rows(state['step'], rows, 0),
            'max_lengths': _set_rows(state['max_lengths'], rows, max_lengths),
            'tokens': _set_rows(state['tokens'], rows, 0), 'ended': _set_rows(state['ended'], rows, max_lengths <= 0),
            'scores': _set_rows(state['scores'], rows, 0.0)}

  def done(self, state):
    return state['ended'] | (state['step'] >= state['max_lengths'])

  def step(self, state, tokens_to_logits, reorder_cache=gather_leading_rows):
    step, done = state['step'], self.done(state)
    ids = jnp.take_along_axis(state['tokens'], step[:, None], axis=1)  # [S, 1]
    logits, cache = tokens_to_logits(ids, step, state['cache'])  # [S, v]
    if self.prefixed:
      logits, forcing, normaliser = forced(state, logits.astype(jnp.float32), 1)
    best, token, log_normalizer = best_tokens(logits.astype(jnp.float32), 1, self.beam_top_k)  # [S, 1]: no padding
    if self.prefixed:
      log_normalizer = jnp.where(forcing, normaliser, log_normalizer)
    token, log_prob = token[:, 0], best[:, 0] - log_normalizer[:, 0]  # [S]: log-softmax keeps the row's order
    token = jnp.where(done, PAD_ID, token)
    ended = done | (token == self.eos_id) | (step + 1 >= state['max_lengths'])
    return {**state, 'step': jnp.where(done, step, step + 1), 'ended': ended, 'cache': cache,
            'tokens': jnp.where(done[:, None], state['tokens'], _written(state['tokens'], step + 1, token)),
            'scores': state['scores'] + jnp.where(done, 0.0, log_prob)}

  def output(self, state):
    return state['tokens'][:, None, 1:], state['scores'][:, None]  # [S, 1, L], [S, 1]


@dataclasses.dataclass(frozen=True)
class SamplingSearch(Strategy):
  """Each slot draws `num_samples` translations of its sentence, token by token from the model's distribution:
  the logits divided by `temperature`, then cut to the `top_k` most probable tokens (0: all), then to the most
  probable whose probabilities add up to `top_p` (the token that crosses p included; 1: all), renormalised
  (fairseq's and CTranslate2's order); the padding token is never drawn. A sample's score is its
  log-probability under the model itself (temperature 1, nothing cut). The random bits of sample j of a
  sentence at step t come from the sentence's key (start's `keys`) folded with j and t: the same samples
  whatever slot, batch, device or process the sentence lands in. Samples are returned in their order."""
  num_samples: int = 1
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  eos_id: int = EOS_ID
  prefixed: bool = False  # as BeamSearch's
  random = True

  width = property(lambda self: self.num_samples)
  kept = property(lambda self: self.num_samples)

  def initial(self, slots, length):
    k = self.num_samples
    return {'step': jnp.zeros((slots,), jnp.int32), 'max_lengths': jnp.zeros((slots,), jnp.int32),
            'tokens': jnp.zeros((slots, k, length + 1), jnp.int32), 'ended': jnp.ones((slots, k), bool),
            'scores': jnp.zeros((slots, k), jnp.float32), 'keys': jnp.zeros((slots, 2), jnp.uint32),
            **_prefix_state(slots, length)}

  def start(self, state, rows, max_lengths, given):
    return {**state, **_start_prefix(state, rows, given), 'step': _set_rows(state['step'], rows, 0),
            'max_lengths': _set_rows(state['max_lengths'], rows, max_lengths),
            'tokens': _set_rows(state['tokens'], rows, 0),
            'ended': _set_rows(state['ended'], rows, (max_lengths <= 0)[:, None]),
            'scores': _set_rows(state['scores'], rows, 0.0), 'keys': _set_rows(state['keys'], rows, given['keys'])}

  def done(self, state):
    return jnp.all(state['ended'], axis=1) | (state['step'] >= state['max_lengths'])

  def sampled_logits(self, log_probs: jax.Array) -> jax.Array:
    """log_probs [..., v] -> the logits drawn from: tempered, cut to top_k then top_p (-inf outside), no PAD."""
    logits = jnp.where(jnp.arange(log_probs.shape[-1]) == PAD_ID, -jnp.inf, log_probs / self.temperature)
    if self.top_k:
      kth = jax.lax.top_k(logits, self.top_k)[0][..., -1:]  # [..., 1]
      logits = jnp.where(logits < kth, -jnp.inf, logits)
    if self.top_p < 1.0:
      ordered = jnp.sort(logits, axis=-1)[..., ::-1]  # descending
      probabilities = jax.nn.softmax(ordered, axis=-1)
      before = jnp.cumsum(probabilities, axis=-1) - probabilities  # the mass of the more probable tokens
      kept = jnp.where(before < self.top_p, ordered, jnp.inf)  # the nucleus: every token until p is reached
      logits = jnp.where(logits < jnp.min(kept, axis=-1, keepdims=True), -jnp.inf, logits)
    return logits

  def step(self, state, tokens_to_logits, reorder_cache=gather_leading_rows):
    step, done = state['step'], self.done(state)
    slots, k = state['ended'].shape
    ids = jnp.take_along_axis(state['tokens'], step[:, None, None], axis=2).reshape(slots * k, 1)  # [Sk, 1]
    logits, cache = tokens_to_logits(ids, step, state['cache'])  # [Sk, v]
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1).reshape(slots, k, -1)  # [S, k, v]
    keys = jax.random.wrap_key_data(state['keys'], impl='threefry2x32')  # [S]

    def draw(key, sample, position, row_logits):  # one sample's token
      return jax.random.categorical(jax.random.fold_in(jax.random.fold_in(key, sample), position), row_logits)
    drawn_from = self.sampled_logits(log_probs)
    if self.prefixed:  # the prefix's token, whatever the cut
      masked, forcing, _ = forced(state, log_probs.reshape(slots * k, -1), k)
      drawn_from = jnp.where(forcing.reshape(slots, k, 1), masked.reshape(slots, k, -1), drawn_from)
    token = jax.vmap(jax.vmap(draw, (None, 0, None, 0)), (0, None, 0, 0))(
        keys, jnp.arange(k), step, drawn_from)  # [S, k]: the prefix's token while inside it
    stopped = state['ended'] | done[:, None]  # [S, k]
    token = jnp.where(stopped, PAD_ID, token).astype(jnp.int32)
    log_prob = jnp.take_along_axis(log_probs, token[:, :, None], axis=2)[:, :, 0]
    ended = stopped | (token == self.eos_id) | (step + 1 >= state['max_lengths'])[:, None]
    written = _written(state['tokens'].reshape(slots * k, -1), jnp.repeat(step + 1, k), token.reshape(-1))
    return {**state, 'step': jnp.where(done, step, step + 1), 'ended': ended, 'cache': cache,
            'tokens': jnp.where(stopped[:, :, None], state['tokens'], written.reshape(state['tokens'].shape)),
            'scores': state['scores'] + jnp.where(stopped, 0.0, log_prob)}

  def output(self, state):
    return state['tokens'][:, :, 1:], state['scores']  # [S, k, L], [S, k]


def sentence_keys(seed: int, numbers) -> np.ndarray:
  """[len(numbers), 2] uint32: the random key of each sentence, from the seed and the sentence's number alone (an
  int, or a tuple such as (line, piece)), so its samples do not depend on where or with what it is decoded."""
  return np.stack([np.random.SeedSequence([seed, *(n if isinstance(n, tuple) else (n,))]).generate_state(2)
                   for n in numbers]).astype(np.uint32).reshape(-1, 2)


STRATEGIES = {}  # decoding_settings.STRATEGIES' names -> (DecodeSettings, num_results, prefixed, constraint_shape)
# -> Strategy


def registered(name: str):
  """A decorator registering a function that builds the strategy `name` from the decoding settings."""
  def register(build):
    STRATEGIES[name] = build
    return build
  return register


def _unconstrained(name: str, constraint_shape) -> None:
  if constraint_shape:
    from flax_transformer.errors import ArgumentError
    raise ArgumentError(f'constraints are met by beam search and the strategy is {name!r}; give strategy=beam '
                        f'(--strategy=beam) with them, or leave the constraints out')


@registered('beam')
def _beam(decoding, num_results, prefixed, constraint_shape):
  if constraint_shape:  # a beam of 1 too: its one hypothesis still takes the constraints' tokens
    return ConstrainedBeamSearch(decoding.beam_size, decoding.length_penalty_alpha, decoding.beam_top_k,
                                 num_results, decoding.beam_stop, prefixed=prefixed, phrases=constraint_shape[0],
                                 phrase_length=constraint_shape[1], ordered=decoding.constraint_order == 'ordered')
  if decoding.beam_size <= 1:  # the same tokens, without a beam's bookkeeping
    return GreedySearch(decoding.beam_top_k, prefixed=prefixed)
  return BeamSearch(decoding.beam_size, decoding.length_penalty_alpha, decoding.beam_top_k, num_results,
                    decoding.beam_stop, prefixed=prefixed)


@registered('greedy')
def _greedy(decoding, num_results, prefixed, constraint_shape):
  _unconstrained('greedy', constraint_shape)
  return GreedySearch(decoding.beam_top_k, prefixed=prefixed)


@registered('sampling')
def _sampling(decoding, num_results, prefixed, constraint_shape):
  _unconstrained('sampling', constraint_shape)
  return SamplingSearch(num_results or decoding.num_samples, decoding.temperature, decoding.top_k, decoding.top_p,
                        prefixed=prefixed)


def strategy_for(decoding, num_results: int | None = None, prefixed: bool = False,
                 constraint_shape: tuple[int, int] | None = None) -> Strategy:
  """The strategy `decoding` (decoding_settings.DecodeSettings) names, built by its registered function;
  `num_results`: the k best of a beam, or k samples; `prefixed`: sentences bring target prefixes (a program of
  its own: without them a step holds no forcing); `constraint_shape`: sentences bring lexical constraints of
  this static shape (constraint_shape(...); None: none)."""
  return STRATEGIES[decoding.strategy](decoding, num_results, prefixed, constraint_shape)


def run_to_end(strategy: Strategy, tokens_to_logits, cache, max_lengths: jax.Array, max_output_length: int,
               reorder_cache=gather_leading_rows, given=None):
  """Every slot started at once with `max_lengths` [S] (capped at `max_output_length`) and what its sentence
  brings (`given`: sentence_inputs', default none) and stepped until every one is done: the strategy's
  output, (tokens [S, kept, L], scores [S, kept])."""
  max_lengths = jnp.minimum(jnp.asarray(max_lengths, jnp.int32), max_output_length)
  slots = max_lengths.shape[0]
  given = sentence_inputs(slots, max_output_length) if given is None else given
  state = strategy.start({**strategy.initial(slots, max_output_length), 'cache': cache}, jnp.arange(slots),
                         max_lengths, given)
  state = jax.lax.while_loop(lambda s: ~jnp.all(strategy.done(s)),
                             lambda s: strategy.step(s, tokens_to_logits, reorder_cache), state)
  return strategy.output(state)


def beam_search(tokens_to_logits, cache, batch: int, max_lengths, max_output_length: int, beam_size: int = 4,
                length_penalty_alpha: float = 0.6, reorder_cache=gather_leading_rows, beam_top_k: str = 'lax',
                num_results: int | None = None, stop: str = 'bound'):
  """BeamSearch run to the end on `batch` sentences at once (run_to_end): (tokens [b, L], scores [b]), or with
  num_results=k ([b, k, L], [b, k])."""
  strategy = BeamSearch(beam_size, length_penalty_alpha, beam_top_k, num_results, stop)
  tokens, scores = run_to_end(strategy, tokens_to_logits, cache, jnp.broadcast_to(max_lengths, (batch,)),
                              max_output_length, reorder_cache)
  return (tokens, scores) if num_results else (tokens[:, 0], scores[:, 0])


def greedy_search(tokens_to_logits, cache, batch: int, max_lengths, max_output_length: int, beam_top_k: str = 'lax'):
  """GreedySearch run to the end on `batch` sentences at once: (tokens [b, L], log-probabilities [b])."""
  tokens, scores = run_to_end(GreedySearch(beam_top_k), tokens_to_logits, cache,
                              jnp.broadcast_to(max_lengths, (batch,)), max_output_length)
  return tokens[:, 0], scores[:, 0]


# --- Ensembles ---------------------------------------------------------------------------

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
