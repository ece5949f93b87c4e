"""A trained model in memory: translate, n-best lists, scores and word alignments, from Python or a script.

    from flax_transformer import Translator
    translator = Translator.from_workdir('runs/base')       # parameters only, averaged as the run says
    translator.translate(['A man is sleeping.'])             # beam 4, α 0.6, max length = input + 50
    translator.n_best(['A man is sleeping.'], 4)              # [[(text, score), ...]]
    translator.score(['A man is sleeping.'], ['Ein Mann schläft.'])  # log p(target | source)
    translator.alignments(['A man is sleeping.'], ['Ein Mann schläft.'])  # ['0-0 1-1 3-2']

Translations go through the decoding engine (engine.py: slots refilled as sentences finish); scores and
alignments through length-sorted teacher-forced batches (`translation_batches`: rows and lengths rounded up to
multiples of 8). Shapes already seen reuse their compiled programs, kept for the life of the process.
"""

import collections
import dataclasses
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from flax_transformer import engine, losses, search, tokenizer
from flax_transformer.sentence_batches import encode_sentences, split_at_punctuation, translation_batches
from flax_transformer.constants import EOS_ID, PAD_ID, UNK_ID
from flax_transformer.decoding_settings import DecodeSettings
from flax_transformer.errors import ArgumentError, UserError, WorkdirError
from flax_transformer.model import Transformer
from flax_transformer import settings as settings_
from flax_transformer.settings import Settings

WORD_START = '\u2581'  # SentencePiece's mark of a piece that begins a word
CHECKPOINTS = ('last', 'best')  # which checkpoints a model is read from: the newest (averaged), or the best one
RENAMED_KEYWORDS = {'alpha': 'length_penalty_alpha'}  # public keyword arguments renamed since: old -> new


def _forced_scores(params, inputs, targets, *, model, with_attention: bool, layer: int = -1):
  """inputs [b, s], targets [b, t] (EOS-terminated, 0-padded) -> (log p(target row) [b], and with
  `with_attention` decoder layer `layer`'s cross-attention averaged over heads [b, t, s]). `model`, `params`: one
  model, or an ensemble's tuples (search.members; scored by search.ensemble_log_probs, without attention)."""
  models, member_params = search.members(model, params)
  if len(models) == 1:
    model, params = models[0], member_params[0]
  if with_attention:
    logits, variables = model.apply({'params': params}, inputs, targets, mutable=['intermediates'])
    weights = variables['intermediates']['decoder']['cross_attention']['attention_weights'][0]  # [N, b, h, t, s]
    attention = jnp.mean(weights[layer], axis=1)  # [b, t, s]
  elif len(models) == 1:
    logits, attention = model.apply({'params': params}, inputs, targets), None  # [b, t, v]
  else:  # log-probabilities are logits whose normaliser is 1: token_losses then reads them as they are
    logits = search.ensemble_log_probs([m.apply({'params': p}, inputs, targets) for m, p in zip(models, member_params)])
    attention = None
  _, nll = losses.token_losses(logits, targets, 0.0)  # [b, t]
  return -jnp.sum(jnp.where(targets != PAD_ID, nll, 0.0), axis=1), attention


@functools.lru_cache(maxsize=None)
def _jitted_forced_scores(model, with_attention: bool, layer: int = -1):
  return jax.jit(functools.partial(_forced_scores, model=model, with_attention=with_attention, layer=layer))


def texts(value, name: str = 'sentences') -> list[str]:
  """`value` as a list of str, or a one-line ArgumentError naming what it is instead (a bare string, which would
  otherwise be read one character a sentence; bytes; None; a number in the list)."""
  if isinstance(value, (str, bytes)):
    raise ArgumentError(f'{name} must be a list of strings, not a single {type(value).__name__}; for one sentence '
                        f'pass a list of one: [{value[:40]!r}]')
  if not isinstance(value, (list, tuple)):
    raise ArgumentError(f'{name} must be a list of strings, not {type(value).__name__}')
  for i, text in enumerate(value):
    if not isinstance(text, str):
      fix = 'decode it to str first' if isinstance(text, bytes) else 'give text'
      raise ArgumentError(f'{name}[{i}] is {type(text).__name__} {text!r:.40}, not a string; {fix}')
  return list(value)


