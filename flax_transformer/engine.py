"""The decoding engine: a fixed number of slots, each one sentence's hypotheses at its own step, refilled from a
queue as sentences finish, so that the batch never empties until the input does.

    engine = Engine(model, params, search.BeamSearch(4, 0.6), slots=64, max_extra_length=50, max_positions=256)
    engine.run(encoded)  # per sentence: [(token ids, score), ...], best first

Three compiled programs do the work (MaxText's `prefill`, `insert` and `generate`; vLLM's continuous
batching): `encode` runs the encoder over the next `slots` sentences at once (`memory`: each layer's
encoder-decoder keys and values, once per sentence, at the length of the longest of them rounded up to 16),
`admit` starts a few of them in free slots, and `generate` steps every slot until enough are done to be worth
refilling (or all are). Between calls the host takes the done slots' results and admits the next sentences,
longest first, so the last ones to finish are short. The state is donated: admit and generate update it in
place. A translation compiles one `generate` per (slots, longest source rounded up to 16, strategy) and one
`encode` and one `admit` per source length it encodes (multiples of 16 up to the longest); fewer sentences than
slots take fewer slots (a power of two from 8).
"""

import collections
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from flax_transformer import search
from flax_transformer.constants import EOS_ID
from flax_transformer.decoding_settings import DecodeSettings

SOURCE_ROUNDING = 16  # source lengths are rounded up to a multiple of this: a few shapes, a few compilations
SMALLEST_SLOTS = 8
SLOT_AXIS = 'slots'  # the mesh axis a translation's slots are spread over (one sentence never spans devices)


def spread(state, mesh):
  """`state` with its slots spread over `mesh` (None: as it is): every leaf's slot axis (the first; the second
  of the flat self-attention cache, whose chunks come first) sharded over SLOT_AXIS."""
  if mesh is None:
    return state

  def place(path, leaf):
    axis = 1 if any(getattr(key, 'key', None) == 'self' for key in path) else 0
    spec = jax.sharding.PartitionSpec(*([None] * axis), SLOT_AXIS)
    return jax.lax.with_sharding_constraint(leaf, jax.sharding.NamedSharding(mesh, spec))
  return jax.tree_util.tree_map_with_path(place, state)


def decode_length(source_length: int, max_extra_length: int, max_positions: int) -> int:
  """A static output length for a padded source length, rounded up to limit recompilation."""
  need = source_length + max_extra_length
  return int(min(max_positions, int(np.ceil(need / 16.0) * 16)))


def _callbacks(models: tuple, member_params: tuple):
  """The strategies' (tokens_to_logits, reorder_cache) for one model or an ensemble (each member its own cache,
  the caches a tuple), decoded with search.ensemble_log_probs."""
  def tokens_to_logits(ids, steps, caches):
    outputs = [m.apply({'params': p}, ids, c, steps, method=m.decode_step)
               for m, p, c in zip(models, member_params, caches)]
    logits = outputs[0][0] if len(models) == 1 else search.ensemble_log_probs([logits for logits, _ in outputs])
    return logits, tuple(cache for _, cache in outputs)

  def reorder_cache(caches, rows):
    return tuple(type(m).reorder_cache(c, rows) for m, c in zip(models, caches))
  return tokens_to_logits, reorder_cache


def _max_lengths(inputs, max_extra_length: int, max_output_length: int):
  """inputs [P, s] -> the most tokens each may produce (§6.1: input + max_extra_length; 0 for a padding row)."""
  source_lengths = jnp.sum(inputs > 0, axis=1)  # [P]
  return jnp.minimum(jnp.where(source_lengths > 0, source_lengths + max_extra_length, 0), max_output_length)


def _caches(models, member_params, memories, width: int, max_output_length: int) -> tuple:
  return tuple(m.apply({'params': p}, memory, width, max_output_length, method=m.init_cache)
               for m, p, memory in zip(models, member_params, memories))


