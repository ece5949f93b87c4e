"""Shared fixtures. Eight host CPU devices so sharded code paths run on CPU.

The suite pins JAX to the CPU (JAX_PLATFORMS=cpu, before JAX starts), so it passes unchanged on a machine that
has a GPU or TPU; the tests marked `accelerator` need one and are skipped unless TEST_ON_ACCELERATOR=1 (set by
bench/gpu.sh, which runs them with `-m accelerator`), which leaves JAX its own platform choice.

Every process the suite starts (pytest-xdist workers, train.py and translate.py subprocesses, the notebook's
kernel) inherits one persistent compilation cache through the environment, so a program compiled once is
loaded everywhere after, however short its compilation (thousands of small programs are compiled again in
every process otherwise). JAX writes cache entries from process 0 of a multi-process run only;
tests/helpers/every_process/sitecustomize.py lets every process write its own.

The programs the suite starts (train.py, translate.py, the helper workers) are forks of one process per pytest
process that has imported TensorFlow already (tests/helpers/every_process/fork_server.py): each is still a
process of its own with the test's command line, environment, streams and signals, and starts ~8 s of CPU
sooner. TEST_FRESH_INTERPRETERS=1 starts each in a fresh interpreter instead.

The tests compile XLA:CPU programs at LLVM optimisation level 0 (COMPILE_FLAGS): the tiny programs run in
milliseconds either way, and compilation, which is most of the suite's time, takes ~40% less CPU time.
Bitwise comparisons compare runs made under the same flags.
"""

import contextlib
import fcntl
import os
import subprocess
import sys
import threading

# LLVM -O0 (see above); and in-process collectives of 8 CPU devices wait for each other as long as a starved
# 2-core machine needs (XLA aborts the process after 40 s by default, a hang detector, not a limit on work).
COMPILE_FLAGS = ('--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false '
                 '--xla_cpu_collective_call_terminate_timeout_seconds=600')
os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=8')
if COMPILE_FLAGS not in os.environ['XLA_FLAGS']:
  os.environ['XLA_FLAGS'] += ' ' + COMPILE_FLAGS
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
ON_ACCELERATOR = os.environ.get('TEST_ON_ACCELERATOR') == '1'
if not ON_ACCELERATOR:
  os.environ['JAX_PLATFORMS'] = 'cpu'  # the fake CPU devices, whatever else the machine has
os.environ['JAX_COMPILATION_CACHE_DIR'] = os.environ.get('JAX_TEST_CACHE_DIR', '/tmp/flax_transformer_jax_cache')
os.environ['JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS'] = '0'
os.environ['JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES'] = '0'

import numpy as np  # noqa: E402
import pytest  # noqa: E402


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pytest_configure(config):
  """Where tests run (not in pytest-xdist's controller, which only hands them out): TensorFlow imported with its
  start-up lines silenced (they would print after the summary); in a pytest-xdist worker the fork server
  started at once (elsewhere by the first program a test starts), so that it is ready by the first test that
  needs it."""
  if getattr(config.option, 'numprocesses', None) and not hasattr(config, 'workerinput'):
    return  # the controller of -n N: its workers do both
  from flax_transformer import tensorflow_setup
  tensorflow_setup.import_quietly()  # tf.data only
  if hasattr(config, 'workerinput'):
    threading.Thread(target=_fork_server_address, daemon=True).start()


def pytest_collection_finish(session):
  """Once the test modules are imported: the garbage collector set as the fork server sets it for its programs."""
  from tests.helpers.every_process import fork_server
  fork_server.freeze_imported_objects()


def pytest_collection_modifyitems(items):
  """Under pytest-xdist, the slow tests first, in file order, so that the longest start at once instead of at
  the end of a worker's queue (every worker sorts the same way); within each, the tests of the shared trained
  run last, so that it trains in the background meanwhile. A plain run keeps file order, so -x stops at
  the first failing test of the files named, as tools/mutation_check.py expects. Tests that need an
  accelerator are skipped unless TEST_ON_ACCELERATOR=1."""
  if os.environ.get('PYTEST_XDIST_WORKER'):
    items.sort(key=lambda item: (item.get_closest_marker('slow') is None, _uses_trained_run(item)))
  if not ON_ACCELERATOR:
    skip = pytest.mark.skip(reason='needs a GPU or TPU: bench/gpu.sh runs it (TEST_ON_ACCELERATOR=1)')
    for item in items:
      if item.get_closest_marker('accelerator'):
        item.add_marker(skip)


