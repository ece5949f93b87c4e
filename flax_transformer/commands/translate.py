"""Translate with a trained model: python translate.py --workdir=DIR --input=FILE|- [--output=FILE] [--reference=FILE]

Restores parameters only (no optimizer state), averaged over the config's `average_last` checkpoints
unless --step, --average_last or --checkpoint=best says otherwise (--weights=ema: the weights' moving
average); --workdir=A,B decodes with an ensemble of the runs' models. Decodes with the config's beam search
defaults (beam 4, α 0.6, max length = input + 50 for the paper configs) through `flax_transformer.Translator`.
Writes one line per input line, in input order:
  (default)      the translation; with --alignment, `translation ||| 0-0 1-2 ...` (Pharaoh word alignment)
  --n_best=K     a JSON object {"n": line number from 0, "hypotheses": [{"text", "score"}, ...]}
  --score        log p(reference line | input line), with --reference (and --alignment: `score ||| links`)
With --input=- the model is loaded once and stdin is read line by line: lines that arrive within
--stream_wait seconds of each other are translated together, and each output line is flushed as soon as
its batch is done. With --reference, prints sacreBLEU and its signature at the end. Installed as
`flax-transformer-translate` (the same program).
"""

import dataclasses
import gzip
import hashlib
import json
import os
import queue
import sys
import threading
import time

from flax_transformer import decoding_settings

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')  # TensorFlow's C++ start-up chatter

def define(flag_values, argv) -> None:
  from absl import flags
  from flax_transformer import commands
  define = lambda kind, name, default, help_string, **kw: getattr(flags, f'DEFINE_{kind}')(
      name, default, help_string, flag_values=flag_values, **kw)
  define_model(flag_values)
  define('string', 'input', '-', 'Source text file (plain or .gz), or - for stdin, read line by line.')
  define('string', 'output', '-', 'Where to write the output lines, or - for stdout.')
  define('string', 'reference', None, 'Reference translations (plain or .gz): print sacreBLEU; with --score, the '
         'targets to score.')
  define('string', 'prefix_file', None, 'Text each translation must begin with, one line per input line (empty: '
         'none; plain or .gz): forced, scored, and written as the output\'s start.')
  define('string', 'constraints_file', None, 'Phrases each translation must contain, one JSON list of phrases per '
         'input line (e.g. ["Hund", "roten Ball"]; an empty line or [] for none; plain or .gz): lexical constraints, '
         'met by beam search (Hu et al., 2019, dynamic beam allocation).')
  define('integer', 'n_best', 0, 'Write the K best translations of each line with their scores, as JSON lines.')
  define('bool', 'score', False, 'Write the model\'s log-probability of each --reference line given its input line.')
  define('bool', 'alignment', False, 'Append the word alignment (Pharaoh i-j, from the penultimate decoder '
         'layer\'s cross-attention).')
  define('float', 'stream_wait', 0.05, 'With --input=-: seconds to wait for more lines before translating those '
         'that have arrived.')
  flags.DEFINE_enum('bleu_tokenize', None, list(decoding_settings.BLEU_TOKENIZERS), 'sacreBLEU tokenizer (default: '
                    'the config\'s bleu_tokenize): 13a for detokenized text, none for pre-tokenized references.',
                    flag_values=flag_values)
  define('bool', 'lowercase', False, 'Case-insensitive BLEU.')
  define('integer', 'part_lines', 10_000, 'With --input and --output files: input lines translated per committed '
         'part (written to OUTPUT.parts/); the same command started again after a stop goes on after the last '
         'part; the output appears, whole, when every part is done. 0: one part.')
  define('bool', 'split_long', False, 'Translate lines longer than the model takes in pieces split at sentence '
         'punctuation, instead of cutting them (a warning counts them either way).')
  define('integer', 'storage_timeout_seconds', 300, 'A read of the input, reference, prefixes or constraints, or a '
         'write of a part or the output, still unfinished after this stops the program (a storage server that '
         'stopped answering).')
  commands.define_cluster(flag_values)


