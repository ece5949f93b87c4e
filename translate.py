"""Translate with a trained model: python translate.py --workdir=DIR --input=FILE|- [--output=FILE] [--reference=FILE]

Restores parameters only (no optimizer state), averaged over the config's `average_last` checkpoints
unless --step or --average_last says otherwise, decodes with the config's beam search defaults
(beam 4, α 0.6, max length = input + 50 for the paper configs) in length-sorted batches, and writes one
line per input line, in input order. With --reference, prints sacreBLEU and its signature.
"""

import gzip
import os
import sys

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')  # TensorFlow's C++ start-up chatter

from absl import app, flags, logging

flags.DEFINE_string('workdir', None, 'Training workdir (config.json, sentencepiece.model, checkpoints/).')
flags.DEFINE_string('checkpoint_dir', None, 'A checkpoints/ directory to use instead of the workdir\'s.')
flags.DEFINE_integer('step', None, 'Use this checkpoint step alone.')
flags.DEFINE_integer('average_last', None, 'Average the last K checkpoints (default: the config\'s average_last).')
flags.DEFINE_string('input', '-', 'Source text file (plain or .gz), or - for stdin.')
flags.DEFINE_string('output', '-', 'Where to write translations, or - for stdout.')
flags.DEFINE_string('reference', None, 'Reference translations (plain or .gz): print sacreBLEU.')
flags.DEFINE_integer('beam_size', None, 'Beam size (default: the config\'s; 1 = greedy).')
flags.DEFINE_float('alpha', None, 'Length-penalty exponent (default: the config\'s).')
flags.DEFINE_integer('batch_tokens', None, 'Source tokens per decoding batch (default: config eval_tokens_per_batch).')
flags.DEFINE_enum('bleu_tokenize', None, ['13a', 'none', 'intl', 'zh', 'char'],
                  'sacreBLEU tokenizer (default: the config\'s bleu_tokenize): 13a for detokenized text, '
                  'none for pre-tokenized references.')
flags.DEFINE_bool('lowercase', False, 'Case-insensitive BLEU.')
flags.DEFINE_bool('split_long', False, 'Translate lines longer than the model takes in pieces split at sentence '
                  'punctuation, instead of cutting them (a warning counts them either way).')
flags.mark_flags_as_required(['workdir'])


def read_input(path: str) -> list[str]:
  from flax_transformer import input_pipeline
  if path == '-':
    return input_pipeline.decode_lines(sys.stdin.buffer.read(), 'standard input')
  return input_pipeline.read_lines(path)


def read_references(path: str, count: int) -> list[str]:
  """The reference lines, checked against the input's line count before anything is decoded."""
  from flax_transformer import input_pipeline
  references = input_pipeline.read_lines(path)
  if len(references) != count:
    raise input_pipeline.DataError(f'{path} has {len(references)} lines but the input has {count}; '
                                   f'give the reference of this input')
  return references


def run(f) -> None:
  import jax
  from flax_transformer import platforms
  platforms.import_tensorflow_quietly()
  from flax_transformer import average, checkpointing, evaluation, input_pipeline, tokenizer
  from flax_transformer.errors import WorkdirError
  from flax_transformer.model import TransformerConfig
  import flax.linen as nn
  from flax_transformer import partitioning

  from flax_transformer import storage
  if f.output != '-':  # before anything is loaded or compiled
    storage.check_writable(storage.path(f.output).parent, 'the folder of --output', 'choose another --output')
  config = checkpointing.read_config(f.workdir)
  model_config = TransformerConfig.from_config(config)
  vocab_path = config.vocab_path or f'{f.workdir}/{tokenizer.VOCAB_FILENAME}'
  processor = tokenizer.load(vocab_path, model_config.vocab_size)
  source = f.checkpoint_dir or f.workdir
  if f.step is not None:
    if f.step not in checkpointing.available_steps(source):
      raise WorkdirError(f'no checkpoint at step {f.step} in {source}; available: {checkpointing.available_steps(source)}')
    params = checkpointing.restore_params(source, f.step, nn.meta.unbox(partitioning.abstract_params(model_config)))
    chosen = [f.step]
  else:
    count = f.average_last if f.average_last is not None else config.average_last
    params, chosen = average.averaged_params(source, count, model_config)
  sentences = read_input(f.input)
  references = read_references(f.reference, len(sentences)) if f.reference else None
  limit = model_config.max_len - 1  # source tokens the model takes, with the end-of-sentence token
  encoded = input_pipeline.encode_sentences(processor, sentences)
  too_long = [i for i, ids in enumerate(encoded) if len(ids) > limit]
  if too_long:
    shown = ', '.join(str(i + 1) for i in too_long[:10]) + (', ...' if len(too_long) > 10 else '')
    what = ('split at sentence punctuation and translated in pieces' if f.split_long else
            'cut to fit (--split_long translates them in pieces split at sentence punctuation)')
    print(f'warning: {len(too_long)} input line(s) longer than the model\'s {limit} tokens (line {shown}) are '
          f'{what}', file=sys.stderr)
  pieces, owners = sentences, list(range(len(sentences)))
  if f.split_long and too_long:
    long_set, split_ids = set(too_long), []
    pieces, owners = [], []
    for i, (sentence, ids) in enumerate(zip(sentences, encoded)):
      split = input_pipeline.split_at_punctuation(processor, sentence, limit) if i in long_set else [sentence]
      pieces += split
      owners += [i] * len(split)
      split_ids += input_pipeline.encode_sentences(processor, split) if i in long_set else [ids]
    encoded = split_ids
  print(f'translating {len(sentences)} lines with checkpoint(s) {chosen} on {jax.device_count()} '
        f'{jax.default_backend()} device(s)', file=sys.stderr)
  progress = lambda done, total: print(f'\r{done}/{total} sentences', end='', file=sys.stderr, flush=True)
  translated = evaluation.translate_sentences(
      params, model_config, processor, pieces, encoded=encoded,
      beam_size=f.beam_size if f.beam_size is not None else config.beam_size,
      alpha=f.alpha if f.alpha is not None else config.length_penalty_alpha,
      max_extra_length=config.max_extra_length,
      batch_tokens=f.batch_tokens or config.eval_tokens_per_batch, progress=progress,
      top_k=config.get('beam_top_k', 'auto'))
  print(file=sys.stderr)
  translations = [''] * len(sentences)
  for owner, translation in zip(owners, translated):
    translations[owner] = f'{translations[owner]} {translation}'.strip()
  text = ''.join(t + '\n' for t in translations)
  if f.output == '-':
    sys.stdout.write(text)
  else:
    data = text.encode('utf-8')
    storage.write_atomic(f.output, gzip.compress(data) if f.output.endswith('.gz') else data)
  if references is not None:
    tokenize = f.bleu_tokenize or config.get('bleu_tokenize', '13a')
    score, signature = evaluation.bleu(translations, references, tokenize, f.lowercase)
    print(f'BLEU = {score:.2f} ({signature})', file=sys.stderr)
    if config.dataset.startswith('wmt14'):
      score, label = evaluation.paper_bleu(translations, references)
      print(f'BLEU = {score:.2f} ({label})', file=sys.stderr)


def main(argv):
  if not flags.FLAGS['verbosity'].present:  # Orbax logs every save at INFO; --verbosity=0 shows it
    logging.set_verbosity(logging.WARNING)
  del argv
  from flax_transformer.errors import UserError
  try:
    run(flags.FLAGS)
  except UserError as error:
    print(f'error: {error}', file=sys.stderr)
    sys.exit(1)


if __name__ == '__main__':
  app.run(main)