def empty(params, *, model, strategy: search.Strategy, slots: int, source_length: int, max_output_length: int,
          mesh=None):
  """The state of `slots` empty slots for sources of `source_length` tokens and outputs of `max_output_length`,
  spread over `mesh`."""
  models, member_params = search.members(model, params)
  inputs = jnp.zeros((slots, source_length), jnp.int32)
  memories = [jax.tree_util.tree_map(lambda x: jnp.zeros(x.shape, x.dtype),
                                     jax.eval_shape(lambda: m.apply({'params': p}, inputs, method=m.memory)))
              for m, p in zip(models, member_params)]
  return spread({**strategy.initial(slots, max_output_length),
                 'cache': _caches(models, member_params, memories, strategy.width, max_output_length)}, mesh)


def encode(params, inputs, *, model) -> tuple:
  """What the slots keep of the sentences inputs [B, w] (right-padded ids ending in EOS): each member's `memory`
  (the encoder and each layer's encoder-decoder keys and values), encoded together ahead of their admission."""
  models, member_params = search.members(model, params)
  return tuple(m.apply({'params': p}, inputs, method=m.memory) for m, p in zip(models, member_params))


def admit(params, state, memories, picks, rows, given, *, model, strategy: search.Strategy, max_extra_length: int,
          max_output_length: int, mesh=None):
  """The state with the encoded sentences `picks` [P] of `memories` (from `encode`) started in slots `rows` [P]
  (S for a padding row, left out) with what they bring (`given`: search.sentence_inputs' keys, prefixes and phrases,
  [P, ...] each); each may produce its source length (EOS included) + max_extra_length tokens."""
  del params
  models, _ = search.members(model, ())
  chosen = tuple(jax.tree_util.tree_map(lambda x: x[picks], memory) for memory in memories)
  caches = tuple(type(m).insert(c, memory, rows) for m, c, memory in zip(models, state['cache'], chosen))
  max_lengths = jnp.minimum(chosen[0]['lengths'] + max_extra_length, max_output_length)
  return spread(strategy.start({**state, 'cache': caches}, rows, max_lengths, given), mesh)


def generate(params, state, want, max_steps, *, model, strategy: search.Strategy, mesh=None):
  """Every slot stepped until `want` more slots are done than were, or all are, or `max_steps` steps have run ->
  (state, done [S] bool, tokens [S, kept, L], scores [S, kept]: the strategy's output, final where done; the
  steps run and the sentence-steps among them (slots not done))."""
  tokens_to_logits, reorder_cache = _callbacks(*search.members(model, params))
  target = jnp.minimum(jnp.sum(strategy.done(state)) + want, state['step'].shape[0])

  def step(carry):
    state, steps, busy = carry
    return (strategy.step(state, tokens_to_logits, reorder_cache), steps + 1,
            busy + jnp.sum(~strategy.done(state)))
  state, steps, busy = jax.lax.while_loop(
      lambda carry: (jnp.sum(strategy.done(carry[0])) < target) & (carry[1] < max_steps), step,
      (state, jnp.int32(0), jnp.int32(0)))
  return (spread(state, mesh), strategy.done(state), *strategy.output(state), steps, busy)


def evict(state, rows):
  """The state with slots `rows` [S] (S: a padding row, left out) done at once: no token left to produce."""
  return {**state, 'max_lengths': state['max_lengths'].at[rows].set(0, mode='drop')}


def translate_batch(params, inputs, *, model, strategy: search.Strategy, max_extra_length: int,
                    max_output_length: int):
  """Every sentence of inputs [b, s] in a slot of its own, decoded to the end in one program: (tokens
  [b, kept, L], scores [b, kept]). The engine's step without a host between steps: for tests and step timing."""
  models, member_params = search.members(model, params)
  memories = [m.apply({'params': p}, inputs, method=m.memory) for m, p in zip(models, member_params)]
  caches = _caches(models, member_params, memories, strategy.width, max_output_length)
  tokens_to_logits, reorder_cache = _callbacks(models, member_params)
  return search.run_to_end(strategy, tokens_to_logits, caches, _max_lengths(inputs, max_extra_length, max_output_length),
                           max_output_length, reorder_cache)