def define_model(flag_values) -> None:
  """The flags that choose the model and its decoding defaults: translate.py's and the server's."""
  from absl import flags
  from flax_transformer import commands
  define = lambda kind, name, default, help_string, **kw: getattr(flags, f'DEFINE_{kind}')(
      name, default, help_string, flag_values=flag_values, **kw)
  define('string', 'workdir', None, 'Training workdir (config.json, sentencepiece.model, checkpoints/); several '
         'separated by commas decode as an ensemble (the mean of their log-probabilities).')
  define('string', 'checkpoint_dir', None, 'A checkpoints/ directory to use instead of the workdir\'s.')
  define('integer', 'step', None, 'Use this checkpoint step alone.')
  define('integer', 'average_last', None, 'Average the last K checkpoints (default: the config\'s average_last).')
  decoding_flags(flag_values)
  define('integer', 'devices', None, 'Local devices that share the decoding slots, each holding the whole model '
         '(default: every local accelerator; one device on a CPU).')
  for alias, name in ALIASES.items():
    flags.DEFINE_alias(alias, name, flag_values=flag_values)
  commands.define_weights(flag_values)


def decoding_flags(flag_values) -> None:
  """A flag for every decoding setting declared `given` a flag (decoding_settings.DecodeSettings), its help its
  declaration's; unset (None) it leaves the run's config value."""
  from absl import flags
  kinds = {int: flags.DEFINE_integer, float: flags.DEFINE_float, str: flags.DEFINE_string}
  for field in dataclasses.fields(decoding_settings.DecodeSettings):
    if 'flag' not in field.metadata['given']:
      continue
    help_string = f"{field.metadata['doc']} Default: the run config's {field.name}."
    if field.metadata['choices']:
      flags.DEFINE_enum(field.name, None, list(field.metadata['choices']), help_string, flag_values=flag_values)
    else:
      kinds[field.type](field.name, None, help_string, flag_values=flag_values)


STREAM_LINES = 256  # the most stdin lines translated together
DECODING_FLAGS = decoding_settings.given('flag')


ALIASES = {'alpha': 'length_penalty_alpha', 'batch_tokens': 'eval_tokens_per_batch', 'seed': 'sampling_seed'}  # short name -> flag


def typed(argv: list[str], name: str) -> str:
  """The flag `name` as the command line spells it (its short alias, if that is what was typed)."""
  from flax_transformer import commands
  short = next((alias for alias, flag in ALIASES.items() if flag == name), None)
  return f'--{short}' if short and commands.argv_value(argv, short) is not None else f'--{name}'


def check_flags(f, argv: list[str] = ()) -> None:
  """Every flag that can be wrong without the model: before anything is loaded or compiled."""
  from flax_transformer import commands, parallel_text, storage
  from flax_transformer.errors import UserError
  decoding_settings.check({name: getattr(f, name) for name in DECODING_FLAGS}, lambda name: typed(argv, name))
  if f.n_best < 0:
    raise UserError(f'--n_best={f.n_best} must be 1 or more (0 = translations only)')
  if f.n_best and f.strategy == 'sampling':
    raise UserError(f'--n_best={f.n_best} lists the beam\'s best and --strategy=sampling draws; give '
                    f'--num_samples={f.n_best} for that many samples a line')
  if f.score and f.num_samples:
    raise UserError('--score and --num_samples write different outputs; choose one')
  if f.score and not f.reference:
    raise UserError('--score needs --reference=FILE: the target lines to score, one per input line')
  if f.score and f.n_best:
    raise UserError('--score and --n_best write different outputs; choose one')
  if f.stream_wait < 0:
    raise UserError(f'--stream_wait={f.stream_wait} must be 0 or more seconds')
  if f.part_lines < 0:
    raise UserError(f'--part_lines={f.part_lines} must be 0 or more lines (0 = the whole input as one part)')
  if f.devices is not None and f.devices < 1:
    raise UserError(f'--devices={f.devices} must be 1 or more (leave it out for every local accelerator)')
  if f.storage_timeout_seconds < 1:
    raise UserError(f'--storage_timeout_seconds={f.storage_timeout_seconds} must be 1 or more seconds')
  commands.check_cluster(f)
  if f.input == '-' and f.num_processes > 1:
    raise UserError(f'--input=- is read by one process and --num_processes={f.num_processes}; give --input=FILE '
                    f'(every process reads its share), or start one process')
  if len(workdirs(f)) > 1 and (f.alignment or f.checkpoint_dir):
    flag = '--alignment' if f.alignment else '--checkpoint_dir'
    raise UserError(f'{flag} reads one model and --workdir={f.workdir} names {len(workdirs(f))}; give one workdir')
  if f.checkpoint == 'best' and f.step is not None:
    raise UserError(f'--checkpoint=best and --step={f.step} choose different checkpoints; give one of them')
  if f.prefix_file and f.score:
    raise UserError('--prefix_file starts each translation and --score scores given lines; choose one')
  if f.prefix_file and f.input == '-':
    raise UserError('--prefix_file gives the prefix of each line of a file; give the lines as --input=FILE')
  if f.constraints_file and f.score:
    raise UserError('--constraints_file steers each translation and --score scores given lines; choose one')
  if f.constraints_file and f.input == '-':
    raise UserError('--constraints_file gives the phrases of each line of a file; give the lines as --input=FILE')
  if f.constraints_file and f.strategy in ('greedy', 'sampling'):
    raise UserError(f'--constraints_file is met by beam search and --strategy={f.strategy}; give --strategy=beam '
                    f'(or leave it out), or leave the constraints out')
  for name in ('input', 'reference', 'prefix_file', 'constraints_file'):
    path = getattr(f, name)
    if path and path != '-':
      parallel_text.check_file(path, f'--{name}')
  storage.check_output(f'--output={f.output}', f.output, reads(f))
  if f.output != '-':
    if storage.path(f.output).is_dir():
      raise UserError(f'--output={f.output} is a folder; give the name of the file to write')
    storage.check_writable(storage.path(f.output).parent, 'the folder of --output', 'choose another --output')


