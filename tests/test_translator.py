"""flax_transformer.Translator: translations in order, n-best lists, scores, alignments, no recompilation."""

import functools

import flax.linen as nn
import jax
import numpy as np
import pytest

from flax_transformer import engine, search, sentence_batches, steps, tokenizer
from flax_transformer.errors import UserError
from flax_transformer.model import Transformer, TransformerConfig
from flax_transformer.translator import Translator
from tests.helpers.corpus import write_corpus

LINES = ['the cat sat on the mat', 'red house', 'a dog runs fast on the big tree', 'blue', '',
         'the small child sat', 'a woman and a man run slow']
TARGETS = ['MAT THE ON SAT CAT THE', 'HOUSE RED', 'TREE BIG THE ON FAST RUNS DOG A', 'BLUE', 'X',
           'SAT CHILD SMALL THE', 'SLOW RUN MAN A AND WOMAN A']


@pytest.fixture(scope='module')
def translator(tmp_path_factory):
  """Random untied weights (varied translations, so a reordering shows) over a 64-piece vocabulary."""
  directory = str(tmp_path_factory.mktemp('vocabulary'))
  _, sources, targets = write_corpus(directory, 300, 0, 'train')
  tokenizer.train_sentencepiece(zip(sources, targets), f'{directory}/spm.model', 64)
  processor = tokenizer.load(f'{directory}/spm.model', 64)
  config = TransformerConfig(vocab_size=64, d_model=16, num_heads=2, d_ff=32, num_encoder_layers=2,
                             num_decoder_layers=2, max_positions=128, share_embeddings=False, dropout_rate=0.0)
  dummy = np.ones((1, 4), np.int32)
  params = nn.meta.unbox(jax.jit(Transformer(config).init)(jax.random.key(3), dummy, dummy)['params'])
  return Translator(params, config, processor, beam_size=2, length_penalty_alpha=0.6, max_extra_length=4)


def test_translations_come_back_in_input_order(translator):
  together = translator.translate(LINES)  # one length-sorted batch
  alone = [translator.translate([line])[0] for line in LINES]
  assert together == alone
  assert together[4] == ''  # an empty line translates to an empty line
  assert len(set(together)) >= 3  # varied translations, so a reordering would not pass unnoticed


@pytest.mark.slow  # 8 s or more of compilation and steps on 2 cores (the marker)
def test_a_second_call_with_seen_lengths_compiles_nothing(translator):
  calls = lambda order: (translator.translate([LINES[i] for i in order]), translator.n_best(LINES, 2),
                         translator.score(LINES, TARGETS), translator.alignments(LINES, TARGETS))
  calls(range(len(LINES)))
  compiled = []
  listener = lambda name, *_, **__: compiled.append(name) if name == '/jax/core/compile/backend_compile_duration' else None
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    calls(reversed(range(len(LINES))))  # other order, same lengths
    assert compiled == []
    translator.translate(['dog ' * 30])  # a longer sentence: a new shape, which the listener does see
    assert compiled
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)


def test_score_is_the_unsmoothed_training_loss(translator):
  scores = translator.score(LINES, TARGETS)
  encode = lambda text: translator.processor.encode(text) + [1]
  rows = [(encode(s) if s else [1], encode(t)) for s, t in zip(LINES, TARGETS)]
  width = max(max(len(s), len(t)) for s, t in rows)
  batch = {name: np.array([side + [0] * (width - len(side)) for side in sides], np.int32)
           for name, sides in (('inputs', [r[0] for r in rows]), ('targets', [r[1] for r in rows]))}
  eval_step = jax.jit(functools.partial(steps.eval_step, model_config=translator.model_config, label_smoothing=0.0))
  for i in range(len(rows)):  # the eval step's per-token sums, without smoothing, one pair at a time
    sums = eval_step(translator.params, {k: v[i:i + 1] for k, v in batch.items()})
    np.testing.assert_allclose(scores[i], -float(sums['nll']), rtol=1e-5, atol=1e-4)


def test_n_best_is_the_beam_ranked_and_its_first_is_the_translation(translator):
  results = translator.n_best(LINES, 3)
  best = translator.translate(LINES, beam_size=3)
  for i, hypotheses in enumerate(results):
    if not LINES[i]:
      assert hypotheses == []
      continue
    assert len(hypotheses) == 3 and hypotheses[0][0] == best[i]
    scores = [score for _, score in hypotheses]
    assert scores == sorted(scores, reverse=True)
  # The beam search's own tokens and scores for the first batch, through decode.py directly.
  inputs = np.array([translator.processor.encode(LINES[1]) + [1]], np.int32)
  tokens, scores = engine.jitted_translate(translator.model, 3, 0.6, 4, 16, translator.beam_top_k, 3)(
      translator.params, inputs)
  np.testing.assert_allclose([s for _, s in results[1]], np.asarray(scores)[0], atol=1e-4)