@functools.lru_cache(maxsize=None)
def jitted_translate(model, beam_size: int, length_penalty_alpha: float, max_extra_length: int,
                     max_output_length: int, beam_top_k: str = 'lax', num_results: int | None = None,
                     beam_stop: str = 'bound'):
  """translate_batch compiled for these settings, (params, inputs [b, s]) -> (tokens [b, L], scores [b]), or
  with num_results=k ([b, k, L], [b, k])."""
  decoding = DecodeSettings(beam_size=beam_size, length_penalty_alpha=length_penalty_alpha, beam_top_k=beam_top_k,
                            beam_stop=beam_stop)
  strategy = search.strategy_for(decoding, num_results)
  run = functools.partial(translate_batch, model=model, strategy=strategy, max_extra_length=max_extra_length,
                          max_output_length=max_output_length)

  def translate(params, inputs):
    tokens, scores = run(params, inputs)
    return (tokens, scores) if num_results else (tokens[:, 0], scores[:, 0])
  return jax.jit(translate)


@dataclasses.dataclass(frozen=True)
class Programs:
  """The compiled programs of one engine shape."""
  empty: callable
  encode: callable
  admit: callable
  generate: callable
  evict: callable


@functools.lru_cache(maxsize=None)
def programs(model, strategy: search.Strategy, slots: int, source_length: int, max_output_length: int,
             max_extra_length: int, mesh=None) -> Programs:
  """One shape's programs, kept for the life of the process (and in JAX's persistent compilation cache); with
  a `mesh`, the slots spread over its devices."""
  return Programs(
      empty=jax.jit(functools.partial(empty, model=model, strategy=strategy, slots=slots, source_length=source_length,
                                      max_output_length=max_output_length, mesh=mesh)),
      encode=jax.jit(functools.partial(encode, model=model)),
      admit=jax.jit(functools.partial(admit, model=model, strategy=strategy, max_extra_length=max_extra_length,
                                      max_output_length=max_output_length, mesh=mesh), donate_argnums=(1,)),
      generate=jax.jit(functools.partial(generate, model=model, strategy=strategy, mesh=mesh), donate_argnums=(1,)),
      evict=jax.jit(evict, donate_argnums=(0,)))


@dataclasses.dataclass(frozen=True)
class Shape:
  """What one translation runs with: slots, source length (padded), output length, rows a call admits, and the
  compiled programs of that shape."""
  slots: int
  source_length: int
  max_output_length: int
  admit_rows: int
  programs: Programs


