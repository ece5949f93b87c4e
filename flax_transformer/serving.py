"""Requests' sentences decoded together as they arrive: one thread drives the decoding engine for every request.

    scheduler = Scheduler(translator, max_waiting=4096)
    request = scheduler.submit(translator.plan(['A dog runs.']))  # raises QueueFull when the queue is full
    hypotheses = request.future.result()      # per piece [(text, score), ...], as Translator.decode gives them

Each request is a Translator.plan. Its pieces (sentences, or pieces of long ones) wait in the queue of their
strategy, then join a running batch (engine.Running) of that strategy as its slots free up: the batch of the
shortest source length that holds them and has a free slot, else their own (source lengths rounded up to a
power of two from 32: a few shapes, and short sentences fill the slots of a batch of longer ones rather than
starting another). Pieces are taken from the waiting requests in turn, one each, so a large request does not
hold a small one behind it and every step decodes the sentences of many requests. The thread steps each busy
batch until an eighth of its slots are done or `step_budget` steps have run, and admits what arrived in
between, so a new request waits a few steps, not a whole batch. The queue is bounded in pieces:
`submit` refuses a request that would overflow it (QueueFull) instead of letting it grow without end.
`cancel` (a client gone, a deadline passed) drops a request's waiting pieces and frees its slots at once.
"""

import collections
import concurrent.futures
import dataclasses
import threading
import time

import numpy as np

from flax_transformer import engine

SMALLEST_SOURCE = 32  # source lengths are rounded up to a power of two from this


class QueueFull(Exception):
  """The queue holds as many waiting sentences as it may: try again later."""


class TooLarge(Exception):
  """A request with more sentences than the queue holds: it can never be taken."""


@dataclasses.dataclass(eq=False)
class Request:
  """One request's plan on its way through the engine: `future` gets each piece's hypotheses (a list per piece,
  [] for an empty one) once the last is done."""
  plan: object  # translator.Plan
  future: concurrent.futures.Future
  hypotheses: list
  left: int  # pieces not done
  arrived: float
  cancelled: bool = False


