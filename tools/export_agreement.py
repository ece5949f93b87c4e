"""Our decoder and the CTranslate2 export of the same workdir, side by side on the same sentences.

python tools/export_agreement.py --workdir=DIR --source=FILE --reference=FILE [--lines=200]
Prints greedy agreement (identical outputs) and beam 4 BLEU for ours, CTranslate2 float32 and int8.
"""

import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

flags.DEFINE_string('workdir', None, 'Trained (or averaged) workdir.')
flags.DEFINE_string('source', None, 'Source sentences.')
flags.DEFINE_string('reference', None, 'Their references.')
flags.DEFINE_integer('lines', 200, 'Sentences used.')
flags.DEFINE_integer('average_last', None, 'Checkpoints averaged (default: the config\'s average_last).')


def ct2_translate(translator, processor, sources, beam_size, alpha, extra, max_positions):
  pieces = [processor.encode(s, out_type=str) for s in sources]
  out = [None] * len(sources)
  for length in sorted({len(p) for p in pieces}):  # one length limit per batch: input + extra, as ours
    rows = [i for i, p in enumerate(pieces) if len(p) == length]
    found = translator.translate_batch([pieces[i] for i in rows], beam_size=beam_size, length_penalty=alpha,
                                       max_decoding_length=min(length + 1 + extra, max_positions))
    for i, hypothesis in zip(rows, found):
      out[i] = processor.decode_pieces(hypothesis.hypotheses[0])
  return out


def main(argv):
  del argv
  import ctranslate2
  from flax_transformer import export, parallel_text, scoring
  from flax_transformer.translator import Translator
  f = flags.FLAGS
  sources = parallel_text.read_lines(f.source)[:f.lines]
  references = parallel_text.read_lines(f.reference)[:f.lines]
  ours = Translator.from_workdir(f.workdir, average_last=f.average_last)
  extra, max_positions = ours.max_extra_length, ours.model_config.max_positions
  rows = []
  with tempfile.TemporaryDirectory() as directory:
    for quantization in ('float32', 'int8'):
      export.export(f.workdir, f'{directory}/{quantization}', quantization, average_last=f.average_last)
    greedy = ours.translate(sources, beam_size=1)
    beam = ours.translate(sources, beam_size=4, length_penalty_alpha=0.6)
    rows.append(('ours', None, scoring.bleu(beam, references)[0]))
    for quantization in ('float32', 'int8'):
      translator = ctranslate2.Translator(f'{directory}/{quantization}', device='cpu')
      their_greedy = ct2_translate(translator, ours.processor, sources, 1, 0.0, extra, max_positions)
      their_beam = ct2_translate(translator, ours.processor, sources, 4, 0.6, extra, max_positions)
      same = sum(a == b for a, b in zip(greedy, their_greedy))
      rows.append((f'CTranslate2 {ctranslate2.__version__} {quantization}', same,
                   scoring.bleu(their_beam, references)[0]))
  print(f'{len(sources)} sentences of {f.source}, checkpoint(s) {list(ours.checkpoints)} of {f.workdir}\n')
  print('| decoder | greedy output identical to ours | beam 4 BLEU |\n|---|---|---|')
  for name, same, bleu in rows:
    print(f'| {name} | {"-" if same is None else f"{same} of {len(sources)}"} | {bleu:.2f} |')


if __name__ == '__main__':
  flags.mark_flags_as_required(['workdir', 'source', 'reference'])
  app.run(main)