def slot_count(sentences: int, slots: int, devices: int = 1) -> int:
  """The slots a translation of `sentences` takes: at most `slots`, else the power of two from 8 that holds them;
  a multiple of `devices` (each device the same number)."""
  count = SMALLEST_SLOTS
  while count < min(sentences, slots):
    count *= 2
  return -(-min(count, max(slots, 1)) // devices) * devices


class Engine:
  """A model (or an ensemble: tuples of models and parameters), its parameters and a strategy, decoding lists of
  encoded sentences through `slots` slots (see the module docstring). `admit_rows`: the sentences admitted at
  once, and the done slots a `generate` call waits for while sentences are waiting (default: an eighth of the
  slots). `mesh`: a one-axis (SLOT_AXIS) mesh whose devices share the slots, the parameters replicated on each
  (`decoding_mesh`); None: one device."""

  def __init__(self, model, params, strategy: search.Strategy, *, slots: int, max_extra_length: int,
               max_positions: int, admit_rows: int | None = None, mesh=None):
    self.model, self.params, self.strategy, self.mesh = model, params, strategy, mesh
    self.slots, self.max_extra_length, self.max_positions = slots, max_extra_length, max_positions
    self.admit_rows = admit_rows
    self.counts = collections.Counter()  # generate calls, steps, slot-steps and sentence-steps run so far

  def padded(self, length: int) -> int:
    """A source length rounded up to SOURCE_ROUNDING, within the model's positions."""
    return min(-(-length // SOURCE_ROUNDING) * SOURCE_ROUNDING, self.max_positions)

  def shape(self, encoded: list[list[int]]) -> 'Shape':
    """The slots, lengths and programs a translation of `encoded` runs with."""
    longest = min(max(map(len, encoded)), self.max_positions - 1) + 1  # with EOS
    slots = slot_count(sum(1 for ids in encoded if ids), self.slots, self.mesh.size if self.mesh else 1)
    return self.sized(slots, self.padded(longest))

  def sized(self, slots: int, source_length: int) -> 'Shape':
    """The Shape of `slots` slots (a multiple of the mesh's devices) for sources padded to `source_length`."""
    length = decode_length(source_length, self.max_extra_length, self.max_positions)
    return Shape(slots, source_length, length, self.admit_rows or max(1, slots // 8),
                 programs(self.model, self.strategy, slots, source_length, length, self.max_extra_length, self.mesh))

  def run(self, encoded: list[list[int]], progress=None, should_stop=None, keys=None, prefixes=None,
          constraints=None):
    """Each sentence's results (ids without EOS, cut at the model's max_positions - 1; none: []), in order:
    [(tokens [L] int32 ending in EOS unless cut at the length limit, 0-padded; score), ...], `strategy.kept` of
    them, best first; an empty sentence gives []. `progress(done, total)` is called after each `generate`; a true
    `should_stop()` (checked before each) abandons the rest and returns None. keys [N, 2] uint32: each
    sentence's random key (search.sentence_keys), for a strategy that draws (default: zeros); `prefixes`: the
    ids each output must begin with (default: none; each shorter than its sentence's length limit); `constraints`:
    per sentence the phrases (lists of ids) its output must contain, for a search.ConstrainedBeamSearch (its
    static shape holds them)."""
    sources = [self.source(ids) for ids in encoded]
    results = [[] for _ in sources]
    queue = collections.deque(sorted((i for i, ids in enumerate(sources) if ids), key=lambda i: -len(sources[i])))
    if not queue:
      return results
    total, finished = len(queue), 0
    batch = Running(self, self.shape(encoded))
    brought = self.brought(len(encoded), batch.shape, keys, prefixes, constraints)  # [N, ...] each
    while queue or batch.waiting or batch.occupied:
      if should_stop and should_stop():
        return None
      if queue and batch.free and not batch.waiting:  # the next `slots` sentences (similar lengths) encoded together
        ahead = [queue.popleft() for _ in range(min(batch.shape.slots, len(queue)))]
        batch.join(ahead, [sources[i] for i in ahead], {name: values[ahead] for name, values in brought.items()})
      waiting = len(queue) + len(batch.waiting)
      for i, found in batch.advance(min(batch.shape.admit_rows, waiting) if waiting else batch.shape.slots):
        results[i] = found
        finished += 1
      if progress:
        progress(finished, total)
    return results

  def source(self, ids: list[int]) -> list[int]:
    """A sentence's ids as the engine decodes them: cut to the model's positions, EOS added (none: [])."""
    return ids[:self.max_positions - 1] + [EOS_ID] if ids else []

  def brought(self, count: int, shape: 'Shape', keys=None, prefixes=None, constraints=None) -> dict:
    """search.sentence_inputs of `count` sentences for a run of `shape` with this engine's strategy."""
    room = (getattr(self.strategy, 'phrases', 1), getattr(self.strategy, 'phrase_length', 1))
    return search.sentence_inputs(count, shape.max_output_length, keys, prefixes, constraints, room)


class Running:
  """One shape's slots and the sentences in them, each known by a handle of the caller's: sentences `join`
  (encoded together, then admitted as slots free up) and leave with their results from `advance`; `evict`
  frees a sentence's slot at once (its results dropped). Engine.run drives one over a list; a server drives one
  per shape over sentences as requests bring them."""

  def __init__(self, engine: Engine, shape: Shape):
    self.engine, self.shape = engine, shape
    self.state = shape.programs.empty(engine.params)
    self.free, self.occupant = list(range(shape.slots)), {}  # free slots; slot -> handle
    self.waiting = []  # encoded, not yet admitted: [(handle, row of `encoded`, what it brings)]
    self.encoded = None

  occupied = property(lambda self: bool(self.occupant))

  def join(self, handles: list, sources: list[list[int]], brought: dict, rows: int | None = None) -> None:
    """Sentences `sources` (ids ending in EOS, at most the shape's source length; no more than `rows`, default
    the slots) known as `handles`, bringing `brought` (search.sentence_inputs' arrays, one row each), encoded
    in one call of `rows` rows and admitted as slots free up. Only when none is waiting."""
    assert not self.waiting, 'sentences are still waiting for slots'
    rows = rows or self.shape.slots
    width = self.engine.padded(max(map(len, sources)))
    inputs = np.zeros((rows, width), np.int32)
    for row, ids in enumerate(sources):
      inputs[row, :len(ids)] = ids
    self.encoded = self.shape.programs.encode(self.engine.params, inputs)
    self.waiting = [(handle, row, {name: values[row] for name, values in brought.items()})
                    for row, handle in enumerate(handles)]
    self._admit()

  def _admit(self) -> None:
    admit_rows, slots = self.shape.admit_rows, self.shape.slots
    while self.waiting and self.free:
      count = min(admit_rows, len(self.waiting), len(self.free))
      picks = np.zeros((admit_rows,), np.int32)
      rows = np.full((admit_rows,), slots, np.int32)  # slots: a padding row, left out
      chosen = [self.waiting.pop(0) for _ in range(count)]
      for row, (handle, pick, _) in enumerate(chosen):
        picks[row], rows[row] = pick, self.free.pop(0)
        self.occupant[int(rows[row])] = handle
      given = {name: np.stack([brought[name] for _, _, brought in chosen]
                              + [np.zeros_like(chosen[0][2][name])] * (admit_rows - count))
               for name in chosen[0][2]}
      self.state = self.shape.programs.admit(self.engine.params, self.state, self.encoded, picks, rows, given)

  def advance(self, want: int, max_steps: int = 1 << 30) -> list:
    """Every slot stepped until `want` more are done than were, or all are, or after `max_steps` steps; then
    the waiting sentences admitted to the freed slots. Returns [(handle, results), ...] of the sentences done
    (results as Engine.run's)."""
    engine = self.engine
    self.state, *outputs = self.shape.programs.generate(engine.params, self.state, np.int32(want), np.int32(max_steps))
    done, tokens, scores, steps, busy = jax.device_get(outputs)
    engine.counts.update(calls=1, steps=int(steps), slot_steps=int(steps) * self.shape.slots, sentence_steps=int(busy))
    finished = []
    for slot in np.flatnonzero(done):
      handle = self.occupant.pop(int(slot), None)
      if handle is not None:
        finished.append((handle, [(tokens[slot, j], float(scores[slot, j])) for j in range(tokens.shape[1])]))
        self.free.append(int(slot))
    self._admit()
    return finished

  def evict(self, handles) -> None:
    """The sentences `handles` leave: waiting ones are dropped, those in slots end at once (slots freed)."""
    handles = set(handles)
    self.waiting = [entry for entry in self.waiting if entry[0] not in handles]
    slots = [slot for slot, handle in self.occupant.items() if handle in handles]
    if slots:
      rows = np.full((self.shape.slots,), self.shape.slots, np.int32)
      rows[:len(slots)] = slots
      self.state = self.shape.programs.evict(self.state, rows)
      for slot in slots:
        del self.occupant[slot]
        self.free.append(slot)
    self._admit()


def decoding_mesh(devices: int | None = None):
  """The mesh a translation spreads its slots over: the first `devices` local devices; None: every local
  accelerator, or one device on a CPU (whose devices, when XLA is told to make several, share the same cores).
  None for one device."""
  from flax_transformer.errors import UserError
  local = jax.local_devices()
  if devices is not None and (isinstance(devices, bool) or not isinstance(devices, int)):
    raise UserError(f'devices={devices!r} must be a whole number of local devices, 1 to {len(local)}')
  count = (1 if local[0].platform == 'cpu' else len(local)) if devices is None else devices
  if not 1 <= count <= len(local):
    raise UserError(f'devices={devices}: this process has {len(local)} local device(s); give 1 to {len(local)}')
  return None if count == 1 else jax.sharding.Mesh(np.array(local[:count]), (SLOT_AXIS,))