def renamed_keywords(method):
  """`method` also taking the old names of RENAMED_KEYWORDS, with a DeprecationWarning naming the new one."""
  @functools.wraps(method)
  def taking_old_names(*args, **kwargs):
    for old, new in RENAMED_KEYWORDS.items():
      if old in kwargs:
        if new in kwargs:
          raise ArgumentError(f'{old}= and {new}= name the same value; give {new}= alone')
        warnings.warn(f'the keyword {old}= is now {new}=; the old name will be removed', DeprecationWarning,
                      stacklevel=2)
        kwargs[new] = kwargs.pop(old)
    return method(*args, **kwargs)
  return taking_old_names


@dataclasses.dataclass(frozen=True)
class Plan:
  """What one translation call decodes (Translator.plan): the strategy, and per piece (a sentence, or a piece of
  a long one split at punctuation) its ids, the sentence it belongs to, its random key and what it brings."""
  strategy: search.Strategy
  sentences: int  # how many sentences the pieces come from
  encoded: list  # [[id, ...], ...] per piece, no EOS ([] for an empty sentence)
  owners: list  # per piece, its sentence's index
  keys: np.ndarray | None  # [pieces, 2] uint32 (search.sentence_keys), for a strategy that draws
  prefixes: list | None  # per piece, the ids its output begins with
  constraints: list | None  # per piece, its phrases' ids


def _words(processor, ids: list[int]) -> list[int]:
  """The word number of each piece: a piece marked as a word start (or the first) begins a new word."""
  words, current = [], -1
  for i, piece in enumerate(processor.id_to_piece(ids)):
    if i == 0 or piece.startswith(WORD_START):
      current += 1
    words.append(current)
  return words


