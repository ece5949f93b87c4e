"""Bad input, case by case, as a new user types it: each case a command (run in-process through its program's
`main`, or as a process where only a process shows the behaviour) or a library call, with the first line it
prints, its exit status, and the files that must be exactly as they were afterwards.

Placeholders in a case: {W} the suite's trained tiny run (shared: only read), {C} a copy of it the case may
damage, {A} an average of it, {T} the case's own folder (holding in.txt, three source lines), {corpus} the
run's corpus.
"""

import dataclasses
import gzip
import hashlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import pytest

from flax_transformer import checkpointing, corpora, storage
from flax_transformer.commands import average, export, serve, train, translate
from flax_transformer.errors import ArgumentError
from tests.conftest import ROOT, TRAINED_FLAGS, TRAINED_STEPS, free_port, subprocess_env, train_command
from tests.helpers import gcs_emulator

PROGRAMS = {'translate': translate.main, 'train': train.main, 'average': average.main, 'export': export.main,
            'serve': serve.main}


@dataclasses.dataclass(frozen=True)
class Case:
  id: str
  argv: tuple  # a program of PROGRAMS and its flags, with placeholders
  status: int
  first: str  # the start of the first stderr line that begins with 'error: ' or 'warning: '
  unchanged: tuple = ('{W}',)  # files and folders whose every file must be byte for byte as before
  prepare: Callable | None = None  # (paths) -> None, before the run: damage {C}, write a file...
  stdin: bytes = b''
  after: Callable | None = None  # (paths) -> None: more checks once the case has run
  patched: tuple = ()  # (object, attribute, value) set for the case alone


def _truncate(path, fraction=0.5):
  with open(path, 'r+b') as f:
    f.truncate(int(os.path.getsize(path) * fraction))


def _truncate_largest_array(p, step=TRAINED_STEPS):
  folder = os.path.join(p['C'], 'checkpoints', str(step), 'params')
  files = [os.path.join(d, f) for d, _, names in os.walk(folder) for f in names if os.path.basename(d) == 'd']
  _truncate(max(files, key=os.path.getsize))


def _lines(path) -> int:
  with open(path) as f:
    return f.read().count('\n')


def _write(relative: str, data: bytes):
  def prepare(p):
    path = relative.format(**p)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, 'wb') as f:
      f.write(data)
  return prepare


def _symlink(link: str, target: str):
  return lambda p: os.symlink(target.format(**p), link.format(**p))