def workdirs(f) -> list[str]:
  """--workdir's workdirs: one, or an ensemble's."""
  return [w for w in f.workdir.split(',') if w] if f.workdir else []


def reads(f, vocabulary: str = '') -> dict:
  """What translate reads, none of which --output may be, hold or sit inside."""
  named = {'the workdir' if i == 0 else f'the workdir {w}': w for i, w in enumerate(workdirs(f))}
  return {**named, 'the checkpoint folder': f.checkpoint_dir, 'the input': f.input, 'the reference': f.reference,
          'the prefix file': f.prefix_file, 'the constraints file': f.constraints_file, 'the vocabulary': vocabulary}


def stdin_chunks(wait: float):
  """Lists of stdin lines as they arrive: a chunk closes after `wait` seconds without a new line (or at
  STREAM_LINES lines). A reader thread blocks on stdin so the translation of one chunk overlaps the next."""
  from flax_transformer import parallel_text
  lines = queue.Queue()

  def read():
    try:
      for line in sys.stdin.buffer:
        lines.put(line)
    finally:
      lines.put(None)

  threading.Thread(target=read, daemon=True).start()
  number, ended = 0, False
  while not ended:
    chunk = [lines.get()]
    while chunk[-1] is not None and len(chunk) < STREAM_LINES:
      try:
        chunk.append(lines.get(timeout=wait))
      except queue.Empty:
        break
    if chunk[-1] is None:
      chunk.pop()
      ended = True
    if chunk:
      yield [parallel_text.decode_line(line.rstrip(b'\n').rstrip(b'\r'), 'standard input', number + i + 1)
             for i, line in enumerate(chunk)]
      number += len(chunk)


class Progress:
  """One progress line on stderr: rewritten in place on a terminal; in a log (not a terminal), written as a line
  of its own at most every LOG_SECONDS and at the end, so that a later line (an error) starts a line."""
  LOG_SECONDS = 10.0

  def __init__(self):
    self.terminal, self.text, self.written, self.last = sys.stderr.isatty(), '', '', 0.0

  def update(self, text: str) -> None:
    self.text = text
    if self.terminal:
      print(f'\r{text}  ', end='', file=sys.stderr, flush=True)
      self.written = text
    elif time.monotonic() - self.last >= self.LOG_SECONDS:
      self.line()

  def line(self) -> None:
    print(self.text, file=sys.stderr, flush=True)
    self.written, self.last = self.text, time.monotonic()

  def end(self) -> None:
    if self.terminal and self.written:
      print(file=sys.stderr, flush=True)
    elif not self.terminal and self.text and self.written != self.text:
      self.line()