@pytest.fixture
def tiny_config():
  from configs import tiny
  return tiny.get_config()


@pytest.fixture
def small_model_config():
  """Small enough for seconds, wide enough that heads/FFN/vocab split 4 ways."""
  from flax_transformer.model import TransformerConfig
  return TransformerConfig(vocab_size=64, d_model=32, num_heads=4, d_ff=64, num_encoder_layers=2,
                           num_decoder_layers=2, dropout_rate=0.0, max_positions=64)


def random_batch(rng: np.random.Generator, batch: int, src_len: int, tgt_len: int, vocab: int):
  """Token batches with an EOS and right padding of random length; ids 0 (pad) and 1 (eos) reserved."""
  def side(length):
    ids = rng.integers(3, vocab, size=(batch, length))
    lengths = rng.integers(2, length + 1, size=batch)
    for row, n in enumerate(lengths):
      ids[row, n - 1] = 1
      ids[row, n:] = 0
    return ids.astype(np.int32)
  return {'inputs': side(src_len), 'targets': side(tgt_len)}


@pytest.fixture
def np_rng():
  return np.random.default_rng(0)


@contextlib.contextmanager
def _once_per_run(tmp_path_factory, name: str):
  """A directory shared by every pytest-xdist worker of this run, and whether this caller must fill it
  (under an exclusive lock, so the others wait for it rather than build it again)."""
  root = tmp_path_factory.getbasetemp()
  if os.environ.get('PYTEST_XDIST_WORKER'):
    root = root.parent  # the workers' base directories share this parent
  directory = root / name
  with open(root / f'{name}.lock', 'w') as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
      yield directory, not (directory / 'done').exists()
      (directory / 'done').touch()
    finally:
      fcntl.flock(lock, fcntl.LOCK_UN)


def train_command(workdir, corpus_dir, steps=9, *extra):
  """train.py on configs/tiny.py over a corpus written by tests.test_input_pipeline.write_corpus: one batch
  shape, checkpoints every 3 steps, no evaluation, one CPU device."""
  return [sys.executable, os.path.join(ROOT, 'train.py'), '--config', os.path.join(ROOT, 'configs/tiny.py'),
          f'--workdir={workdir}', '--config.dataset=files',
          f'--config.train_source={corpus_dir}/train.src.gz', f'--config.train_target={corpus_dir}/train.tgt.gz',
          f'--config.eval_source={corpus_dir}/eval.src.gz', f'--config.eval_target={corpus_dir}/eval.tgt.gz',
          '--config.num_bucket_boundaries=1', '--config.max_train_length=16', '--config.max_eval_length=16',
          f'--config.num_train_steps={steps}', '--config.checkpoint_every_steps=3', '--config.eval_every_steps=100',
          '--config.log_every_steps=1', '--config.num_eval_bleu_sentences=0', '--config.mesh_shape=(1,1,1)', *extra]


EVERY_PROCESS = os.path.join(ROOT, 'tests', 'helpers', 'every_process')  # its sitecustomize: each process of a
# multi-process run writes its own compilation-cache entries


def _fork_server_address() -> str | None:
  """The socket of this pytest process's fork server, started at the first call; None with
  TEST_FRESH_INTERPRETERS=1 (every program then imports everything itself)."""
  if os.environ.get('TEST_FRESH_INTERPRETERS') == '1':
    return None
  from tests.helpers.every_process import fork_server  # one module, however this file was imported
  return fork_server.started(dict(os.environ, PYTHONPATH=os.pathsep.join((ROOT, EVERY_PROCESS))))


def subprocess_env(devices=1):
  """The environment of a train.py / translate.py subprocess: `devices` CPU devices, the suite's cache and
  compile flags, and the fork server that starts this repository's programs with TensorFlow imported.
  devices=None leaves the device count to the program (the plan sets its own)."""
  count = f'--xla_force_host_platform_device_count={devices} ' if devices else ''
  environment = dict(os.environ, PYTHONPATH=os.pathsep.join((ROOT, EVERY_PROCESS)), XLA_FLAGS=count + COMPILE_FLAGS)
  address = _fork_server_address()
  if address:
    environment['TEST_FORK_SERVER'] = address
  return environment


