"""A workdir's checks and its config.json: another run's model or vocabulary refused, compute choices free to
change, older config.json files read under today's names, a damaged one a one-line error."""

import json

import pytest

from configs import tiny
from flax_transformer import settings, workdirs
from flax_transformer.errors import WorkdirError


def test_a_workdir_of_another_model_is_refused_and_compute_choices_may_change(tmp_path):
  config = tiny.get_config()
  workdirs.check(str(tmp_path), settings.resolve(config, 'cpu'))  # empty: fine
  workdirs.write_config(str(tmp_path), settings.to_json(config))
  changed = tiny.get_config()
  changed.model.dropout_rate, changed.model.dtype, changed.model.attention = 0.3, 'bfloat16', 'explicit'
  workdirs.check(str(tmp_path), settings.resolve(changed, 'cpu'))  # how the same network is computed may change
  changed.model.d_ff = 2 * config.model.d_ff
  with pytest.raises(WorkdirError, match=rf'holds a run with model.d_ff={config.model.d_ff} but this config has '
                                         rf'{2 * config.model.d_ff}; use a new --workdir'):
    workdirs.check(str(tmp_path), settings.resolve(changed, 'cpu'))
  other = tiny.get_config()
  other.target_lang = 'fr'
  with pytest.raises(WorkdirError, match="holds a run with target_lang='de' but this config has 'fr'"):
    workdirs.check(str(tmp_path), settings.resolve(other, 'cpu'))


def test_an_older_config_json_reads_under_todays_names_and_resumes(tmp_path):
  config = tiny.get_config()
  old = json.loads(config.to_json())
  old['max_length'] = old.pop('max_train_length')
  old['model']['max_len'] = old['model'].pop('max_positions')
  del old['max_skipped_steps']
  (tmp_path / workdirs.CONFIG_FILENAME).write_text(json.dumps(old))
  saved = workdirs.read_config(str(tmp_path))
  assert saved.max_train_length == config.max_train_length and saved.model.max_positions == config.model.max_positions
  assert saved.max_skipped_steps == 0
  workdirs.check(str(tmp_path), settings.resolve(config, 'cpu'))  # the same model under its new names: it may resume


def test_a_damaged_or_missing_config_json_is_a_one_line_error(tmp_path):
  with pytest.raises(WorkdirError, match='has no config.json; point --workdir at a directory written by train.py'):
    workdirs.read_config(str(tmp_path))
  (tmp_path / workdirs.CONFIG_FILENAME).write_text('{"model": {')
  with pytest.raises(WorkdirError, match=r'config.json is damaged \(.* at line 1\); restore it') as error:
    workdirs.read_config(str(tmp_path))
  assert '\n' not in str(error.value)


def test_every_file_a_stage_declares_it_reads_is_kept_from_the_runs_writes(tmp_path):
  """The rule that training writes onto nothing it reads covers every field declared `read`, without a list: a
  stage given a new file field (a lexicon, say) is refused when its file lies inside what training writes, as
  the test split's files are."""
  import dataclasses

  from flax_transformer import parallel_text
  from flax_transformer.errors import UserError
  from flax_transformer.settings_fields import setting
  from configs import tiny

  @dataclasses.dataclass(frozen=True)
  class WithLexicon(parallel_text.DataSettings):
    lexicon: str = setting('A bilingual lexicon the run reads.', read=True, default='')

  data = settings.resolve(tiny.get_config()).data
  workdir = tmp_path / 'run'
  inside = str(workdir / 'checkpoints' / 'lexicon.txt')
  workdirs.check_inputs(str(workdir), WithLexicon(**dataclasses.asdict(data), lexicon=str(tmp_path / 'lexicon.txt')))
  for stage, field in ((WithLexicon(**dataclasses.asdict(data), lexicon=inside), 'config.lexicon'),
                       (dataclasses.replace(data, test_source=inside), 'config.test_source')):
    with pytest.raises(UserError) as error:
      workdirs.check_inputs(str(workdir), stage)
    assert str(error.value) == (f'{workdir}/checkpoints, which training writes, holds {field} {inside}, which this '
                                f'program reads; choose another --workdir')