def output_lines(translator, f, sources: list[str], targets: list[str] | None, progress, numbers: list[int],
                 steering: dict | None = None):
  """The output lines for `sources` (and their `targets` with --score), and the best translations; `numbers`:
  their input line numbers (from 0); `steering`: what every input line brings besides its text, by the
  Translator's keyword ({'prefixes': [...], 'constraints': [...]}: read_steering)."""
  steering = {name: [values[n] for n in numbers] for name, values in (steering or {}).items()}
  if f.score:
    scores = translator.score(sources, targets)
    links = translator.alignments(sources, targets) if f.alignment else None
    return [f'{s:.4f}' + (f' ||| {links[i]}' if links else '') for i, s in enumerate(scores)], None
  encoded = translator.encode(sources)
  too_long = translator.too_long(encoded)
  if too_long:
    shown = ', '.join(str(numbers[i] + 1) for i in too_long[:10]) + (', ...' if len(too_long) > 10 else '')
    what = ('split at sentence punctuation and translated in pieces' if f.split_long else
            'cut to fit (--split_long translates them in pieces split at sentence punctuation)')
    print(f'warning: {len(too_long)} input line(s) longer than the model\'s {translator.max_source_tokens} tokens '
          f'(line {shown}) are {what}', file=sys.stderr)
  listed = f.n_best or (translator.decoding.num_samples if translator.decoding.strategy == 'sampling' else 0)
  if listed > 1 or f.n_best:  # the beam's n best, or several samples
    hypotheses = translator.n_best(sources, listed, f.beam_size, f.length_penalty_alpha, numbers=numbers,
                                   **steering)
    lines, best = [], [h[0][0] if h else '' for h in hypotheses]
    for i, found in enumerate(hypotheses):
      entries = [{'text': text, 'score': round(score, 4)} for text, score in found]
      if f.alignment and entries:
        for entry, links in zip(entries, translator.alignments([sources[i]] * len(entries), [e['text'] for e in entries])):
          entry['alignment'] = links
      lines.append(json.dumps({'n': numbers[i], 'hypotheses': entries}, ensure_ascii=False))
    return lines, best
  best = translator.translate(sources, f.beam_size, f.length_penalty_alpha, split_long=f.split_long, encoded=encoded,
                              progress=progress, numbers=numbers, **steering)
  if f.alignment:
    return [f'{t} ||| {links}' for t, links in zip(best, translator.alignments(sources, best))], best
  return best, best


def shared_output_lines(translator, f, sources: list[str], targets: list[str] | None, progress, first: int,
                        steering: dict | None = None):
  """output_lines of `sources` (input lines `first`, `first` + 1, ...), on every process: each translates its
  share (every processes-th line) on its devices and the output lines are gathered in order."""
  import jax
  from flax_transformer import cluster
  processes, mine = jax.process_count(), slice(jax.process_index(), None, jax.process_count())
  numbers = list(range(first, first + len(sources)))
  if processes == 1:
    return output_lines(translator, f, sources, targets, progress, numbers, steering)
  scaled = progress and (lambda n, total: progress(min(n * processes, len(sources)), len(sources)))
  lines, best = output_lines(translator, f, sources[mine], targets[mine] if targets else None, scaled, numbers[mine],
                             steering)
  lines = cluster.gathered_texts(lines, len(sources), f'output lines {first + 1} to {first + len(sources)}')
  return lines, None if f.score else cluster.gathered_texts(best, len(sources), f'translations {first + 1} to '
                                                                            f'{first + len(sources)}')


JOB_FILE = 'job.json'  # in OUTPUT.parts/: what the parts translate (input, model, choices)
OUTPUT_FLAGS = ('workdir', 'checkpoint_dir', 'step', 'average_last', 'checkpoint', 'weights', 'strategy', 'beam_size',
                'length_penalty_alpha', 'beam_stop', 'temperature', 'top_k', 'top_p', 'num_samples', 'sampling_seed',
                'n_best', 'score', 'alignment', 'split_long', 'part_lines', 'reference', 'prefix_file', 'constraints_file',
                'constraint_order')  # the output's