TRAINED_STEPS, TRAINED_FLAGS = 12, ('--config.keep_checkpoints=4', '--config.ema_decay=0.9')


def _uses_trained_run(item) -> bool:
  return 'trained_run' in getattr(item, 'fixturenames', ())


def _trained_run(tmp_path_factory):
  """Builds the shared 12-step run unless this pytest run has (or another worker is building it: then waits)."""
  from tests.helpers.corpus import write_corpus
  with _once_per_run(tmp_path_factory, 'trained_run') as (directory, build):
    corpus, workdir = directory / 'corpus', directory / 'work'
    if build:
      corpus.mkdir(parents=True, exist_ok=True)
      write_corpus(str(corpus), 200, 0, 'train')
      write_corpus(str(corpus), 10, 1, 'eval')
      subprocess.run(train_command(workdir, corpus, TRAINED_STEPS, *TRAINED_FLAGS), env=subprocess_env(),
                     check=True, capture_output=True, timeout=600)
  return str(workdir), str(corpus)


@pytest.fixture(scope='session', autouse=True)
def _trained_run_in_background(request, tmp_path_factory):
  """Starts the shared run's train.py as pytest starts, when a collected test needs it, so that it trains
  while the first tests run (those tests are ordered last) instead of keeping a worker waiting."""
  thread = None
  tmp_path_factory.getbasetemp()  # made here, once: the thread and the first test would both create it
  if any(_uses_trained_run(item) for item in request.node.items):  # the node of a pytest-wide fixture: all tests
    thread = threading.Thread(target=lambda: _trained_run(tmp_path_factory), daemon=True)
    thread.start()
  yield
  if thread is not None:
    thread.join()  # never leave a half-built run behind for another worker


@pytest.fixture(scope='session')
def trained_run(tmp_path_factory):
  """(workdir, corpus directory) of one 12-step train.py run (train_command(..., TRAINED_STEPS, *TRAINED_FLAGS):
  checkpoints 3, 6, 9, 12, each with the weights' moving average; one loss a step), built once per pytest run
  and shared by every worker; tests copy the workdir before they change it."""
  return _trained_run(tmp_path_factory)


def free_port() -> int:
  import socket
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


@pytest.fixture(scope='session')
def gcs(tmp_path_factory):
  """A local Google Cloud Storage (tests/helpers/gcs_emulator.py), one per test process (fsspec keeps one client per
  process): yields the environment variables that point the product at it, also set in this process from then
  on."""
  from tests.helpers import gcs_emulator
  server, variables = gcs_emulator.start(tmp_path_factory.mktemp('gcs'))
  saved = {k: os.environ.get(k) for k in variables}
  os.environ.update(variables)
  try:
    yield variables
  finally:
    for key, value in saved.items():
      if value is None:
        os.environ.pop(key, None)
      else:
        os.environ[key] = value
    server.kill()
    server.wait()


@pytest.fixture
def files_config(tiny_config, tmp_path):
  """tiny_config on a 300-pair synthetic corpus (dataset='files'), training pairs up to 12 tokens."""
  from tests.helpers.corpus import write_corpus
  (train_src, train_tgt), _, _ = write_corpus(str(tmp_path), 300, 0, 'train')
  (eval_src, eval_tgt), _, _ = write_corpus(str(tmp_path), 37, 1, 'eval')
  config = tiny_config
  config.dataset = 'files'
  config.train_source, config.train_target = train_src, train_tgt
  config.eval_source, config.eval_target = eval_src, eval_tgt
  config.test_source, config.test_target = eval_src, eval_tgt
  config.max_train_length = 12
  return config


@pytest.fixture
def vocab(files_config, tmp_path):
  from flax_transformer import parallel_text, settings, tokenizer
  processor, path = tokenizer.train_or_load(settings.resolve(files_config).data, str(tmp_path / 'work'),
                                            lambda: parallel_text.python_pairs(settings.resolve(files_config).data))
  return processor, path
