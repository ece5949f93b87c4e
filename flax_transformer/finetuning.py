"""Fine-tuning: a new run that starts from another run's parameters (`config.init_from = 'WORKDIR[:STEP]'`).

The new run takes the source's parameters (its newest checkpoint, or STEP) and vocabulary, and a fresh
optimizer state and schedule from step 0. Only the parameters' shapes must agree: dropout, dtype and the
other compute choices, the data, the schedule and the batch size may all change. Once the new run has a
checkpoint of its own it resumes from that, as any run does.
"""

import dataclasses

from flax_transformer import checkpointing, storage, tokenizer, weights, workdirs
from flax_transformer.errors import WorkdirError
from flax_transformer.model import TransformerConfig

SHAPE_FIELDS = ('vocab_size', 'd_model', 'num_heads', 'd_ff', 'num_encoder_layers', 'num_decoder_layers',
                'share_embeddings', 'learned_positions', 'pre_norm')  # and max_positions with learned positions


@dataclasses.dataclass(frozen=True)
class Source:
  workdir: str
  step: int
  vocab_path: str


def _parse(init_from: str) -> tuple[str, int | None]:
  """'WORKDIR' or 'WORKDIR:STEP' (a URL's own colon is not a step separator)."""
  head, _, tail = init_from.rpartition(':')
  if head and tail.isdigit() and not head.endswith(':/') and head not in ('gs', 's3'):
    return head, int(tail)
  return init_from, None


def source(init_from: str, model_config: TransformerConfig, vocab_path: str = '') -> Source | None:
  """The checked source of config.init_from ('' = none) for a run of `model_config` with the vocabulary
  config.vocab_path (`vocab_path`, '' = the source's), or a one-line error naming the mismatch."""
  if not init_from:
    return None
  workdir, step = _parse(init_from)
  fix = 'point --config.init_from at a workdir of the same model shape, or change the model to match it'
  saved = workdirs.read_settings(workdir, '--config.init_from')
  saved_model = saved.model
  fields = SHAPE_FIELDS + (('max_positions',) if model_config.learned_positions else ())
  for field in fields:
    if getattr(saved_model, field) != getattr(model_config, field):
      raise WorkdirError(f'config.init_from={init_from} holds model.{field}={getattr(saved_model, field)!r} '
                         f'but this config has {getattr(model_config, field)!r}; {fix}')
  steps = checkpointing.available_steps(workdir)
  if not steps:
    raise WorkdirError(f'config.init_from={init_from}: {workdir} holds no checkpoint; train it first')
  if step is not None and step not in steps:
    raise WorkdirError(f'config.init_from={init_from}: no checkpoint at step {step}; available: {steps}')
  source_vocab = saved.data.vocab_path or f'{storage.path(workdir)}/{tokenizer.VOCAB_FILENAME}'
  if vocab_path and storage.path(vocab_path).read_bytes() != storage.path(source_vocab).read_bytes():
    raise WorkdirError(f'config.vocab_path={vocab_path} differs from the vocabulary of config.init_from '
                       f'({source_vocab}); leave config.vocab_path empty to take the source\'s vocabulary')
  return Source(workdir, steps[-1] if step is None else step, source_vocab)


def copy_vocabulary(origin: Source, vocab_path: str, workdir) -> None:
  """The source's vocabulary becomes the new workdir's (unless config.vocab_path, `vocab_path`, names it)."""
  target = storage.path(workdir) / tokenizer.VOCAB_FILENAME
  if not vocab_path and not target.exists():
    storage.write_atomic(target, storage.path(origin.vocab_path).read_bytes())


def initial_params(origin: Source, state, state_shardings):
  """The fresh train state with the source's parameters, placed as `state_shardings` says."""
  params = weights.restore_params(origin.workdir, origin.step, state.params, state_shardings.params)
  return state.replace(params=params)