def _corpus_variants(p):
  """Training files with one fault each, beside the good ones."""
  corpus = p['corpus']
  with gzip.open(f'{corpus}/train.src.gz', 'rb') as f:
    sources = f.read().split(b'\n')
  with gzip.open(f'{corpus}/train.tgt.gz', 'rb') as f:
    targets = f.read().split(b'\n')
  with gzip.open(f'{p["T"]}/short.tgt.gz', 'wb') as f:
    f.write(b'\n'.join(targets[:150]) + b'\n')
  sources[100] = b'\xff\xfe not UTF-8'
  with gzip.open(f'{p["T"]}/latin1.src.gz', 'wb') as f:
    f.write(b'\n'.join(sources))
  with open(f'{corpus}/train.src.gz', 'rb') as f:
    whole = f.read()
  with open(f'{p["T"]}/cut.src.gz', 'wb') as f:
    f.write(whole[:len(whole) // 2])


def _other_vocabulary(workdir):
  """The workdir's vocabulary replaced by one trained on other text (same size)."""
  import numpy as np
  from flax_transformer import tokenizer
  rng = np.random.default_rng(0)
  lines = [' '.join(''.join(rng.choice(list('qwxzjkvy'), rng.integers(2, 6))) for _ in range(8)) for _ in range(300)]
  tokenizer.train_sentencepiece(zip(lines, lines[::-1]), f'{workdir}/sentencepiece.model', 64)


def _another_model(p):
  """A workdir whose config.json is gone and whose checkpoints hold a model of another width."""
  os.remove(f'{p["C"]}/config.json')


def _empty_folder(relative):
  return lambda p: os.makedirs(relative.format(**p))


def _served(body_seconds: float, status: int = 200, terminate_after: float | None = None):
  """A URL template on 127.0.0.1 (a server in a daemon thread) whose files come one byte every `body_seconds`
  (a server that trickles), or whose every answer is `status` (404: nothing there); with `terminate_after`, this
  process is sent SIGTERM that many seconds into the first download (a user stopping it)."""
  import http.server

  class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
      if terminate_after is not None:
        threading.Timer(terminate_after, os.kill, (os.getpid(), signal.SIGTERM)).start()
      self.send_response(status)
      self.send_header('Content-Length', '100000')
      self.end_headers()
      try:
        for _ in range(0 if status != 200 else 100000):
          self.wfile.write(b'x')
          self.wfile.flush()
          time.sleep(body_seconds)
      except OSError:  # the client gave up
        pass

    def log_message(self, *args):
      pass

  server = http.server.ThreadingHTTPServer(('127.0.0.1', 0), Handler)
  server.daemon_threads = True
  threading.Thread(target=server.serve_forever, daemon=True).start()
  return f'http://127.0.0.1:{server.server_address[1]}/{{name}}'


def _dead_pid() -> int:
  process = subprocess.Popen([sys.executable, '-c', ''])
  process.wait()
  return process.pid


def _evaluations(*values):
  """Validation losses at steps 3, 6, 9... in {C}'s metrics (its judged split: the moving average's)."""
  def prepare(p):
    with open(f'{p["C"]}/train_metrics.jsonl', 'a') as f:
      for i, value in enumerate(values):
        f.write(json.dumps({'step': 3 * (i + 1), 'split': 'eval_ema', 'loss': value}) + '\n')
  return prepare


TRAIN = ('train',) + tuple(train_command('{T}/run', '{corpus}')[2:])  # the suite's tiny training command


def _train(*flags, workdir='{T}/run'):
  """The training command on `workdir`, over this process's devices (the suite's 8 CPU devices)."""
  kept = tuple(a for a in TRAIN if not a.startswith(('--workdir=', '--config.mesh_shape=')))
  return kept + (f'--workdir={workdir}', '--config.mesh_shape=(-1,1,1)') + flags


CASES = [
    # translate: its outputs never land on what it reads
    Case('translate_output_is_the_workdirs_config', ('translate', '--workdir={W}', '--input={T}/in.txt',
         '--output={W}/config.json'), 1, 'error: --output={W}/config.json is inside the workdir {W}, which this '
         'program reads; write the output to a place outside it'),
    Case('translate_output_is_the_vocabulary', ('translate', '--workdir={W}', '--input={T}/in.txt',
         '--output={W}/sentencepiece.model'), 1, 'error: --output={W}/sentencepiece.model is inside the workdir {W}'),
    Case('translate_output_is_the_input', ('translate', '--workdir={W}', '--input={T}/in.txt', '--output={T}/in.txt'),
         1, 'error: --output={T}/in.txt is the input {T}/in.txt', unchanged=('{W}', '{T}/in.txt')),
    Case('translate_output_through_a_link_into_the_workdir', ('translate', '--workdir={W}', '--input={T}/in.txt',
         '--output={T}/link/config.json'), 1, 'error: --output={T}/link/config.json is inside the workdir {W}',
         prepare=_symlink('{T}/link', '{W}')),
    Case('translate_output_spelled_with_dots', ('translate', '--workdir={W}', '--input={T}/in.txt',
         '--output={T}/../{T_name}/in.txt'), 1, 'error: --output={T}/../{T_name}/in.txt is the input {T}/in.txt',
         unchanged=('{W}', '{T}/in.txt')),
    Case('translate_input_is_a_folder', ('translate', '--workdir={W}', '--input={T}'), 1,
         'error: --input {T} is a folder; give the path of a text file'),
    Case('translate_output_is_a_folder', ('translate', '--workdir={W}', '--input={T}/in.txt', '--output={T}/out'), 1,
         'error: --output={T}/out is a folder; give the name of the file to write', prepare=_empty_folder('{T}/out')),
    Case('translate_config_json_of_random_bytes', ('translate', '--workdir={C}', '--input={T}/in.txt'), 1,
         'error: {C}/config.json is damaged (not UTF-8 text', prepare=_write('{C}/config.json', bytes(range(256)))),
    Case('translate_config_json_of_another_shape', ('translate', '--workdir={C}', '--input={T}/in.txt'), 1,
         'error: {C}/config.json is damaged (it holds JSON that is not a run config', prepare=_write(
             '{C}/config.json', b'[1, 2, 3]')),
    Case('translate_config_json_missing_a_field', ('translate', '--workdir={C}', '--input={T}/in.txt'), 1,
         'error: {C}/config.json is damaged or not a run config (config.adam_b1 is missing); restore it', prepare=_write(
             '{C}/config.json', json.dumps({'model': {'d_model': 16}}).encode())),
    Case('translate_truncated_vocabulary', ('translate', '--workdir={C}', '--input={T}/in.txt'), 1,
         'error: vocabulary file {C}/sentencepiece.model is damaged (not a SentencePiece model); restore it',
         prepare=lambda p: _truncate(f'{p["C"]}/sentencepiece.model')),
    Case('translate_falls_back_past_a_damaged_latest_checkpoint', ('translate', '--workdir={C}', '--input={T}/in.txt',
         '--average_last=1', '--output={T}/out.txt'), 0, f'warning: checkpoint {TRAINED_STEPS} in {{C}} is damaged (',
         unchanged=('{C}',), prepare=_truncate_largest_array,
         after=lambda p: _lines(f'{p["T"]}/out.txt') == 3 or pytest.fail('no output written')),
    Case('translate_a_damaged_checkpoint_asked_for', ('translate', '--workdir={C}', '--input={T}/in.txt',
         f'--step={TRAINED_STEPS}'), 1, f'error: checkpoint {TRAINED_STEPS} in {{C}} is damaged (', unchanged=('{C}',),
         prepare=_truncate_largest_array),
    Case('translate_score_with_a_longer_reference_on_stdin', ('translate', '--workdir={W}', '--input=-', '--score',
         '--reference={T}/ref.txt'), 1, 'error: standard input had 3 lines but {T}/ref.txt has 7',
         prepare=_write('{T}/ref.txt', b'x\n' * 7), stdin=b'red house\nthe cat\na dog\n'),
    Case('translate_checkpoint_dir_missing', ('translate', '--workdir={W}', '--input={T}/in.txt',
         '--checkpoint_dir={T}/nothing'), 1, 'error: --checkpoint_dir={T}/nothing is not a folder; give the '
         'checkpoints/ folder of a run'),
    Case('translate_checkpoint_dir_empty', ('translate', '--workdir={W}', '--input={T}/in.txt',
         '--checkpoint_dir={T}/empty'), 1, 'error: --checkpoint_dir={T}/empty holds no checkpoint',
         prepare=_empty_folder('{T}/empty')),
    Case('translate_the_moving_average_of_a_run_without_one', ('translate', '--workdir={A}', '--input={T}/in.txt',
         '--weights=ema'), 1, f'error: checkpoint {TRAINED_STEPS} in {{A}} holds no moving average of the weights',
         unchanged=('{A}',)),
    Case('translate_the_best_checkpoint_of_a_run_that_ranked_none', ('translate', '--workdir={W}', '--input={T}/in.txt',
         '--checkpoint=best'), 1, 'error: {W} holds no checkpoint ranked by validation bleu; train with '
         '--config.keep_best=K'),
    Case('translate_an_ensemble_of_two_vocabularies', ('translate', '--workdir={W},{C}', '--input={T}/in.txt'), 1,
         'error: {C} has another vocabulary than {W} (', prepare=lambda p: _other_vocabulary(p['C'])),
    Case('translate_an_ensemble_with_alignments', ('translate', '--workdir={W},{W}', '--input={T}/in.txt',
         '--alignment'), 1, 'error: --alignment reads one model and --workdir={W},{W} names 2; give one workdir'),
    Case('translate_alpha_nan', ('translate', '--workdir={W}', '--input={T}/in.txt', '--alpha=nan'), 1,
         'error: --alpha=nan: must be in [0, inf)'),
    Case('translate_alpha_inf', ('translate', '--workdir={W}', '--input={T}/in.txt', '--length_penalty_alpha=inf'), 1,
         'error: --length_penalty_alpha=inf: must be in [0, inf)'),
    Case('translate_devices_zero', ('translate', '--workdir={W}', '--input={T}/in.txt', '--devices=0'), 1,
         'error: --devices=0 must be 1 or more (leave it out for every local accelerator)'),
    Case('translate_devices_more_than_there_are', ('translate', '--workdir={W}', '--input={T}/in.txt',
                                                   '--devices=99'), 1,
         'error: devices=99: this process has 8 local device(s); give 1 to 8'),
    Case('translate_part_lines_negative', ('translate', '--workdir={W}', '--input={T}/in.txt', '--output={T}/out.txt',
                                           '--part_lines=-5'), 1,
         'error: --part_lines=-5 must be 0 or more lines (0 = the whole input as one part)'),
    Case('translate_num_processes_zero', ('translate', '--workdir={W}', '--input={T}/in.txt', '--num_processes=0'), 1,
         'error: --num_processes=0: must be a positive integer (Processes of the run, with coordinator_address)'),
    Case('translate_process_id_outside', ('translate', '--workdir={W}', '--input={T}/in.txt', '--num_processes=2',
                                          '--coordinator_address=localhost:1', '--process_id=2'), 1,
         'error: --process_id=2 is outside 0..1 (--num_processes=2); give each process its own id'),
    Case('translate_stdin_on_two_processes', ('translate', '--workdir={W}', '--num_processes=2',
                                              '--coordinator_address=localhost:1'), 1,
         'error: --input=- is read by one process and --num_processes=2; give --input=FILE (every process reads its '
         'share), or start one process'),
    Case('translate_storage_timeout_zero', ('translate', '--workdir={W}', '--input={T}/in.txt',
                                            '--storage_timeout_seconds=0'), 1,
         'error: --storage_timeout_seconds=0 must be 1 or more seconds'),
    Case('translate_top_p_zero', ('translate', '--workdir={W}', '--input={T}/in.txt', '--strategy=sampling',
                                  '--top_p=0'), 1, 'error: --top_p=0.0: must be in (0, 1] (1: every token)'),
    Case('translate_top_k_negative', ('translate', '--workdir={W}', '--input={T}/in.txt', '--strategy=sampling',
                                      '--top_k=-1'), 1, 'error: --top_k=-1: must be a non-negative integer'),
    Case('translate_temperature_zero', ('translate', '--workdir={W}', '--input={T}/in.txt', '--strategy=sampling',
                                        '--temperature=0'), 1, 'error: --temperature=0.0: must be positive'),
    Case('translate_temperature_inf', ('translate', '--workdir={W}', '--input={T}/in.txt', '--strategy=sampling',
                                       '--temperature=inf'), 1, 'error: --temperature=inf: must be finite'),
    Case('translate_top_p_nan', ('translate', '--workdir={W}', '--input={T}/in.txt', '--strategy=sampling',
                                 '--top_p=nan'), 1, 'error: --top_p=nan: must be in (0, 1] (1: every token)'),
    Case('translate_num_samples_with_beam', ('translate', '--workdir={W}', '--input={T}/in.txt', '--strategy=beam',
                                             '--num_samples=3'), 1,
         "error: --num_samples=3 is a setting of sampling and the strategy is 'beam'; give --strategy=sampling, "
         'or for the K best of the beam give --n_best=K'),
    Case('translate_n_best_with_sampling', ('translate', '--workdir={W}', '--input={T}/in.txt', '--strategy=sampling',
                                            '--n_best=2'), 1,
         "error: --n_best=2 lists the beam's best and --strategy=sampling draws; give --num_samples=2 for that many "
         'samples a line'),
    Case('train_top_p_with_beam', _train('--config.top_p=0.9'), 1,
         "error: config.top_p=0.9 is a setting of sampling and the strategy is 'beam'; give config.strategy=sampling, "
         'or leave it out'),
    Case('translate_prefix_file_short', ('translate', '--workdir={W}', '--input={T}/in.txt',
                                         '--prefix_file={T}/one_prefix.txt'), 1,
         'error: {T}/one_prefix.txt has 1 lines but the input has 3; give one prefix line per input line (an empty '
         'line for none)', prepare=_write('{T}/one_prefix.txt', b'RED\n')),
    Case('translate_prefix_the_vocabulary_cannot_spell', ('translate', '--workdir={W}', '--input={T}/in.txt',
                                                          '--prefix_file={T}/snowmen.txt'), 1,
         "error: prefix 0 ('☃☃') has text the vocabulary has no piece for (near",
         prepare=_write('{T}/snowmen.txt', '☃☃\n\n\n'.encode())),
    Case('translate_prefix_longer_than_the_limit', ('translate', '--workdir={W}', '--input={T}/in.txt',
                                                    '--prefix_file={T}/long_prefix.txt'), 1,
         'error: prefix 0 has 360 tokens and the output of its sentence at most 20 (its source\'s tokens + EOS + '
         'max_extra_length 10), EOS included; give a shorter prefix or a larger max_extra_length',
         prepare=_write('{T}/long_prefix.txt', b'RED ' * 120 + b'\n\n\n')),
    Case('translate_prefix_with_score', ('translate', '--workdir={W}', '--input={T}/in.txt', '--reference={T}/in.txt',
                                         '--score', '--prefix_file={T}/in.txt'), 1,
         'error: --prefix_file starts each translation and --score scores given lines; choose one'),
    Case('translate_constraints_with_sampling', ('translate', '--workdir={W}', '--input={T}/in.txt',
                                                 '--strategy=sampling', '--constraints_file={T}/in.txt'), 1,
         'error: --constraints_file is met by beam search and --strategy=sampling; give --strategy=beam (or leave it '
         'out), or leave the constraints out'),
    Case('translate_constraints_line_not_json', ('translate', '--workdir={W}', '--input={T}/in.txt',
                                                 '--constraints_file={T}/phrases.txt'), 1,
         "error: {T}/phrases.txt line 2 is not JSON (Expecting value): 'Hund, Ball'; give a JSON list of phrases "
         'such as ["Hund", "roten Ball"]', prepare=_write('{T}/phrases.txt', b'["RED"]\nHund, Ball\n[]\n')),
    Case('translate_constraint_the_vocabulary_cannot_spell', ('translate', '--workdir={W}', '--input={T}/in.txt',
                                                              '--constraints_file={T}/snowmen.txt'), 1,
         "error: constraint '☃☃' of sentence 1 has text the vocabulary has no piece for (near",
         prepare=_write('{T}/snowmen.txt', '[]\n["RED", "☃☃"]\n\n'.encode())),
    Case('translate_constraints_longer_than_the_limit', ('translate', '--workdir={W}', '--input={T}/in.txt',
                                                         '--constraints_file={T}/long.txt'), 1,
         'error: the constraints of sentence 0 have 360 tokens and its output at most 20 (its source\'s tokens + EOS '
         '+ max_extra_length 10), EOS included; give fewer or shorter phrases, or a larger max_extra_length',
         prepare=_write('{T}/long.txt', b'["' + b'RED ' * 120 + b'"]\n\n\n')),
    Case('serve_max_waiting_zero', ('serve', '--workdir={W}', '--max_waiting=0'), 1,
         'error: --max_waiting=0 must be 1 or more'),
    Case('serve_top_p_above_one', ('serve', '--workdir={W}', '--strategy=sampling', '--top_p=1.5'), 1,
         'error: --top_p=1.5: must be in (0, 1] (1: every token)'),
    Case('serve_timeout_inf', ('serve', '--workdir={W}', '--timeout_seconds=inf'), 1,
         'error: --timeout_seconds=inf must be a finite number of seconds above 0'),
    Case('serve_port_outside', ('serve', '--workdir={W}', '--port=70000'), 1,
         'error: --port=70000 is not a port; give 1 to 65535 (0: any free one)'),
    Case('translate_decode_slots_zero', ('translate', '--workdir={W}', '--input={T}/in.txt', '--decode_slots=0'), 1,
         'error: --decode_slots=0: must be a positive integer'),
    Case('translate_alpha_negative_named_as_typed', ('translate', '--workdir={W}', '--input={T}/in.txt',
                                                     '--alpha=-1'), 1, 'error: --alpha=-1.0: must be in [0, inf)'),
    Case('translate_batch_tokens_named_as_typed', ('translate', '--workdir={W}', '--input={T}/in.txt',
                                                   '--batch_tokens=0'), 1,
         'error: --batch_tokens=0: must be a positive integer'),
    Case('average_last_and_best_together', ('average', '--workdir={W}', '--output={T}/avg', '--last=2', '--best=2'),
         1, 'error: --last=2 and --best=2 choose different checkpoints; give one of them'),
    Case('train_best_by_bleu_without_a_bleu_sample', _train('--config.keep_best=2'), 1,
         "error: config.best_metric='bleu' but config.num_eval_bleu_sentences=0 computes no BLEU"),
    # export and average: never onto, into or around the workdir
    Case('export_over_the_workdir', ('export', '--workdir={W}', '--output={W}', '--overwrite'), 1,
         'error: --output={W} is the workdir {W}, which this program reads'),
    Case('export_over_the_folder_holding_the_workdir', ('export', '--workdir={T}/run', '--output={T}', '--overwrite'),
         1, 'error: --output={T} holds the workdir {T}/run', unchanged=('{T}',),
         prepare=lambda p: shutil.copytree(p['W'], f'{p["T"]}/run')),
    Case('export_onto_a_file', ('export', '--workdir={W}', '--output={T}/in.txt', '--overwrite'), 1,
         'error: --output={T}/in.txt is a file; give a folder', unchanged=('{W}', '{T}/in.txt')),
    Case('average_through_a_link_to_the_workdir', ('average', '--workdir={C}', '--output={T}/link', '--overwrite'), 1,
         'error: --output={T}/link is the workdir {C}', unchanged=('{C}',), prepare=_symlink('{T}/link', '{C}')),
    Case('average_replaces_a_linked_folder_through_its_link', ('average', '--workdir={W}', '--output={T}/link',
         '--overwrite'), 0, '', prepare=lambda p: (os.makedirs(f'{p["T"]}/old'), _symlink('{T}/link', '{T}/old')(p)),
         after=lambda p: (os.path.islink(f'{p["T"]}/link') and checkpointing.available_steps(f'{p["T"]}/old')
                          == [TRAINED_STEPS]) or pytest.fail('the link or its folder was not kept')),
    # train: the real cause, before anything is written or compiled
    Case('train_unknown_config_field', _train('--config.nope=1'), 2, "error: --config.nope: the config has no field "
         "'nope'; configs/base.py lists every field"),
    Case('train_misspelt_model_field', _train('--config.model.d_modle=32'), 2, "error: --config.model.d_modle: the "
         "config has no field 'model.d_modle'; did you mean --config.model.d_model?"),
    Case('train_config_file_with_a_syntax_error', ('train', '--config={T}/bad.py', '--workdir={T}/run'), 1,
         'error: --config={T}/bad.py cannot be loaded (SyntaxError at line 1: ', prepare=_write(
             '{T}/bad.py', b'def get_config(:\n')),
    Case('train_source_is_a_folder', _train('--config.train_source={T}'), 1,
         'error: config.train_source={T} is a folder; give the path of a text file'),
    Case('train_files_of_different_lengths', _train('--config.train_target={T}/short.tgt.gz'), 1,
         'error: {corpus}/train.src.gz has 200 lines but {T}/short.tgt.gz has 150; parallel files must have',
         prepare=_corpus_variants),
    Case('train_a_line_that_is_not_utf8', _train('--config.train_source={T}/latin1.src.gz'), 1,
         'error: {T}/latin1.src.gz: line 101 is not valid UTF-8', prepare=_corpus_variants),
    Case('train_a_truncated_gzip_file', _train('--config.train_source={T}/cut.src.gz'), 1,
         'error: {T}/cut.src.gz is not a readable gzip file', prepare=_corpus_variants),
    Case('train_missing_evaluation_file', _train('--config.eval_target={T}/none.gz'), 1,
         'error: config.eval_target={T}/none.gz does not exist',
         after=lambda p: not os.path.exists(f'{p["T"]}/run') or pytest.fail('the workdir was created')),
    Case('train_on_an_averaged_workdir', _train(workdir='{A}'), 1, f'error: checkpoint {TRAINED_STEPS} in {{A}} holds '
         'parameters only (an averaged model), not a training state; translate with it, or train from it in a new '
         'workdir with --config.init_from={A}', unchanged=('{A}',)),
    Case('train_on_checkpoints_of_another_model', _train('--config.model.d_ff=48', workdir='{C}'), 1,
         f'error: checkpoint {TRAINED_STEPS} in {{C}} holds another model (parameter decoder/feed_forward/wi_bias of '
         'shape (2, 32) where this model has it of shape (2, 48))', unchanged=('{C}',), prepare=_another_model),
    Case('train_on_a_damaged_config_json', _train(workdir='{C}'), 1, 'error: {C}/config.json is damaged (not UTF-8',
         unchanged=('{C}',), prepare=_write('{C}/config.json', b'\x89\xff' * 64)),
    Case('train_from_a_missing_init_from', _train('--config.init_from={T}/nothing'), 1,
         'error: --config.init_from={T}/nothing is not a folder; point --config.init_from at a directory written'),
    Case('train_fine_tuning_into_its_source', _train('--config.init_from={C}', workdir='{C}'), 1,
         'error: --workdir={C} is the run of --config.init_from {C}', unchanged=('{C}',)),
    Case('train_token_cache_is_a_file', _train('--config.token_cache={T}/in.txt'), 1,
         'error: config.token_cache={T}/in.txt is a file; give a folder for the token caches',
         unchanged=('{T}/in.txt',), after=lambda p: not os.path.exists(f'{p["T"]}/run') or pytest.fail('a workdir')),
    Case('train_resumed_with_another_seed', _train(*TRAINED_FLAGS, '--config.seed=7', workdir='{C}'), 1,
         f'error: workdir {{C}} holds a run trained with config.seed=0 (checkpoint {TRAINED_STEPS}) but this config '
         'has 7; a resumed run keeps its seed', unchanged=('{C}',)),
    Case('train_a_finished_run_with_fewer_steps', _train(*TRAINED_FLAGS, '--config.num_train_steps=9', workdir='{C}'),
         0, f'warning: the run in {{C}} ended at step {TRAINED_STEPS} (config.num_train_steps=9); nothing was trained: '
         f'to train on, raise --config.num_train_steps above {TRAINED_STEPS}',
         unchanged=('{C}/checkpoints', '{C}/train_metrics.jsonl')),
    Case('train_a_run_that_stopped_early_again', _train(*TRAINED_FLAGS, '--config.num_train_steps=30',
                                                       '--config.early_stopping_evaluations=2',
                                                       '--config.best_metric=loss', workdir='{C}'),
         0, f'warning: the run in {{C}} stopped early at step {TRAINED_STEPS}: validation loss has not improved for 3 '
         'evaluations (best at step 3); nothing was trained: to train on, raise --config.early_stopping_evaluations '
         'above 3', unchanged=('{C}/checkpoints', '{C}/train_metrics.jsonl'), prepare=_evaluations(1.0, 1.5, 2.0, 2.5)),
    Case('train_download_from_a_server_that_trickles', _train(
        '--config.train_source={T}/dl/train.en.gz', '--config.download_url={url}'), 1,
         'error: {T}/dl/train.en.gz does not exist and downloading it from http://127.0.0.1:',
         prepare=lambda p: p.update(url=_served(0.05)), patched=((corpora, 'FILE_SECONDS', 1.5),),
         after=lambda p: os.listdir(f'{p["T"]}/dl') == [] or pytest.fail('a partial download was left')),
    Case('train_download_stopped_by_sigterm', _train('--config.train_source={T}/dl/train.en.gz',
                                                     '--config.download_url={url}'), 1,
         'error: {T}/dl/train.en.gz does not exist and downloading it from http://127.0.0.1:',
         prepare=lambda p: p.update(url=_served(0.05, terminate_after=0.5)),
         after=lambda p: os.listdir(f'{p["T"]}/dl') == [] or pytest.fail('a partial download was left')),
    Case('train_download_after_one_killed_mid_file', _train('--config.train_source={T}/dl/train.en.gz',
                                                            '--config.download_url={url}'), 1,
         'error: {T}/dl/train.en.gz does not exist and downloading it from http://127.0.0.1:',
         prepare=lambda p: (p.update(url=_served(0, 404)), _write(f'{{T}}/dl/train.en.gz.part.{_dead_pid()}', b'x')(p),
                            _write('{T}/dl/train.de.gz.part.1', b'x')(p)),
         after=lambda p: os.listdir(f'{p["T"]}/dl') == ['train.de.gz.part.1'] or pytest.fail(
             f'abandoned partial files: {os.listdir(p["T"] + "/dl")}')),
    Case('train_data_file_where_training_writes', _train('--config.train_source={C}/config.json', workdir='{C}'), 1,
         'error: {C}/config.json, which training writes, is config.train_source {C}/config.json', unchanged=('{C}',)),
]


def _snapshot(paths: list[str]) -> dict:
  """{file: sha1} of every file under each path (links not followed), to compare before and after."""
  digests = {}
  for top in paths:
    for root, _, names in ([(os.path.dirname(top), None, [os.path.basename(top)])] if os.path.isfile(top)
                           else os.walk(top)):
      for name in names:
        path = os.path.join(root, name)
        if os.path.isfile(path) and not os.path.islink(path):
          with open(path, 'rb') as f:
            digests[path] = hashlib.sha1(f.read()).hexdigest()
  return digests


@pytest.fixture(scope='module')
def averaged(trained_run, tmp_path_factory):
  """The trained run's average (python -m flax_transformer average), shared by the cases that only read it."""
  output = str(tmp_path_factory.mktemp('averaged') / 'avg')
  assert average.main(['average', f'--workdir={trained_run[0]}', f'--output={output}']) == 0
  return output


@pytest.mark.parametrize('case', CASES, ids=[c.id for c in CASES])
def test_bad_input(case, trained_run, averaged, tmp_path, capsys, monkeypatch):
  workdir, corpus = trained_run
  paths = {'W': workdir, 'C': str(tmp_path / 'copy'), 'A': averaged, 'T': str(tmp_path / 'case'), 'corpus': corpus}
  paths['T_name'] = os.path.basename(paths['T'])
  os.makedirs(paths['T'])
  with open(f'{paths["T"]}/in.txt', 'w') as f:
    f.write('red house\nthe cat sat\na dog\n')
  shutil.copytree(workdir, paths['C'])
  for owner, attribute, value in case.patched:
    monkeypatch.setattr(owner, attribute, value)
  if case.prepare:
    case.prepare(paths)
  unchanged = [u.format(**paths) for u in case.unchanged]
  before = _snapshot(unchanged)
  monkeypatch.setattr(sys, 'stdin', io.TextIOWrapper(io.BytesIO(case.stdin)))
  capsys.readouterr()
  status = PROGRAMS[case.argv[0]]([case.argv[0]] + [a.format(**paths) for a in case.argv[1:]])
  stderr = capsys.readouterr().err
  said = [line for line in stderr.splitlines() if line.startswith(('error: ', 'warning: '))]
  assert status == case.status, stderr[-3000:]
  if case.first:
    assert said and said[0].startswith(case.first.format(**paths)), stderr[-3000:]
  if case.status:
    assert len([line for line in said if line.startswith('error: ')]) == 1, stderr[-3000:]
  assert 'Traceback' not in stderr, stderr[-3000:]
  assert _snapshot(unchanged) == before  # nothing lost: not a byte of what the case read has changed
  if case.after:
    case.after(paths)


CALLS = [
    ('translate(None)', lambda t: t.translate(None), 'sentences must be a list of strings, not NoneType'),
    ('translate([42])', lambda t: t.translate([42]), 'sentences[0] is int 42, not a string; give text'),
    ("translate(['a', None])", lambda t: t.translate(['a', None]), 'sentences[1] is NoneType None, not a string'),
    ("translate('A dog runs.')", lambda t: t.translate('A dog runs.'), "sentences must be a list of strings, not a "
     "single str; for one sentence pass a list of one: ['A dog runs.']"),
    ("translate([b'bytes'])", lambda t: t.translate([b'bytes']), "sentences[0] is bytes b'bytes', not a string; "
     "decode it to str first"),
    ("n_best('a', 2)", lambda t: t.n_best('a', 2), 'sentences must be a list of strings, not a single str'),
    ("score(['a'], 'b')", lambda t: t.score(['a'], 'b'), 'targets must be a list of strings, not a single str'),
    ("alignments([1], ['b'])", lambda t: t.alignments([1], ['b']), 'sources[0] is int 1, not a string'),
    ("translate(['a'], constraints=['Hund'])", lambda t: t.translate(['a'], constraints=['Hund']),
     "constraints[0] must be a list of strings, not a single str; for one sentence pass a list of one: ['Hund']"),
]


@pytest.mark.parametrize('call,expected', [(c[1], c[2]) for c in CALLS], ids=[c[0] for c in CALLS])
def test_translator_arguments(call, expected, trained_run):
  from flax_transformer.translator import Translator
  translator = _translator(trained_run[0])
  with pytest.raises(ArgumentError) as error:
    call(translator)
  assert str(error.value).startswith(expected) and '\n' not in str(error.value)
  assert isinstance(error.value, TypeError) and Translator  # a type error, as Python's own


_TRANSLATORS = {}


def _translator(workdir):
  from flax_transformer.translator import Translator
  if workdir not in _TRANSLATORS:
    _TRANSLATORS[workdir] = Translator.from_workdir(workdir)
  return _TRANSLATORS[workdir]


# --- What only a process shows: several processes, signals, a storage server that stops answering -----------------

FROZEN_TIMEOUT = 20  # storage_timeout_seconds of the runs whose storage stops answering: beyond it, only the
# shutdown's SHUTDOWN_SECONDS and the time a loaded machine takes to exit; a timeout per closing call would add 20s


def _started(command, env=None, **kwargs):
  return subprocess.Popen(command, env=env or subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, **kwargs)


def _errors(stderr: str) -> list[str]:
  return [line for line in stderr.splitlines() if line.startswith('error: ')]


@pytest.mark.slow
def test_what_only_a_process_shows(trained_run, tmp_path):
  """Eight cases at once (each waits on a timeout, a signal or a sleep, not the CPU): process 0 of 2 started
  alone; two processes of one run with different seeds; a gs:// workdir whose server cannot be reached; a gs://
  server that stops answering (SIGSTOP) during a step, during a save and during the evaluation's writes, each run
  stopping within its storage timeout plus the shutdown's few seconds; SIGINT pressed twice; two processes of one
  run whose process 0 takes 40 s longer to train the vocabulary while process 1 waits for it (on CPU a device
  collective would give up after 30 s), then SIGTERM to process 1 alone stops both at one step, with one
  checkpoint saved there."""
  _, corpus = trained_run
  base = [sys.executable] + train_command('{workdir}', corpus, 30)[1:]
  command = lambda workdir, *extra: [a.format(workdir=workdir) for a in base] + list(extra)
  port = free_port()
  alone = _started(command(tmp_path / 'alone', '--config.num_processes=2', f'--config.coordinator_address=localhost:'
                           f'{port}', '--config.process_id=0', '--config.initialization_timeout_seconds=5'))
  port = free_port()
  seeds = [_started(command(tmp_path / 'seeds', '--config.num_processes=2', '--config.mesh_shape=(2,1,1)',
                            f'--config.coordinator_address=localhost:{port}', f'--config.process_id={i}',
                            f'--config.seed={i}')) for i in (0, 1)]
  closed = free_port()
  unreachable = _started(command('gs://bucket/unreachable'), env=dict(
      subprocess_env(), STORAGE_EMULATOR_HOST=f'http://127.0.0.1:{closed}', TENSORSTORE_GCS_HTTP_URL=f'http://127.0.0.1:{closed}'))
  frozen_flags = {  # (the cue to freeze on, flags): what the run writes first after its cue
      'frozen in a step': ('step 6/', '--config.checkpoint_every_steps=100'),  # step 7's metrics
      'frozen in a save': ('step 6/', '--config.log_every_steps=100', '--config.checkpoint_every_steps=6'),  # step
      # 6's checkpoint
      'frozen in an evaluation': ('eval step 3', '--config.checkpoint_every_steps=100', '--config.log_every_steps=100',
                                  '--config.eval_every_steps=3', '--config.num_eval_bleu_sentences=4'),  # step 6's
      # translations
  }
  emulators, frozen = {}, {}
  try:
    for name, (_, *flags) in frozen_flags.items():
      emulators[name], variables = gcs_emulator.start(tmp_path / name.replace(' ', '_'))
      frozen[name] = _started(command('gs://bucket/run', f'--config.storage_timeout_seconds={FROZEN_TIMEOUT}', *flags),
                              env=dict(subprocess_env(), **variables))
    interrupted = _started(command(tmp_path / 'sigint', '--config.num_train_steps=400'))
    port = free_port()
    slow_vocabulary = [_started(
        [sys.executable, os.path.join(ROOT, 'tests', 'helpers', 'slow_vocabulary_train.py')]
        + [a for a in command(tmp_path / 'slow')[2:] if not a.startswith('--config.mesh_shape=')]
        + ['--config.num_train_steps=2000', '--config.checkpoint_every_steps=1000', '--config.num_processes=2',
           '--config.mesh_shape=(2,1,1)', f'--config.coordinator_address=localhost:{port}', f'--config.process_id={i}'],
        env=dict(subprocess_env(), SLOW_VOCABULARY_SECONDS='40')) for i in (0, 1)]
    stopped_at = {}
    cues = [(frozen[name], frozen_flags[name][0], lambda name=name: (emulators[name].send_signal(signal.SIGSTOP),
                                                        stopped_at.setdefault(name, time.monotonic())))
            for name in frozen]
    cues += [(interrupted, 'step 5/', lambda: interrupted.send_signal(signal.SIGINT)),
             (interrupted, 'SIGINT received: the run stops', lambda: interrupted.send_signal(signal.SIGINT)),
             (slow_vocabulary[0], 'step 3/', lambda: slow_vocabulary[1].send_signal(signal.SIGTERM))]  # process 1
    # alone is told; process 0 must stop with it
    def follow(process, cued):  # each act as soon as its cue is printed, each process read by its own thread
      for cue, act in cued:
        for line in process.stdout:
          if line.startswith(cue):
            act()
            break
    followers = {id(p): threading.Thread(target=follow, args=(p, [(c, a) for q, c, a in cues if q is p]))
                 for p in {id(q): q for q, _, _ in cues}.values()}
    for thread in followers.values():
      thread.start()
    processes = {'alone': alone, 'seed 0': seeds[0], 'seed 1': seeds[1], 'unreachable': unreachable, **frozen,
                 'interrupted': interrupted, 'slow vocabulary 0': slow_vocabulary[0],
                 'slow vocabulary 1': slow_vocabulary[1]}
    outcomes, ended_at = {}, {}

    def wait(name, process):  # as soon as its own cues are acted on: its exit is timed, not the others' cues
      if id(process) in followers:
        followers[id(process)].join()
      outcomes[name] = (process.wait(timeout=300), *process.communicate()[::-1])
      ended_at[name] = time.monotonic()
    waiting = [threading.Thread(target=wait, args=item) for item in processes.items()]
    for thread in waiting:
      thread.start()
    for thread in waiting:
      thread.join()
  finally:
    for process in (alone, *seeds, unreachable, *frozen.values(), *emulators.values()):
      process.kill()
    for process in [locals().get('interrupted'), *locals().get('slow_vocabulary', [])]:
      if process is not None:
        process.kill()
  expected = {
      'alone': 'error: process 0 of 2: process 1 did not join within 5 s (waiting as the coordinator at localhost:',
      'seed 0': 'error: process 1 of 2: config.seed=1 but process 0 has 0 (1 field(s) differ); start every process',
      'seed 1': 'error: process 1 of 2: config.seed=1 but process 0 has 0 (1 field(s) differ); start every process',
      'unreachable': f'error: --workdir=gs://bucket/unreachable: the storage server 127.0.0.1:{closed} cannot be '
                     f'reached (',
      'frozen in a step': 'error: writing the metrics of step 7 to gs://bucket/run did not finish within',
      'frozen in a save': ('error: saving the checkpoint at step 6 in gs://bucket/run failed (the save did not finish',
                           # or, where the save's first writes were done before the freeze, the next write's
                           'error: writing the metrics of step 12 to gs://bucket/run did not finish within'),
      'frozen in an evaluation': 'error: writing the translations of step 6 to gs://bucket/run/translations did not',
  }
  for name, start in expected.items():
    status, stderr, _ = outcomes[name]
    errors = _errors(stderr)
    assert status == 1 and len(errors) == 1 and errors[0].startswith(start), (name, stderr[-2000:])  # (a tuple: any)
    assert 'Traceback' not in stderr, (name, stderr[-2000:])
  for name in frozen:  # the timeout once, then one deadline for everything the run closes: not a timeout per call
    errors = _errors(outcomes[name][1])
    assert errors[0].endswith('; the run stopped and no checkpoint was written' + (
        ' (the save of step 6 did not finish)' if 'metrics of step 12' in errors[0] else '')), errors
    assert ended_at[name] - stopped_at[name] < FROZEN_TIMEOUT + storage.SHUTDOWN_SECONDS + 15, (
        name, ended_at[name] - stopped_at[name])
  status, stderr, stdout = outcomes['interrupted']
  assert status == 0 and 'Traceback' not in stderr, stderr[-2000:]
  assert 'SIGINT received again: the run is saving its checkpoint' in stdout, stdout[-2000:]
  assert checkpointing.available_steps(tmp_path / 'sigint')[-1] >= 5
  assert not os.path.exists(tmp_path / 'alone' / 'config.json')  # nothing written by a run that never started
  for name in ('slow vocabulary 0', 'slow vocabulary 1'):
    status, stderr, stdout = outcomes[name]
    assert status == 0 and 'Traceback' not in stderr, (name, stdout[-2000:] + stderr[-2000:])
  saved = [int(w) for l in outcomes['slow vocabulary 0'][2].splitlines()
           if l.startswith('SIGTERM received: checkpoint saved at step') for w in l.replace(';', ' ').split() if w.isdigit()]
  assert len(saved) == 1 and 3 <= saved[0] < 2000, outcomes['slow vocabulary 0'][2][-2000:]
  assert checkpointing.available_steps(tmp_path / 'slow') == saved
