"""The averaged workdir (python -m flax_transformer average): the mean of the chosen checkpoints' weights, or of
their moving averages, laid out as a workdir the Translator reads."""

import flax.linen as nn
import jax
import numpy as np

from flax_transformer import partitioning, weights, workdirs
from flax_transformer.commands import average
from flax_transformer.translator import Translator
from tests.conftest import TRAINED_STEPS


def test_the_moving_averages_of_the_last_two_checkpoints_make_a_workdir(trained_run, tmp_path):
  workdir, _ = trained_run
  output = str(tmp_path / 'ema_avg')
  assert average.main(['average', f'--workdir={workdir}', f'--output={output}', '--last=2', '--weights=ema']) == 0
  model = workdirs.read_settings(workdir).model
  abstract = nn.meta.unbox(partitioning.abstract_params(model))
  steps = (TRAINED_STEPS - 3, TRAINED_STEPS)
  ema = [jax.device_get(weights.restore_params(workdir, s, abstract, weights='ema')) for s in steps]
  trained = jax.device_get(weights.restore_params(workdir, TRAINED_STEPS, abstract))
  written = jax.device_get(weights.restore_params(output, TRAINED_STEPS, abstract))
  for got, a, b, w in zip(*(jax.tree_util.tree_leaves(t) for t in (written, *ema, trained))):
    np.testing.assert_allclose(got, (np.asarray(a, np.float32) + b) / 2, rtol=1e-6)
  assert not all(np.array_equal(a, w) for a, w in zip(jax.tree_util.tree_leaves(ema[1]), jax.tree_util.tree_leaves(trained)))
  translator = Translator.from_workdir(output)
  assert translator.checkpoints == (TRAINED_STEPS,) and len(translator.translate(['red house', 'a dog'])) == 2
