"""Serve a trained model over HTTP: flax-transformer-serve --workdir=DIR [--host=127.0.0.1 --port=8000]

Loads the model as translate.py does (the same flags: --checkpoint, --step, --average_last, --weights, an
ensemble as --workdir=A,B, the decoding defaults) on every local device, compiles its common shapes, then
answers POST /translate, /score and /align, GET /health, /ready and /metrics, and a web page at /
(flax_transformer/server.py). Binds to 127.0.0.1 unless --host says otherwise: put a reverse proxy with TLS and
authentication in front of it before opening it to a network. SIGTERM (or Ctrl-C) drains: no new requests,
those in flight are answered, then it exits 0. Also `python -m flax_transformer serve`.
"""

import os
import signal
import socket
import sys

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')


def define(flag_values, argv) -> None:
  from absl import flags
  from flax_transformer.commands import translate
  from flax_transformer.server import Limits
  define = lambda kind, name, default, help_string, **kw: getattr(flags, f'DEFINE_{kind}')(
      name, default, help_string, flag_values=flag_values, **kw)
  translate.define_model(flag_values)
  define('string', 'host', '127.0.0.1', 'The address to listen on (127.0.0.1: local connections only; 0.0.0.0: every network interface).')
  define('integer', 'port', 8000, 'The port to listen on.')
  limits = Limits()
  define('integer', 'max_request_bytes', limits.max_request_bytes, 'The largest request body (413 above it).')
  define('integer', 'max_request_sentences', limits.max_request_sentences, 'The most sentences a request (413).')
  define('integer', 'max_waiting', limits.max_waiting, 'The most sentences waiting for a decoding slot, all '
         'requests together; a request that would pass it gets 429 with Retry-After.')
  define('float', 'timeout_seconds', limits.timeout_seconds, 'A request\'s deadline (504 after it, its slots freed); '
         'a request may ask for a shorter one.')
  define('bool', 'split_long', False, 'Translate sentences longer than the model takes in pieces split at sentence '
         'punctuation (default: refuse them with 400).')


def check_flags(f) -> None:
  from flax_transformer import decoding_settings
  from flax_transformer.commands import translate
  from flax_transformer.errors import UserError
  decoding_settings.check({name: getattr(f, name) for name in translate.DECODING_FLAGS}, lambda name: f'--{name}')
  for name in ('max_request_bytes', 'max_request_sentences', 'max_waiting'):
    if getattr(f, name) < 1:
      raise UserError(f'--{name}={getattr(f, name)} must be 1 or more')
  if not 0 < f.timeout_seconds < float('inf'):
    raise UserError(f'--timeout_seconds={f.timeout_seconds} must be a finite number of seconds above 0')
  if not 0 <= f.port <= 65535:
    raise UserError(f'--port={f.port} is not a port; give 1 to 65535 (0: any free one)')
  try:  # before the model loads: a port in use is known in a second, not after a minute of loading
    with socket.socket(socket.AF_INET6 if ':' in f.host else socket.AF_INET) as probe:
      probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
      probe.bind((f.host, f.port))
  except OSError as error:
    raise UserError(f'cannot listen on {f.host}:{f.port} ({error.strerror}); choose another --port or --host') from None


def serve(f) -> None:
  import uvicorn
  from flax_transformer import platforms, server
  from flax_transformer.commands import translate
  check_flags(f)
  platforms.enable_compilation_cache()
  translator = translate.load(f)
  limits = server.Limits(f.max_request_bytes, f.max_request_sentences, f.max_waiting, f.timeout_seconds, f.split_long)
  app = server.create_app(translator, limits)
  config = uvicorn.Config(app, host=f.host, port=f.port, log_level='warning', timeout_graceful_shutdown=None)
  listening = uvicorn.Server(config)
  original = listening.startup

  async def startup(sockets=None):
    await original(sockets)
    if listening.started:
      port = listening.servers[0].sockets[0].getsockname()[1] if listening.servers else f.port
      print(f'serving checkpoint(s) {list(translator.checkpoints)} at http://{f.host}:{port}/ (API: /docs; '
            f'SIGTERM drains and stops)', file=sys.stderr, flush=True)
  listening.startup = startup
  # uvicorn drains on SIGTERM and Ctrl-C, then raises the signal again for the handler it found: a handler that
  # returns lets the program exit 0 once drained.
  drained = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)}
  try:
    listening.run()
  finally:
    for sig, handler in drained.items():
      signal.signal(sig, handler)
  if not listening.started:
    from flax_transformer.errors import UserError
    raise UserError(f'the server could not start on {f.host}:{f.port}; see the lines above')


def main(argv: list[str]) -> int:
  """The program on `argv`; returns its exit status (flax_transformer.commands)."""
  from flax_transformer import commands
  return commands.run_program(argv, define, serve, __doc__, required=('workdir',))


def console():
  from flax_transformer import commands
  commands.console(main)


if __name__ == '__main__':
  console()