class Translator:
  """Parameters, vocabulary and decoding settings held once; see the module docstring.

  Args:
    params: the model's parameters (numpy or jax arrays; placed on the devices once, here); for an ensemble,
      a list of its members' parameters.
    model_config: the architecture they belong to; for an ensemble, a list of its members' (any shapes that
      share one vocabulary).
    processor: the SentencePiece vocabulary (`tokenizer.load`).
    decoding: the decoding settings (decoding_settings.DecodeSettings: beam size, α, length limit, stopping rule,
      top-k path, batch budget); default: §6.1's, or a run's when loaded from a workdir.
    **changes: decoding settings by name, over `decoding` (e.g. beam_size=1 for greedy search), each checked.
    checkpoints: the checkpoint steps the parameters come from (reported only; per member for an ensemble).
    devices: the local devices that share the decoding engine's slots, each holding the whole model
      (engine.decoding_mesh; default: every local accelerator, one device on a CPU).
    settings: the run's settings when loaded from a workdir (its BLEU tokenizer, dataset), else None.
  """

  @renamed_keywords
  def __init__(self, params, model_config, processor, *, decoding: DecodeSettings | None = None,
               checkpoints: tuple = (), settings: Settings | None = None, devices: int | None = None, **changes):
    self.decoding = settings_.decoding_for((decoding or DecodeSettings()).replace(**changes))  # 'auto' made
    self.mesh = engine.decoding_mesh(devices)
    ensemble = isinstance(model_config, (list, tuple))
    configs = tuple(model_config) if ensemble else (model_config,)
    everywhere = self.mesh and jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())  # replicated
    placed = tuple(jax.device_put(p, everywhere) if everywhere else p if _on_devices(p) else jax.device_put(p)
                   for p in (params if ensemble else [params]))
    if len(placed) != len(configs) or not configs:
      raise UserError(f'an ensemble needs one parameter tree per model config: got {len(placed)} and {len(configs)}')
    models = tuple(Transformer(c) for c in configs)
    self.model_configs, self.processor = configs, processor
    self.model_config = configs[0]
    self.model, self.params = (models, placed) if ensemble else (models[0], placed[0])  # what search.members takes
    self.checkpoints, self.settings = tuple(checkpoints), settings
    self.decoding_counts = collections.Counter()  # the engine's steps, slot-steps and sentence-steps so far

  @classmethod
  @renamed_keywords
  def from_workdir(cls, workdir: str, step: int | None = None, average_last: int | None = None,
                   checkpoint_dir: str | None = None, *, checkpoint: str = 'last', weights: str = 'params',
                   **overrides) -> 'Translator':
    """The model a training run (or `average`) wrote to `workdir`, any storage path the product takes.

    Restores parameters only. `step`: that checkpoint alone; `checkpoint='best'`: the best by the run's
    validation metric (config.keep_best); otherwise the mean of the last `average_last` checkpoints
    (default: the run's config.average_last). `weights='ema'`: the weights' moving average (config.ema_decay)
    instead of the trained weights. `checkpoint_dir`: read the checkpoints from there instead of the workdir's.
    Decoding settings are the run's, with `overrides` (decoding settings by name) over them.
    """
    from flax_transformer import storage, weights as weights_, workdirs
    if checkpoint not in CHECKPOINTS:
      raise UserError(f'checkpoint={checkpoint!r}: use one of {", ".join(CHECKPOINTS)}')
    run = workdirs.read_settings(workdir)
    model_config = run.model
    processor = tokenizer.load(run.data.vocab_path or f'{workdir}/{tokenizer.VOCAB_FILENAME}', model_config.vocab_size)
    source, where = (checkpoint_dir, f'--checkpoint_dir={checkpoint_dir}') if checkpoint_dir else (workdir, workdir)
    if checkpoint_dir and not storage.path(checkpoint_dir).is_dir():
      raise WorkdirError(f'--checkpoint_dir={checkpoint_dir} is not a folder; give the checkpoints/ folder of a run '
                         f'(or leave it out to read the workdir\'s)')
    count = 1 if checkpoint == 'best' else average_last if average_last is not None else run.training.average_last
    params, chosen = weights_.chosen_params(source, model_config, count, step=step, best=checkpoint == 'best',
                                            metric=run.training.best_metric, weights=weights, where=where)
    return cls(params, model_config, processor, checkpoints=tuple(chosen), settings=run,
               decoding=run.decode, **overrides)

  @classmethod
  @renamed_keywords
  def from_workdirs(cls, workdirs: list[str], **kwargs) -> 'Translator':
    """An ensemble of the models in `workdirs` (each read as `from_workdir` reads one, with the same keyword
    arguments), decoded with the mean of their log-probabilities; they may differ in shape but must share the
    vocabulary. Decoding defaults and settings come from the first. One workdir gives that model itself."""
    workdirs = texts(workdirs, 'workdirs')
    if not workdirs:
      raise ArgumentError('workdirs is empty; give the workdir of at least one trained model')
    loaded = [cls.from_workdir(w, **kwargs) for w in workdirs]
    if len(loaded) == 1:
      return loaded[0]
    first = loaded[0]
    for workdir, other in zip(workdirs[1:], loaded[1:]):
      if other.processor.serialized_model_proto() != first.processor.serialized_model_proto():
        sizes = (other.processor.get_piece_size(), first.processor.get_piece_size())
        differs = f'{sizes[0]} and {sizes[1]} pieces' if sizes[0] != sizes[1] else f'{sizes[0]} pieces each, not the same'
        raise UserError(f'{workdir} has another vocabulary than {workdirs[0]} ({differs}); an ensemble decodes one '
                        f'vocabulary: train its models with --config.vocab_path set to one sentencepiece.model')
    return cls([t.params for t in loaded], [t.model_config for t in loaded], first.processor,
               decoding=first.decoding, checkpoints=tuple(t.checkpoints for t in loaded), settings=first.settings,
               devices=kwargs.get('devices'))

  beam_size = property(lambda self: self.decoding.beam_size)
  length_penalty_alpha = property(lambda self: self.decoding.length_penalty_alpha)
  max_extra_length = property(lambda self: self.decoding.max_extra_length)
  eval_tokens_per_batch = property(lambda self: self.decoding.eval_tokens_per_batch)
  beam_top_k = property(lambda self: self.decoding.beam_top_k)
  beam_stop = property(lambda self: self.decoding.beam_stop)

  @property
  def ensemble(self) -> bool:
    return len(self.model_configs) > 1

  # --- Text in, text out --------------------------------------------------------------

  @property
  def max_positions(self) -> int:
    """Positions every model of the ensemble (or the model) takes."""
    return min(c.max_positions for c in self.model_configs)

  @property
  def max_source_tokens(self) -> int:
    """Source tokens the model takes, with the end-of-sentence token added."""
    return self.max_positions - 1

  def encode(self, sentences: list[str]) -> list[list[int]]:
    """Each sentence's token ids (no EOS; a blank sentence has none)."""
    return encode_sentences(self.processor, sentences)

  def too_long(self, encoded: list[list[int]]) -> list[int]:
    """Indices of the sentences (as `encode` gives them) longer than the model takes."""
    return [i for i, ids in enumerate(encoded) if len(ids) > self.max_source_tokens]

  @renamed_keywords
  def translate(self, sentences: list[str], beam_size: int | None = None, length_penalty_alpha: float | None = None,
                *,
                split_long: bool = False, encoded: list[list[int]] | None = None, progress=None,
                should_stop=None, numbers: list[int] | None = None, prefixes: list[str] | None = None,
                constraints: list[list[str]] | None = None) -> list[str] | None:
    """Translations of `sentences`, in their order; an empty sentence gives an empty translation (with
    sampling, each sentence's first sample).

    A sentence longer than the model takes is cut, or with `split_long` translated in pieces split at
    sentence punctuation and joined. `encoded`: the sentences' ids when the caller has them.
    `progress(done, total)` is called after each batch; a true `should_stop()` (checked before each
    batch) abandons the rest and returns None. `numbers`: the sentences' numbers (default 0, 1, ...), which
    with the seed alone choose a sentence's samples (a file's line numbers: the same samples however it is cut).
    `prefixes`: per sentence, text its translation must begin with (forced and scored; '' for none): the
    output starts with the prefix's own pieces. `constraints`: per sentence, a list of phrases its translation
    must contain (lexical constraints, met by beam search: search.ConstrainedBeamSearch; [] for none), in any
    order or, with the setting constraint_order='ordered', in theirs; an output cut at the length limit may lack
    them.
    """
    planned = self.plan(sentences, beam_size=beam_size, length_penalty_alpha=length_penalty_alpha,
                        split_long=split_long, encoded=encoded, numbers=numbers, prefixes=prefixes,
                        constraints=constraints)
    hypotheses = self.decode(planned, progress, should_stop)
    return None if hypotheses is None else self.joined(planned, hypotheses)

  def plan(self, sentences: list[str], *, decoding: DecodeSettings | None = None, beam_size: int | None = None,
           length_penalty_alpha: float | None = None, num_results: int | None = None, split_long: bool = False,
           encoded: list[list[int]] | None = None, numbers: list[int] | None = None,
           prefixes: list[str] | None = None, constraints: list[list[str]] | None = None) -> 'Plan':
    """What translating `sentences` decodes (arguments as `translate`'s; `decoding`: settings instead of this
    translator's, `num_results`: the k best or k samples), every argument checked: a one-line UserError.
    `decode` runs it here; a server runs it with other requests'."""
    sentences = texts(sentences)
    decoding = (decoding or self.decoding).replace(beam_size=beam_size, length_penalty_alpha=length_penalty_alpha)
    encoded = self.encode(sentences) if encoded is None else encoded
    numbers = list(range(len(sentences))) if numbers is None else list(numbers)
    forced = self.encode_prefixes(prefixes, encoded)
    phrases = self.encode_constraints(constraints, encoded)
    owners = list(range(len(sentences)))
    split_constrained = [i for i in (self.too_long(encoded) if split_long and phrases else ()) if phrases[i]]
    if split_constrained:
      i = split_constrained[0]
      raise UserError(f'sentence {i} is longer than the model takes ({len(encoded[i])} tokens, at most '
                      f'{self.max_source_tokens}) and has constraints, which no piece of it can be said to hold; '
                      f'split it yourself and give each part its constraints')
    if split_long and self.too_long(encoded):
      long, pieces, owners, piece_numbers, piece_prefixes = set(self.too_long(encoded)), [], [], [], []
      for i, (sentence, ids) in enumerate(zip(sentences, encoded)):
        split = (split_at_punctuation(self.processor, sentence, self.max_source_tokens)
                 if i in long else None)
        pieces += self.encode(split) if split else [ids]
        owners += [i] * (len(split) if split else 1)
        piece_numbers += [(numbers[i], piece) for piece in range(len(split))] if split else [numbers[i]]
        prefix = forced[i] if forced is not None else []
        piece_prefixes += [prefix] + [[]] * (len(split) - 1) if split else [prefix]  # the first piece's
      phrases = [phrases[i] for i in owners] if phrases else None
      encoded, numbers, forced = pieces, piece_numbers, piece_prefixes
    strategy = search.strategy_for(decoding, num_results, prefixed=any(forced or ()),
                                   constraint_shape=search.constraint_shape(phrases))
    keys = search.sentence_keys(decoding.sampling_seed, numbers) if strategy.random else None
    return Plan(strategy, len(sentences), encoded, owners, keys, forced, phrases)

  def decode(self, planned: 'Plan', progress=None, should_stop=None) -> list | None:
    """Each piece's [(text, score), ...] (planned.strategy.kept of them; [] for an empty one), decoded by the
    engine here; None when `should_stop` stopped it."""
    decoder = engine.Engine(self.model, self.params, planned.strategy, slots=self.decoding.decode_slots,
                            mesh=self.mesh, max_extra_length=self.max_extra_length, max_positions=self.max_positions)
    results = decoder.run(planned.encoded, progress, should_stop, planned.keys, planned.prefixes, planned.constraints)
    self.decoding_counts.update(decoder.counts)
    return None if results is None else [self.texts(found) for found in results]

  def texts(self, found: list) -> list[tuple[str, float]]:
    """An engine's results for one piece [(token ids, score), ...] as [(text, score), ...]."""
    return [(tokenizer.decode_ids(self.processor, tokens), score) for tokens, score in found]

  @staticmethod
  def joined(planned: 'Plan', hypotheses: list) -> list[str]:
    """Each sentence's translation from its pieces' hypotheses (decode's): their best texts joined."""
    translations = [''] * planned.sentences
    for owner, best in zip(planned.owners, hypotheses):
      translations[owner] = f'{translations[owner]} {best[0][0]}'.strip() if best else translations[owner]
    return translations

  @renamed_keywords
  def n_best(self, sentences: list[str], k: int, beam_size: int | None = None,
             length_penalty_alpha: float | None = None, numbers: list[int] | None = None,
             prefixes: list[str] | None = None, constraints: list[list[str]] | None = None
             ) -> list[list[tuple[str, float]]]:
    """The `k` best translations of each sentence with their length-penalised log-probabilities (the
    beam's own ranking), best first. The beam is max(k, beam_size) wide. An empty sentence gives []. With
    the sampling strategy: `k` samples of each, in their order, with their log-probabilities (`numbers`,
    `prefixes` and `constraints` as in `translate`)."""
    if not isinstance(k, int) or k < 1:
      raise UserError(f'n_best k={k!r} must be a positive integer; ask for at least one hypothesis')
    beam = max(k, self.beam_size if beam_size is None else beam_size)
    if self.decoding.strategy != 'beam':
      beam = self.beam_size
    planned = self.plan(sentences, beam_size=beam, length_penalty_alpha=length_penalty_alpha, num_results=k,
                        numbers=numbers, prefixes=prefixes, constraints=constraints)
    return self.decode(planned)

  def score(self, sources: list[str], targets: list[str]) -> list[float]:
    """log p(target | source) of each pair under the model, teacher-forced (natural log, summed over the
    target's tokens and its end-of-sentence token; no smoothing, no length penalty)."""
    scores, _ = self._teacher_forced(sources, targets, with_attention=False)
    return scores

  def alignments(self, sources: list[str], targets: list[str], layer: int | None = None) -> list[str]:
    """Hard word alignments in Pharaoh format ('i-j': source word i, target word j, both from 0).

    Each target piece is aligned to the source piece its prediction attends to most (decoder layer
    `layer`'s cross-attention, averaged over heads, end-of-sentence tokens left out); pieces map to the
    words they belong to (SentencePiece's word-start mark), and pairs are listed once, sorted. The default
    layer is the penultimate, whose attention aligns best (Garg et al., 2019, "Jointly Learning to Align
    and Translate with Transformer Models"; on a Multi30k model the last layer's links lag a word behind).
    """
    if self.ensemble:
      raise UserError('alignments come from one model\'s cross-attention; an ensemble has several: align with one '
                      'of its workdirs')
    layers = self.model_config.num_decoder_layers
    layer = (layers - 2 if layers > 1 else 0) if layer is None else layer
    if not -layers <= layer < layers:
      raise UserError(f'layer={layer} is not a decoder layer; the model has {layers} (0 to {layers - 1})')
    _, attention = self._teacher_forced(sources, targets, with_attention=True, layer=layer % layers)
    lines = []
    for source_ids, target_ids, weights in attention:
      source_words, target_words = _words(self.processor, source_ids), _words(self.processor, target_ids)
      links = {(source_words[int(np.argmax(weights[t, :len(source_ids)]))], target_words[t])
               for t in range(len(target_ids))} if source_ids else set()
      lines.append(' '.join(f'{i}-{j}' for i, j in sorted(links)))
    return lines

  # --- Batches through the compiled programs -----------------------------------------------

  def encode_prefixes(self, prefixes: list[str] | None, encoded: list[list[int]]) -> list[list[int]] | None:
    """Each prefix's ids (None: no prefixes), checked: one per sentence, every piece in the vocabulary, and
    shorter than its sentence's length limit (the source's tokens + EOS + max_extra_length)."""
    if prefixes is None:
      return None
    prefixes = texts(prefixes, 'prefixes')
    if len(prefixes) != len(encoded):
      raise UserError(f'{len(prefixes)} prefixes for {len(encoded)} sentences; give one prefix a sentence (\'\' for '
                      f'none)')
    ids = self.encode(prefixes)
    for i, (prefix, source) in enumerate(zip(ids, encoded)):
      if UNK_ID in prefix:
        piece = self.processor.id_to_piece(prefix)[prefix.index(UNK_ID)]
        raise UserError(f'prefix {i} ({prefixes[i][:40]!r}) has text the vocabulary has no piece for (near '
                        f'{piece!r}); give a prefix in the target language\'s characters')
      room = min(min(len(source), self.max_source_tokens) + 1 + self.max_extra_length, self.max_positions - 1)
      if source and len(prefix) >= room:
        raise UserError(f'prefix {i} has {len(prefix)} tokens and the output of its sentence at most {room} '
                        f'(its source\'s tokens + EOS + max_extra_length {self.max_extra_length}), EOS included; '
                        f'give a shorter prefix or a larger max_extra_length')
    return ids

  def encode_constraints(self, constraints: list[list[str]] | None, encoded: list[list[int]]
                         ) -> list[list[list[int]]] | None:
    """Each sentence's phrases as ids (None: no constraints), checked: one list of phrases a sentence, each
    phrase text the vocabulary spells, and all of a sentence's phrases shorter together than its output's length
    limit (the source's tokens + EOS + max_extra_length, EOS included)."""
    if constraints is None:
      return None
    if isinstance(constraints, (str, bytes)) or not isinstance(constraints, (list, tuple)):
      raise ArgumentError(f'constraints must be a list with one list of phrases a sentence, not '
                          f'{type(constraints).__name__}')
    if len(constraints) != len(encoded):
      raise UserError(f'{len(constraints)} constraint lists for {len(encoded)} sentences; give one list of phrases '
                      f'a sentence ([] for none)')
    phrases = []
    for i, (given, source) in enumerate(zip(constraints, encoded)):
      given = texts(given, f'constraints[{i}]')
      ids = self.encode(given)
      for phrase, text in zip(ids, given):
        if not phrase:
          raise UserError(f'constraint {text!r} of sentence {i} is empty; give a phrase with text, or leave it out')
        if UNK_ID in phrase:
          piece = self.processor.id_to_piece(phrase)[phrase.index(UNK_ID)]
          raise UserError(f'constraint {text[:40]!r} of sentence {i} has text the vocabulary has no piece for (near '
                          f'{piece!r}); give phrases in the target language\'s characters')
      room = min(min(len(source), self.max_source_tokens) + 1 + self.max_extra_length, self.max_positions - 1)
      tokens = sum(map(len, ids))
      if source and tokens >= room:
        raise UserError(f'the constraints of sentence {i} have {tokens} tokens and its output at most {room} '
                        f'(its source\'s tokens + EOS + max_extra_length {self.max_extra_length}), EOS included; give '
                        f'fewer or shorter phrases, or a larger max_extra_length')
      phrases.append(ids)
    return phrases

  def _teacher_forced(self, sources, targets, with_attention, layer=-1):
    """(scores per pair, [(source ids, target ids, attention [t, s]) per pair] or None)."""
    sources, targets = texts(sources, 'sources'), texts(targets, 'targets')
    if len(sources) != len(targets):
      raise UserError(f'{len(sources)} sources but {len(targets)} targets; give one target per source')
    limit = self.max_source_tokens
    source_ids, target_ids = self.encode(sources), self.encode(targets)
    source_ids, target_ids = [ids[:limit] for ids in source_ids], [ids[:limit] for ids in target_ids]
    # Batched by the longer side: a stand-in of that many ids gets the shape (its length + EOS) of each pair.
    longer = [[EOS_ID] * max(len(s), len(t), 1) for s, t in zip(source_ids, target_ids)]
    scores, attention = [0.0] * len(sources), [None] * len(sources)
    batches = translation_batches(longer, limit, self.eval_tokens_per_batch)
    function = _jitted_forced_scores(self.model, with_attention, layer if with_attention else -1)
    for indices, shape in batches:
      inputs, outputs = np.zeros(shape.shape, np.int32), np.zeros(shape.shape, np.int32)  # [rows, length]
      for row, i in enumerate(indices):
        inputs[row, :len(source_ids[i]) + 1] = source_ids[i] + [EOS_ID]
        outputs[row, :len(target_ids[i]) + 1] = target_ids[i] + [EOS_ID]
      batch_scores, weights = jax.device_get(function(self.params, inputs, outputs))
      for row, i in enumerate(indices):
        scores[i] = float(batch_scores[row])
        if with_attention:
          attention[i] = (source_ids[i], target_ids[i], np.asarray(weights[row]))
    return scores, (attention if with_attention else None)


def _on_devices(params) -> bool:
  return all(isinstance(x, jax.Array) for x in jax.tree_util.tree_leaves(params))