def parts_folder(output: str) -> str:
  return f'{output}.parts'


def job_identity(f, sources: list[str], checkpoints, steering: dict | None = None) -> dict:
  """What a long job's parts hold: its input, prefixes and constraints (by content), the model and the choices
  that change the output."""
  digest = lambda lines: hashlib.sha256('\n'.join(line if isinstance(line, str) else json.dumps(line)
                                                   for line in lines).encode('utf-8')).hexdigest()
  return {'input': f.input, 'input_sha256': digest(sources), 'lines': len(sources), 'checkpoints': repr(checkpoints),
          'flags': {name: getattr(f, name) for name in OUTPUT_FLAGS},
          **{f'{name}_sha256': digest(values) for name, values in (steering or {}).items()}}


def committed_parts(f, job: dict) -> dict[int, list]:
  """The parts a stopped run of the same command committed ({index: [[line, best], ...]}); a folder of another
  command's parts is a one-line error (nothing is removed)."""
  from flax_transformer import storage
  from flax_transformer.errors import UserError
  folder = storage.path(parts_folder(f.output))
  if not (folder / JOB_FILE).exists():
    return {}
  if json.loads((folder / JOB_FILE).read_text()) != job:
    raise UserError(f'{folder} holds the parts of another translation (another input, model or flags); give the '
                    f'command that started it to finish it, or remove the folder to start afresh')
  parts = {}
  for entry in folder.glob('part-*.jsonl'):
    parts[int(entry.name[5:-6])] = [json.loads(line) for line in entry.read_text().splitlines()]
  return parts


