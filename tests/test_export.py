"""The export program (python -m flax_transformer export): the same network in CTranslate2 (greedy tokens equal ours), int8, errors."""

import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax_transformer import checkpointing, parallel_text, settings, tokenizer, weights, workdirs
from flax_transformer.commands import export as export_command
from flax_transformer.model import Transformer
from tests.conftest import ROOT
from tests.helpers import programs

ctranslate2 = pytest.importorskip('ctranslate2')
MULTI30K = os.path.join(ROOT, '..', 'shared', 'data', 'multi30k')
EXTRA = 10  # output length = input + EXTRA, in both decoders


def _sentences():
  if os.path.exists(os.path.join(MULTI30K, 'val.en.gz')):
    return (parallel_text.read_lines(os.path.join(MULTI30K, 'val.en.gz'))[:200],
            parallel_text.read_lines(os.path.join(MULTI30K, 'val.de.gz'))[:200])
  import tempfile
  from tests.helpers.corpus import write_corpus
  _, source_lines, target_lines = write_corpus(tempfile.mkdtemp(), 200, 7, 'export_sentences')
  return source_lines, target_lines


@pytest.fixture(scope='module', params=[(False, True), (True, False)], ids=['post_ln_shared', 'pre_ln_untied'])
def workdir(request, tmp_path_factory):
  """A workdir (config, vocabulary, one checkpoint) of random weights, scaled ×3 for confident, varied output."""
  pre_norm, share = request.param
  directory = tmp_path_factory.mktemp('export')
  sources, targets = _sentences()
  tokenizer.train_sentencepiece(zip(sources, targets), str(directory / tokenizer.VOCAB_FILENAME), 500)
  from configs import tiny
  config = tiny.get_config()
  config.model.vocab_size, config.model.d_model, config.model.num_heads = 500, 32, 4
  config.model.d_ff, config.model.pre_norm, config.model.share_embeddings = 64, pre_norm, share
  config.max_extra_length, config.average_last = EXTRA, 1
  model_config = settings.model_settings(config)
  dummy = np.ones((1, 4), np.int32)
  params = nn.meta.unbox(Transformer(model_config).init(jax.random.key(3), dummy, dummy)['params'])
  params = jax.tree_util.tree_map(lambda x: np.asarray(x) * 3.0, params)
  weights.save_params(checkpointing.checkpoints_folder(directory), 1, params)
  workdirs.write_config(directory, settings.to_json(config))
  return str(directory), sources, targets


def _export(workdir, output, *flags):
  """python -m flax_transformer export with these flags, run in this process (tests/helpers/programs.py)."""
  return programs.run(export_command.main, ['export', f'--workdir={workdir}', f'--output={output}', *flags], text=True)


@pytest.mark.slow
def test_ctranslate2_greedy_gives_our_tokens(workdir, tmp_path):
  from flax_transformer.translator import Translator
  directory, sources, _ = workdir
  result = _export(directory, tmp_path / 'ct2')
  assert result.returncode == 0, result.stderr[-2000:]
  ours = Translator.from_workdir(directory, beam_size=1)
  theirs = ctranslate2.Translator(str(tmp_path / 'ct2'), device='cpu')
  pieces = [ours.processor.encode(s, out_type=str) for s in sources]
  their_pieces = [None] * len(sources)
  for length in sorted({len(p) for p in pieces}):  # CTranslate2 takes one length limit per batch: by length
    rows = [i for i, p in enumerate(pieces) if len(p) == length]
    found = theirs.translate_batch([pieces[i] for i in rows], beam_size=1,
                                   max_decoding_length=min(length + 1 + EXTRA, ours.model_config.max_positions))
    for i, hypothesis in zip(rows, found):
      their_pieces[i] = hypothesis.hypotheses[0]
  their_text = [ours.processor.decode_pieces(p) for p in their_pieces]
  differ = [i for i, (a, b) in enumerate(zip(ours.translate(sources), their_text)) if a != b]
  # Where the two differ, CTranslate2's every token must be a best (or tied-best) choice of our own model.
  gaps = []
  for i in differ:
    ids = [ours.processor.piece_to_id(p) for p in their_pieces[i]] + [1]
    inputs = np.array([ours.processor.encode(sources[i]) + [1]])
    log_probs = jax.nn.log_softmax(ours.model.apply({'params': ours.params}, inputs, np.array([ids]))[0], -1)
    log_probs = np.asarray(log_probs.at[:, 0].set(-jnp.inf))  # <pad> is never produced
    gaps.append(max(log_probs[t].max() - log_probs[t, ids[t]] for t in range(len(ids) - 1)))
  print(f'{len(sources) - len(differ)} of {len(sources)} identical; the others within {max(gaps, default=0):.2e} '
        f'of our best token at every step')
  # How many near-ties a decode meets depends on the CPU's float rounding: the count is printed, not bounded.
  assert max(gaps, default=0) < 1e-3, (differ, gaps)


@pytest.mark.slow
# One architecture: quantization and the request's checks do not depend on it (the greedy test covers both).
@pytest.mark.parametrize('workdir', [(False, True)], indirect=True, ids=['post_ln_shared'])
def test_int8_export_and_bad_requests(workdir, tmp_path):
  directory, sources, _ = workdir
  assert _export(directory, tmp_path / 'int8', '--quantization=int8').returncode == 0
  translator = ctranslate2.Translator(str(tmp_path / 'int8'), device='cpu')
  assert len(translator.translate_batch([['▁a', '▁man']], beam_size=4)[0].hypotheses[0]) >= 1
  for flags, message in ((['--quantization=int3'], '--quantization=int3 is not one CTranslate2 offers'),
                         ([], 'is not empty; choose a new --output')):
    result = _export(directory, tmp_path / 'int8', *flags)
    errors = [l for l in result.stderr.splitlines() if l.startswith('error: ')]
    assert result.returncode == 1 and len(errors) == 1 and message in errors[0], result.stderr[-1500:]
  assert sorted(os.listdir(tmp_path)) == ['int8']  # nothing half-written beside it
