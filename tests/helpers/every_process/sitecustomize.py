"""Run by every Python process the suite starts (tests/conftest.py puts this folder on PYTHONPATH): a program of
this repository is handed to the suite's fork server (fork_server.py: TensorFlow imported once, not in every
process), every process of a multi-process run writes its own persistent-compilation-cache entries, and, with
TEST_COMPILE_LOG=DIR, every program compiled or loaded is logged with its test and seconds (see _log_compiles).

JAX writes them from process 0 only (against write contention on shared filesystems such as GCS), and process
1's programs have cache keys of their own (its devices differ), so without this process 1 compiles every program
in every two-process run of the suite while process 0 waits for it in the first collective. The suite's cache is
one local directory, so each process writing its own entries is safe. JAX's compiler module is patched when it is
first imported; a process that never imports JAX pays nothing.
"""

import fork_server

fork_server.launch()  # returns unless the program ran in a fork (then exits as it did)

import importlib.abc  # noqa: E402
import importlib.util  # noqa: E402
import inspect  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import warnings  # noqa: E402


SIGNATURE = ['cache_key', 'compile_time_secs', 'module_name', 'backend', 'executable', 'host_callbacks']


def _write_from_any_process(compiler) -> None:
  from jax._src import compilation_cache, config
  if list(inspect.signature(compiler._cache_write).parameters) != SIGNATURE:
    return  # another JAX than the pinned one: left as it is (process 1 compiles afresh, as without this file)

  def cache_write(cache_key, compile_time_secs, module_name, backend, executable, host_callbacks):
    if not host_callbacks and compile_time_secs >= config.persistent_cache_min_compile_time_secs.value:
      try:
        compilation_cache.put_executable_and_time(cache_key, module_name, executable, backend, int(compile_time_secs))
      except Exception as error:  # as JAX does: a cache that cannot be written is a warning, not a failure
        warnings.warn(f'Error writing persistent compilation cache entry for {module_name!r}: {error!r}')

  compiler._cache_write = cache_write


def _log_compiles(compiler, log_dir: str) -> None:
  """With TEST_COMPILE_LOG=DIR: one line per program this process compiles or loads from the cache, in DIR/PID
  (tab-separated: the test that ran it, the program's name, seconds in all, seconds of XLA compilation), to see
  where the suite's compilation time goes."""
  import time
  compile_and_load, compile_or_get_cached = compiler.backend_compile_and_load, compiler.compile_or_get_cached
  compiled = []

  def timed_compile(*args, **kwargs):
    start = time.monotonic()
    try:
      return compile_and_load(*args, **kwargs)
    finally:
      compiled.append(time.monotonic() - start)

  def timed(backend, computation, *args, **kwargs):
    start, compiled[:] = time.monotonic(), []
    try:
      return compile_or_get_cached(backend, computation, *args, **kwargs)
    finally:
      name = str(computation.operation.attributes['sym_name']).strip('"')
      test = os.environ.get('PYTEST_CURRENT_TEST', sys.argv[0] if sys.argv else '').split(' ')[0]
      with open(os.path.join(log_dir, str(os.getpid())), 'a') as log:
        log.write(f'{test}\t{name}\t{time.monotonic() - start:.3f}\t{sum(compiled):.3f}\n')

  compiler.backend_compile_and_load, compiler.compile_or_get_cached = timed_compile, timed


class _OnJaxCompilerImport(importlib.abc.MetaPathFinder):
  def find_spec(self, name, path, target=None):
    if name != 'jax._src.compiler':
      return None
    sys.meta_path.remove(self)
    spec = importlib.util.find_spec(name)
    load = spec.loader.exec_module

    def exec_module(module):
      load(module)
      _write_from_any_process(module)
      if os.environ.get('TEST_COMPILE_LOG'):
        _log_compiles(module, os.environ['TEST_COMPILE_LOG'])
    spec.loader.exec_module = exec_module
    return spec


sys.meta_path.insert(0, _OnJaxCompilerImport())
