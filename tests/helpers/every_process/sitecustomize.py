"""Run by every Python process the suite starts (tests/conftest.py puts this folder on PYTHONPATH): a program of
this repository is handed to the suite's fork server (fork_server.py: TensorFlow imported once, not in every
process), and every process of a multi-process run writes its own persistent-compilation-cache entries.

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
    spec.loader.exec_module = exec_module
    return spec


sys.meta_path.insert(0, _OnJaxCompilerImport())