def test_alignments_are_the_argmax_of_the_penultimate_layers_cross_attention(translator):
  links = translator.alignments(LINES, TARGETS)
  processor, model = translator.processor, translator.model
  width = max(len(processor.encode(text)) for text in LINES + TARGETS) + 1
  padded = lambda rows: np.array([row + [1] + [0] * (width - 1 - len(row)) for row in rows], np.int32)  # [b, width]
  forward = jax.jit(lambda params, inputs, targets: model.apply({'params': params}, inputs, targets,
                                                                mutable=['intermediates'])[1])
  variables = forward(translator.params, padded([processor.encode(s) for s in LINES]),
                      padded([processor.encode(t) for t in TARGETS]))  # one forward pass, padding masked
  cross = variables['intermediates']['decoder']['cross_attention']['attention_weights'][0]  # [layers, b, h, t, s]
  for row, (source, target, line) in enumerate(zip(LINES, TARGETS, links)):
    if not source:
      assert line == ''
      continue
    source_ids, target_ids = processor.encode(source), processor.encode(target)
    weights = np.asarray(cross[-2, row]).mean(0)
    word = lambda ids: np.cumsum([i == 0 or processor.id_to_piece(x).startswith('\u2581') for i, x in enumerate(ids)]) - 1
    expected = sorted({(int(word(source_ids)[np.argmax(weights[t, :len(source_ids)])]), int(word(target_ids)[t]))
                       for t in range(len(target_ids))})
    assert line == ' '.join(f'{i}-{j}' for i, j in expected)
    assert {j for _, j in expected} == set(range(len(target.split())))  # every target word is aligned


@pytest.mark.parametrize('call,message', [
    (lambda t: t.score(['a', 'b'], ['A']), '2 sources but 1 targets'),
    (lambda t: t.translate(['a'], beam_size=0), 'beam_size=0: must be a positive integer'),
    (lambda t: t.n_best(['a'], 0), 'n_best k=0 must be a positive integer'),
    (lambda t: t.translate(['a'], length_penalty_alpha=-1.0), r'length_penalty_alpha=-1.0: must be in \[0, inf\)'),
    (lambda t: t.translate(['a'], length_penalty_alpha=float('nan')),
     r'length_penalty_alpha=nan: must be in \[0, inf\)'),
    (lambda t: Translator(t.params, t.model_config, t.processor, max_extra_length=-5),
     'max_extra_length=-5: must be a non-negative integer'),
    (lambda t: Translator(t.params, t.model_config, t.processor, beam_stop='never'),
     "beam_stop='never': must be one of bound, beam_ended"),
    (lambda t: t.translate(['a'], alpha=1.0, length_penalty_alpha=1.0),
     'alpha= and length_penalty_alpha= name the same'),
])
def test_bad_arguments_are_one_line_errors(translator, call, message):
  with pytest.raises(UserError, match=message):
    call(translator)


def test_the_old_keyword_alpha_still_works_with_a_deprecation_warning(translator):
  with pytest.warns(DeprecationWarning, match='the keyword alpha= is now length_penalty_alpha='):
    old = translator.translate(LINES[:2], alpha=1.0)
  assert old == translator.translate(LINES[:2], length_penalty_alpha=1.0)
  with pytest.warns(DeprecationWarning):
    renamed = Translator(translator.params, translator.model_config, translator.processor, alpha=0.0)
  assert renamed.length_penalty_alpha == 0.0


def test_from_workdir_names_missing_checkpoints(trained_run, tmp_path):
  workdir, _ = trained_run
  with pytest.raises(UserError, match='no checkpoint at step 5'):
    Translator.from_workdir(workdir, step=5)
  translator = Translator.from_workdir(workdir, step=12)
  assert translator.checkpoints == (12,) and translator.beam_size == 4
  assert translator.translate(['the cat sat']) == Translator.from_workdir(workdir, average_last=1).translate(['the cat sat'])


def test_split_pieces_stay_within_the_limit():
  class Characters:  # a stand-in tokenizer: one token per character
    encode = staticmethod(lambda text: list(text))

  sentence = 'One two. Three four five! Six? Seven eight nine ten.'
  pieces = sentence_batches.split_at_punctuation(Characters, sentence, 20)
  assert ' '.join(pieces) == sentence
  assert pieces == ['One two.', 'Three four five!', 'Six?', 'Seven eight nine ten.']
  assert sentence_batches.split_at_punctuation(Characters, sentence, 100) == [sentence]


def _member(translator, seed: int, **changes):
  """Another model over the translator's vocabulary: `changes` to its config, weights from `seed`."""
  import dataclasses
  config = dataclasses.replace(translator.model_config, **changes)
  dummy = np.ones((1, 4), np.int32)
  return nn.meta.unbox(jax.jit(Transformer(config).init)(jax.random.key(seed), dummy, dummy)['params']), config


