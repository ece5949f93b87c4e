"""A program of flax_transformer/commands run in the test's own process, as a user would run it (its argv, stdin,
working directory): its exit status and everything it printed, as subprocess.run gives them, without a new
interpreter importing JAX and TensorFlow again (seconds a run) and with the compiled programs kept."""

import contextlib
import io
import os
import subprocess
import sys


def run(main, argv: list[str], stdin: bytes = b'', cwd=None, text: bool = False) -> subprocess.CompletedProcess:
  """`main(argv)` with sys.stdin fed `stdin`, stdout and stderr captured and, if given, `cwd` the working
  directory; returns a CompletedProcess (stdout and stderr as bytes, or str with `text`)."""
  out, err, previous = io.StringIO(), io.StringIO(), os.getcwd()
  saved_stdin = sys.stdin
  sys.stdin = io.TextIOWrapper(io.BytesIO(stdin))
  try:
    if cwd is not None:
      os.chdir(cwd)
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
      status = main(list(argv))
  finally:
    sys.stdin = saved_stdin
    os.chdir(previous)
  stdout, stderr = out.getvalue(), err.getvalue()
  if not text:
    stdout, stderr = stdout.encode(), stderr.encode()
  return subprocess.CompletedProcess(argv, status, stdout, stderr)