def translate_in_parts(translator, f, sources, references, steering=None) -> tuple[list[str], list[str]]:
  """--input and --output files: the output lines and best translations of every part, each part committed to
  OUTPUT.parts/ as it is done (and skipped when a stopped run of the same command had committed it). On several
  processes every process translates its share of each part and process 0, which alone reads and writes the
  parts and the output, says which parts are committed; the lists returned are process 0's (others: empty)."""
  import jax
  from flax_transformer import cluster, storage
  from flax_transformer.errors import UserError
  chief, processes = jax.process_index() == 0, jax.process_count()
  job = job_identity(f, sources, translator.checkpoints, steering)
  jobs = cluster.agree('translation job', value=json.dumps(job, sort_keys=True))
  for process, other in enumerate(jobs):
    if other != jobs[0]:
      differing = sorted(k for k in job if json.loads(other).get(k) != json.loads(jobs[0]).get(k))
      raise cluster.ProcessError(process, processes, f'its {", ".join(differing)} differ from process 0\'s; start '
                                 f'every process with the same command (only --process_id differs)')
  folder = storage.path(parts_folder(f.output))
  size = f.part_lines or max(len(sources), 1)
  count = -(-len(sources) // size)
  within = lambda what, call: storage.within(f.storage_timeout_seconds, what, call)
  parts, problem = {}, None
  if chief:
    try:
      parts = within(f'reading {folder}', lambda: committed_parts(f, job))
      if parts:
        print(f'going on after {len(parts)} of {count} parts committed in {folder}', file=sys.stderr, flush=True)
      else:
        within(f'writing {folder / JOB_FILE}', lambda: (folder.mkdir(parents=True, exist_ok=True),
                                                       storage.write_atomic(folder / JOB_FILE, json.dumps(job))))
    except UserError as error:
      problem = error
  committed = set(json.loads(cluster.agree('committed parts', problem, json.dumps(sorted(parts)))[0]))
  start, before = time.monotonic(), sum(min(size, len(sources) - i * size) for i in committed)
  shown = Progress()
  for index in range(count):
    if index in committed:
      continue
    first = index * size
    chunk = sources[first:first + size]
    targets = references[first:first + size] if f.score else None
    done_before = sum(min(size, len(sources) - i * size) for i in range(index) if i in committed or i in parts)

    def progress(n, total, done_before=done_before):
      seconds = time.monotonic() - start
      rate = (done_before + n - before) / seconds if seconds > 0 else 0.0
      left = (len(sources) - done_before - n) / rate if rate else 0.0
      shown.update(f'{done_before + n}/{len(sources)} lines, {rate:,.1f} lines/s, ETA {left / 60:.1f} min')
    lines, best = shared_output_lines(translator, f, chunk, targets, progress if chief else None, first, steering)
    parts[index] = [[line, translation] for line, translation in zip(lines, best or [None] * len(lines))]
    if chief:
      data = ''.join(json.dumps(entry, ensure_ascii=False) + '\n' for entry in parts[index])
      name = folder / f'part-{index:06d}.jsonl'
      within(f'writing {name}', lambda: storage.write_atomic(name, data))
      progress(len(chunk), len(sources))
  shown.end()
  if not chief:
    return [], []
  entries = [entry for index in range(count) for entry in parts[index]]
  return [line for line, _ in entries], [best for _, best in entries if best is not None]


def load(f):
  """The Translator the flags name: one workdir's model (its weights and checkpoints as --weights, --checkpoint,
  --step, --average_last say) or an ensemble's."""
  from flax_transformer.translator import Translator
  overrides = {name: getattr(f, name) for name in DECODING_FLAGS if name not in ('beam_size', 'length_penalty_alpha')}
  # (None: the run's; the beam size and α go to each call)
  chosen = {'step': f.step, 'average_last': f.average_last, 'checkpoint': f.checkpoint, 'weights': f.weights,
            'devices': f.devices}
  if len(workdirs(f)) > 1:
    return Translator.from_workdirs(workdirs(f), **chosen, **overrides)
  return Translator.from_workdir(f.workdir, checkpoint_dir=f.checkpoint_dir, **chosen, **overrides)


def translate(f, argv: list[str] = ()) -> None:
  """The program: on one process, or on each of several (the cluster flags, or the cluster's environment), where
  an error on one stops every other with the same line, as a training run's processes do."""
  from flax_transformer import cluster, platforms  # never TensorFlow: text is read with Python and SentencePiece
  check_flags(f, argv)
  platforms.enable_compilation_cache()  # each engine program compiled once, for every later translation
  settings = cluster.ClusterSettings(**{field.name: getattr(f, field.name)
                                        for field in dataclasses.fields(cluster.ClusterSettings)})
  cluster.start(settings, spelling='--')
  cluster.watch_peers(settings)
  cluster.together(lambda: _translate(f))


def read_steering(f, read, count: int) -> dict:
  """What each of the `count` input lines brings besides its text, by the Translator's keyword: 'prefixes'
  (--prefix_file's lines) and 'constraints' (--constraints_file's, a JSON list of phrases a line); one line
  each per input line, or a one-line DataError."""
  from flax_transformer import parallel_text
  steering = {}
  for name, path, what in (('prefixes', f.prefix_file, 'prefix line'),
                           ('constraints', f.constraints_file, 'JSON list of phrases')):
    if not path:
      continue
    lines = read(path)
    if len(lines) != count:
      raise parallel_text.DataError(f'{path} has {len(lines)} lines but the input has {count}; give one {what} '
                                    f'per input line (an empty line for none)')
    steering[name] = lines if name == 'prefixes' else [phrase_list(path, n, line) for n, line in enumerate(lines)]
  return steering


def phrase_list(path: str, number: int, line: str) -> list[str]:
  """Line `number` (from 0) of a constraints file: a JSON list of phrases (an empty line: none)."""
  from flax_transformer import parallel_text
  if not line.strip():
    return []
  try:
    phrases = json.loads(line)
  except ValueError as error:
    raise parallel_text.DataError(f'{path} line {number + 1} is not JSON ({error.msg}): {line[:60]!r}; give a JSON '
                                  f'list of phrases such as ["Hund", "roten Ball"]') from None
  if not isinstance(phrases, list) or not all(isinstance(p, str) for p in phrases):
    raise parallel_text.DataError(f'{path} line {number + 1} is {line[:60]!r}, not a JSON list of strings; give a '
                                  f'list of phrases such as ["Hund", "roten Ball"]')
  return phrases


def _translate(f) -> None:
  import jax
  from flax_transformer import parallel_text, scoring, storage
  from flax_transformer.errors import UserError
  chief, processes = jax.process_index() == 0, jax.process_count()
  if f.input == '-' and processes > 1:
    raise UserError(f'--input=- is read by one process and this job has {processes}; give --input=FILE (every '
                    f'process reads its share), or start one process')
  read = lambda path: storage.within(f.storage_timeout_seconds, f'reading {path}',
                                     lambda: parallel_text.read_lines(path))
  references = read(f.reference) if f.reference else None
  sources = None if f.input == '-' else read(f.input)
  if sources is not None and references is not None and len(references) != len(sources):
    raise parallel_text.DataError(f'{f.reference} has {len(references)} lines but the input has {len(sources)}; '
                                   f'give the reference of this input')
  steering = read_steering(f, read, len(sources)) if sources is not None else {}
  translator = load(f)
  storage.check_output(f'--output={f.output}', f.output, reads(f, translator.settings.data.vocab_path))
  what = f'{len(sources)} lines' if sources is not None else 'standard input line by line'
  where = f' on {processes} processes' if processes > 1 else ''
  if chief:
    print(f'{"scoring" if f.score else "translating"} {what} with checkpoint(s) {list(translator.checkpoints)} on '
          f'{translator.mesh.size if translator.mesh else 1} {jax.default_backend()} device(s){where}'
          + (' each' if where else ''), file=sys.stderr, flush=True)
  to_stdout = f.output == '-'
  written, translations, done = [], [], 0
  in_parts = sources is not None and not to_stdout
  if in_parts:
    written, translations = translate_in_parts(translator, f, sources, references, steering)
    done = len(sources)
  chunks = [] if in_parts else stdin_chunks(f.stream_wait) if sources is None else [sources]
  shown = Progress()
  progress = None if sources is None or not chief else (lambda n, total: shown.update(f'{n}/{total} sentences'))
  for chunk in chunks:
    targets = None
    if f.score:
      if done + len(chunk) > len(references):
        raise parallel_text.DataError(f'standard input has more lines than the {len(references)} of '
                                       f'{f.reference}; give the reference of this input')
      targets = references[done:done + len(chunk)]
    lines, best = shared_output_lines(translator, f, chunk, targets, progress, done, steering)
    done += len(chunk)
    translations += best or []
    if to_stdout and chief:
      sys.stdout.write(''.join(line + '\n' for line in lines))
      sys.stdout.flush()
    else:
      written += lines
  shown.end()
  if f.score and done != len(references):
    raise parallel_text.DataError(f'standard input had {done} lines but {f.reference} has {len(references)}; '
                                  f'give the reference of this input (the {done} scores written are those of its '
                                  f'first {done} lines)')
  if not chief:
    return
  if not to_stdout:  # written whole, then renamed into place: never a half-written output; the same bytes each time
    data = ''.join(line + '\n' for line in written).encode('utf-8')
    storage.within(f.storage_timeout_seconds, f'writing {f.output}', lambda: storage.write_atomic(
        f.output, gzip.compress(data, mtime=0) if f.output.endswith('.gz') else data))
    if in_parts:
      storage.within(f.storage_timeout_seconds, f'removing {parts_folder(f.output)}',
                     lambda: storage.path(parts_folder(f.output)).rmtree())
  if references is not None and not f.score:
    if len(references) != len(translations):
      raise parallel_text.DataError(f'{f.reference} has {len(references)} lines but the input had '
                                     f'{len(translations)}; give the reference of this input')
    s = translator.settings
    tokenize = f.bleu_tokenize or s.decode.bleu_tokenize
    score, signature = scoring.bleu(translations, references, tokenize, f.lowercase)
    print(f'BLEU = {score:.2f} ({signature})', file=sys.stderr)
    if s.data.dataset.startswith('wmt14'):
      score, label = scoring.paper_bleu(translations, references)
      print(f'BLEU = {score:.2f} ({label})', file=sys.stderr)


def main(argv: list[str]) -> int:
  """The program on `argv`; returns its exit status (flax_transformer.commands)."""
  from flax_transformer import commands
  return commands.run_program(argv, define, lambda f: translate(f, argv), __doc__, required=('workdir',))


def console():
  from flax_transformer import commands
  commands.console(main)


if __name__ == '__main__':
  console()
