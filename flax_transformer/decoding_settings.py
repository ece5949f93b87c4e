"""How a trained model decodes, in one place: `DecodeSettings`, each field declared once with its default (the
paper's, §6.1), its allowed values and its description. A run's config sets them (settings.py checks them from
these declarations), the Translator starts from a run's or from the defaults and takes changes through
`replace`, and translate.py's flags are checked by the same declarations. Nothing here imports JAX, so a
program can define its flags from it before JAX starts.
"""

import dataclasses

import sacrebleu

from flax_transformer import settings_fields
from flax_transformer.errors import ArgumentError
from flax_transformer.settings_fields import setting

STRATEGIES = ('beam', 'greedy', 'sampling')  # search.STRATEGIES' names: how a sentence's output is chosen
BEAM_STOPS = ('bound', 'beam_ended')  # search.beam_search's stopping rules
CONSTRAINT_ORDERS = ('unordered', 'ordered')  # search.ConstrainedBeamSearch: phrases met in any order, or in theirs
SAMPLING = {'temperature': 1.0, 'top_k': 0, 'top_p': 1.0, 'num_samples': 1}  # sampling's settings, and their neutral
# values, which every other strategy has
TOP_K = ('two_stage', 'lax')  # search.top_k's two ways; a run's 'auto' picks one per platform (platforms.top_k)
BLEU_TOKENIZERS = tuple(sorted(sacrebleu.metrics.BLEU.TOKENIZERS))  # sacreBLEU's own list
CALLS = ('flag', 'request')  # `given`: a flag of translate.py and the server, and a field of /translate requests
FLAGS = ('flag',)  # a flag only


@dataclasses.dataclass(frozen=True)
class DecodeSettings:
  """§6.1 decoding and its scoring: config fields of these names, the Translator's keyword arguments, and where
  a field says so (`given`) translate.py's and the server's flags and the server's request fields."""
  strategy: str = setting("How each output is chosen (search.STRATEGIES): 'beam' (§6.1), 'greedy' (the most "
                          "probable token at each step) or 'sampling' (drawn from the model's distribution: "
                          "back-translation).", choices=STRATEGIES, before='beam', given=CALLS, default='beam')
  beam_size: int = setting('§6.1 beam size (4); a beam of 1 decodes as greedy search does.', minimum=1,
                           given=CALLS, default=4)
  length_penalty_alpha: float = setting('§6.1 length-penalty exponent α (0.6); 0: no penalty.', low=0.0,
                                        high=float('inf'), given=CALLS, default=0.6)
  max_extra_length: int = setting('§6.1 an output is at most its input + this many tokens (50).', minimum=0,
                                  default=50)
  beam_stop: str = setting("When a sentence's beam search stops: 'bound' (tensor2tensor's: once no live hypothesis "
                           "can still beat the best ended one; the result of running to the length limit) or "
                           "'beam_ended' (fairseq's and CTranslate2's: once beam-size hypotheses have ended among "
                           "the steps' beam-size best; fewer steps, may keep a shorter output).", choices=BEAM_STOPS,
                           before='bound', given=CALLS, default='bound')
  beam_top_k: str = setting("How the beam's top-k (and greedy's best token) is found: 'two_stage' (block maxima "
                            "first, faster on CPU), 'lax' (jax.lax.top_k); 'auto': by platform.",
                            choices=TOP_K + ('auto',), before='auto', default='auto')
  temperature: float = setting("Sampling: the model's logits divided by this before drawing (1: its own "
                               "distribution; lower: closer to greedy).", greater=0.0, before=1.0, given=CALLS,
                               default=1.0)
  top_k: int = setting('Sampling: draw from the k most probable tokens only (0: all).', minimum=0, before=0,
                       given=CALLS, default=0)
  top_p: float = setting('Sampling: draw from the most probable tokens whose probabilities add up to p (nucleus '
                         'sampling; 1: all).', check=lambda value: _probability('config.top_p', value), before=1.0,
                         given=CALLS, default=1.0)
  num_samples: int = setting('Sampling: translations drawn per sentence.', minimum=1, before=1, given=CALLS, default=1)
  sampling_seed: int = setting("Sampling: the seed; a sentence's samples depend only on it, the sentence's "
                               'number and the sample\'s.', minimum=0, before=0, given=CALLS, default=0)
  constraint_order: str = setting("Lexical constraints (search.ConstrainedBeamSearch): 'unordered' (each phrase "
                                  "anywhere in the output) or 'ordered' (in the order given, one after another; "
                                  "fairseq's --constraints ordered).", choices=CONSTRAINT_ORDERS, before='unordered',
                                  given=CALLS, default='unordered')
  decode_slots: int = setting('Sentences the decoding engine decodes at once (engine.py), each with its beam; '
                              'a finished one hands its slot to the next.', minimum=1, before=128, given=FLAGS,
                              default=128)
  eval_tokens_per_batch: int = setting('Source tokens of a batch scored or aligned under teacher forcing, and of '
                                       'a validation loss batch.', minimum=1, given=FLAGS, default=8192)
  bleu_tokenize: str = setting("sacreBLEU's tokenizer for validation BLEU and translate.py --reference ('none': "
                               "pre-tokenized text).", choices=BLEU_TOKENIZERS, before='13a', default='13a')

  def replace(self, **changes) -> 'DecodeSettings':
    """These settings with `changes` (None: unchanged), each checked against its declaration."""
    known = [f.name for f in dataclasses.fields(self)]
    unknown = sorted(set(changes) - set(known))
    if unknown:
      raise ArgumentError(f'{unknown[0]}= is not a decoding setting; the decoding settings are {", ".join(known)}')
    changes = {name: value for name, value in changes.items() if value is not None}
    check(changes)
    changed = dataclasses.replace(self, **changes)
    check({name: getattr(changed, name) for name in ('strategy', *SAMPLING)})  # sampling's settings, with sampling
    return changed


def given(where: str) -> tuple[str, ...]:
  """The settings whose values may also be given `where`: 'flag' (translate.py's and the server's flags) or
  'request' (the server's /translate fields); each is defined there from its declaration here."""
  return tuple(f.name for f in dataclasses.fields(DecodeSettings) if where in f.metadata['given'])


def _probability(name: str, value) -> None:
  from flax_transformer.errors import ConfigError
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
    raise ConfigError(f'{name}={value!r}: must be in (0, 1] (1: every token)')


def check(values: dict, spelled=lambda name: name) -> None:
  """Decoding values ({field: value}; None: not given), wherever they come from: a one-line error naming each
  as the caller wrote it (`spelled(name)`: '--alpha', 'length_penalty_alpha', ...)."""
  settings_fields.check_values(DecodeSettings, values, spelled)
  if values.get('top_p') is not None:
    _probability(spelled('top_p'), values['top_p'])
  strategy = values.get('strategy')
  if strategy is not None and strategy != 'sampling':
    for name, neutral in SAMPLING.items():
      if values.get(name) is not None and values[name] != neutral:
        fix = 'for the K best of the beam give --n_best=K' if name == 'num_samples' else 'leave it out'
        raise ArgumentError(f'{spelled(name)}={values[name]!r} is a setting of sampling and the strategy is '
                            f'{strategy!r}; give {spelled("strategy")}=sampling, or {fix}')