class Scheduler:
  """The engine's thread and its queues (see the module docstring). `max_waiting`: the most pieces waiting for a
  slot; `step_budget`: the most steps a batch runs before the thread looks for new arrivals."""

  def __init__(self, translator, *, max_waiting: int = 4096, step_budget: int = 32):
    self.translator, self.max_waiting, self.step_budget = translator, max_waiting, step_budget
    self.engines = {}  # strategy -> engine.Engine
    self.batches = {}  # (strategy, source length) -> engine.Running
    self.queues = {}  # strategy -> {request: deque of piece indices}, requests in arrival order
    self.arrivals, self.cancelled = collections.deque(), collections.deque()
    self.waiting = 0  # pieces not yet in a slot
    self.condition = threading.Condition()
    self.stopping, self.failure = False, None
    self.counts = collections.Counter()  # sentences and tokens done, engine steps and sentence-steps
    self.thread = threading.Thread(target=self._run, name='decoding engine', daemon=True)

  def start(self) -> None:
    """Starts the engine's thread (requests submitted before wait in the queue)."""
    self.thread.start()

  # --- From any thread ---------------------------------------------------------------------

  def submit(self, plan) -> Request:
    """Queues a plan; raises QueueFull when its pieces would take the queue past max_waiting."""
    pieces = sum(1 for ids in plan.encoded if ids)
    request = Request(plan, concurrent.futures.Future(), [[] for _ in plan.encoded], pieces, time.monotonic())
    with self.condition:
      if self.failure is not None:
        raise RuntimeError(f'the decoding engine stopped: {self.failure}')
      if pieces > self.max_waiting:
        raise TooLarge(f'the request brings {pieces} sentences and the queue holds {self.max_waiting}; send them in '
                       f'several requests')
      if self.waiting + pieces > self.max_waiting:
        raise QueueFull(f'{self.waiting} sentences are waiting and this request brings {pieces}; the queue holds '
                        f'{self.max_waiting}')
      if not pieces:
        request.future.set_result(request.hypotheses)
        return request
      self.waiting += pieces
      self.arrivals.append(request)
      self.condition.notify()
    return request

  def cancel(self, request: Request) -> None:
    """The request's waiting pieces dropped and its slots freed (by the engine's thread, soon)."""
    with self.condition:
      if not request.cancelled and not request.future.done():
        request.cancelled = True
        self.cancelled.append(request)
        self.condition.notify()

  def stop(self) -> None:
    """The thread ends once every queued and running piece is done."""
    with self.condition:
      self.stopping = True
      self.condition.notify()
    if self.thread.is_alive():
      self.thread.join()

  def occupancy(self) -> tuple[int, int]:
    """(slots holding a sentence, slots) over every running batch."""
    batches = list(self.batches.values())
    return sum(len(b.occupant) for b in batches), sum(b.shape.slots for b in batches)

  # --- The engine's thread -----------------------------------------------------------------

  def _busy(self) -> bool:
    return any(self.queues.values()) or any(b.occupied or b.waiting for b in self.batches.values())

  def _run(self) -> None:
    try:
      while True:
        with self.condition:
          while not (self.arrivals or self.cancelled or self._busy() or self.stopping):
            self.condition.wait()
          if self.stopping and not (self.arrivals or self._busy()):
            return
          arrivals, cancelled = list(self.arrivals), list(self.cancelled)
          self.arrivals.clear()
          self.cancelled.clear()
        for request in arrivals:
          self._queue(request)
        for request in cancelled:
          self._drop(request)
        self._fill()
        self._settle()
        for batch in list(self.batches.values()):
          if batch.occupied:
            want = min(batch.shape.admit_rows, len(batch.occupant))
            for (request, piece), found in batch.advance(want, self.step_budget):
              self._finish(request, piece, found)
        for key, batch in list(self.batches.items()):  # an idle batch gives its memory back (remade when needed)
          if not (batch.occupied or batch.waiting or self.queues.get(key[0])):
            del self.batches[key]
        self._settle()
        self.counts['steps'] = sum(e.counts['steps'] for e in self.engines.values())
        self.counts['sentence_steps'] = sum(e.counts['sentence_steps'] for e in self.engines.values())
    except BaseException as error:  # noqa: B902 - every waiting request learns it, then the server says so
      with self.condition:
        self.failure = error
        requests = {r for queue in self.queues.values() for r in queue} | set(self.arrivals)
        requests |= {handle[0] for b in self.batches.values() for handle in b.occupant.values()}
      for request in requests:
        if not request.future.done():
          request.future.set_exception(error)

  def _engine(self, strategy) -> engine.Engine:
    if strategy not in self.engines:
      t = self.translator
      self.engines[strategy] = engine.Engine(t.model, t.params, strategy, slots=t.decoding.decode_slots, mesh=t.mesh,
                                             max_extra_length=t.max_extra_length, max_positions=t.max_positions)
    return self.engines[strategy]

  def source_length(self, ids: list[int]) -> int:
    """The padded source length a piece decodes at: a power of two from SMALLEST_SOURCE, within the model."""
    length = SMALLEST_SOURCE
    while length < min(len(ids) + 1, self.translator.max_positions):
      length *= 2
    return min(length, self.translator.max_positions)

  def _queue(self, request: Request) -> None:
    pieces = collections.deque(piece for piece, ids in enumerate(request.plan.encoded) if ids)
    self.queues.setdefault(request.plan.strategy, {})[request] = pieces

  def _drop(self, request: Request) -> None:
    for queue in self.queues.values():
      queue.pop(request, None)
    for batch in self.batches.values():
      gone = [handle for _, handle, _ in batch.waiting if handle[0] is request]
      gone += [handle for handle in batch.occupant.values() if handle[0] is request]
      if gone:
        batch.evict(gone)
    if not request.future.done():
      request.future.cancel()

  def _settle(self) -> None:
    """`waiting` counted again: pieces not yet in a slot (arrived, queued, or encoded and waiting)."""
    with self.condition:
      self.waiting = (sum(r.left for r in self.arrivals) + sum(map(len, (d for q in self.queues.values()
                                                                         for d in q.values())))
                      + sum(len(b.waiting) for b in self.batches.values()))

  def _fill(self) -> None:
    """Waiting pieces into free slots: a piece from each request in turn, each into the batch of the shortest
    source length that holds it and has a free slot (its own length's, made if there is none)."""
    for strategy, queue in self.queues.items():
      if not queue:
        continue
      decoder = self._engine(strategy)
      room = {key[1]: len(b.free) for key, b in self.batches.items() if key[0] == strategy and not b.waiting}
      taken = collections.defaultdict(list)  # source length -> [(request, piece), ...]
      moved = True
      while queue and moved:
        moved = False
        for request in list(queue):
          pieces = queue[request]
          need = self.source_length(request.plan.encoded[pieces[0]])
          fits = [length for length, free in room.items() if length >= need and free > 0]
          if not fits and need not in room and (strategy, need) not in self.batches:
            room[need] = self._batch(decoder, strategy, need)
            fits = [need]
          if not fits:
            continue
          length = min(fits)
          taken[length].append((request, pieces.popleft()))
          room[length] -= 1
          moved = True
          if not pieces:
            del queue[request]
      for length, chosen in taken.items():
        batch = self.batches[(strategy, length)]
        sources = [decoder.source(r.plan.encoded[p]) for r, p in chosen]
        rows = engine.slot_count(len(chosen), batch.shape.slots)  # encoded at once: a power of two from 8
        batch.join(chosen, sources, self._brought(decoder, batch.shape, chosen), rows=rows)

  def _batch(self, decoder: engine.Engine, strategy, source_length: int) -> int:
    """A new running batch of `strategy` for sources up to `source_length`; returns its slots."""
    slots = engine.slot_count(decoder.slots, decoder.slots, decoder.mesh.size if decoder.mesh else 1)
    self.batches[(strategy, source_length)] = engine.Running(decoder, decoder.sized(slots, source_length))
    return slots

  @staticmethod
  def _brought(decoder: engine.Engine, shape, taken: list) -> dict:
    """search.sentence_inputs of the pieces `taken` [(request, piece), ...] for a batch of `shape`."""
    keys = [r.plan.keys[p] if r.plan.keys is not None else np.zeros(2, np.uint32) for r, p in taken]
    prefixes = [r.plan.prefixes[p] if r.plan.prefixes is not None else [] for r, p in taken]
    constraints = [r.plan.constraints[p] if r.plan.constraints is not None else [] for r, p in taken]
    return decoder.brought(len(taken), shape, np.stack(keys), prefixes, constraints)

  def _finish(self, request: Request, piece: int, found: list) -> None:
    if request.cancelled:
      return
    request.hypotheses[piece] = self.translator.texts(found)
    request.left -= 1
    self.counts['sentences'] += 1
    self.counts['tokens'] += int(np.count_nonzero(found[0][0])) if found else 0
    if request.left == 0 and not request.future.done():
      request.future.set_result(request.hypotheses)