@pytest.mark.slow  # 8 s or more of compilation and steps on 2 cores (the marker)
def test_an_ensemble_of_one_is_the_model_and_of_two_copies_decodes_as_one(translator):
  options = {'beam_size': 2, 'length_penalty_alpha': 0.6, 'max_extra_length': 4}
  one = Translator([translator.params], [translator.model_config], translator.processor, **options)
  assert one.translate(LINES) == translator.translate(LINES)
  assert one.score(LINES, TARGETS) == translator.score(LINES, TARGETS)
  two = Translator([translator.params] * 2, [translator.model_config] * 2, translator.processor, **options)
  assert two.translate(LINES) == translator.translate(LINES)
  assert two.translate(LINES, beam_size=1) == translator.translate(LINES, beam_size=1)  # greedy
  assert [[t for t, _ in h] for h in two.n_best(LINES, 2)] == [[t for t, _ in h] for h in translator.n_best(LINES, 2)]
  np.testing.assert_allclose(two.score(LINES, TARGETS), translator.score(LINES, TARGETS), rtol=1e-5, atol=1e-5)


def test_an_ensemble_of_two_models_scores_the_mean_of_their_log_probabilities(translator):
  """Two models of different shapes over one vocabulary: each pair's score is Σ_t log q(y_t), q the renormalised
  mean of the two models' log-probabilities, computed here in numpy from each model's own teacher-forced logits."""
  other, other_config = _member(translator, 11, d_model=32, num_heads=4, d_ff=48, num_decoder_layers=1)
  ensemble = Translator([translator.params, other], [translator.model_config, other_config], translator.processor,
                        beam_size=2, length_penalty_alpha=0.6, max_extra_length=4)
  sources, targets = LINES[:4], TARGETS[:4]
  source_ids, target_ids = ([translator.processor.encode(t) + [1] for t in texts] for texts in (sources, targets))
  pad = lambda rows: np.array([row + [0] * (max(map(len, rows)) - len(row)) for row in rows], np.int32)
  log_softmax = lambda x: x - np.log(np.sum(np.exp(x - x.max(-1, keepdims=True)), -1, keepdims=True)) - x.max(-1, keepdims=True)
  logs = [log_softmax(np.asarray(jax.jit(Transformer(c).apply)({'params': p}, pad(source_ids), pad(target_ids)),
                                 np.float64))
          for p, c in ((translator.params, translator.model_config), (other, other_config))]  # [4, t, v] each
  q = log_softmax((logs[0] + logs[1]) / 2)
  expected = [float(sum(q[i, t, y] for t, y in enumerate(target))) for i, target in enumerate(target_ids)]
  np.testing.assert_allclose(ensemble.score(sources, targets), expected, rtol=1e-4)
  with pytest.raises(UserError, match='alignments come from one model'):
    ensemble.alignments(sources, targets)


@pytest.mark.slow  # 8 s or more of compilation and steps on 2 cores (the marker)
def test_slots_spread_over_eight_devices_translate_as_one_device_does(translator):
  """The engine's slots sharded over the suite's 8 CPU devices (the parameters replicated on each): the same
  translations, n-best lists and scores as one device, for beam search, greedy search and an ensemble."""
  assert jax.local_device_count() == 8
  params, config = translator.params, translator.model_config
  spread = Translator(params, config, translator.processor, beam_size=2, length_penalty_alpha=0.6,
                      max_extra_length=4, devices=8)
  assert spread.mesh.size == 8 and len(jax.tree_util.tree_leaves(spread.params)[0].sharding.device_set) == 8
  decoder = engine.Engine(spread.model, spread.params, search.BeamSearch(2), slots=16, max_extra_length=4,
                          max_positions=128, mesh=spread.mesh)
  state = decoder.shape(spread.encode(LINES)).programs.empty(spread.params)
  shards = state['live_tokens'].addressable_shards  # [S, n, L + 1] spread: S / 8 slots on each device
  assert len(shards) == 8 and {shard.data.shape[0] for shard in shards} == {state['live_tokens'].shape[0] // 8}
  assert spread.translate(LINES) == translator.translate(LINES)
  assert spread.translate(LINES, beam_size=1) == translator.translate(LINES, beam_size=1)
  for ours, theirs in zip(spread.n_best(LINES, 2), translator.n_best(LINES, 2)):
    assert [text for text, _ in ours] == [text for text, _ in theirs]
    np.testing.assert_allclose([s for _, s in ours], [s for _, s in theirs], rtol=1e-5, atol=1e-5)
  pair = dict(beam_size=2, length_penalty_alpha=0.6, max_extra_length=4)
  ensemble = Translator([params, params], [config, config], translator.processor, **pair)
  spread_ensemble = Translator([params, params], [config, config], translator.processor, devices=8, **pair)
  assert spread_ensemble.translate(LINES) == ensemble.translate(LINES)


def test_more_devices_than_the_process_has_is_a_one_line_error(translator):
  with pytest.raises(UserError, match=r'devices=9: this process has 8 local device\(s\); give 1 to 8'):
    Translator(translator.params, translator.model_config, translator.processor, devices=9)
  for wrong in (0, -1, 1.5, float('nan'), 'two', True):
    with pytest.raises(UserError, match=r'^devices='):
      Translator(translator.params, translator.model_config, translator.processor, devices=wrong)
