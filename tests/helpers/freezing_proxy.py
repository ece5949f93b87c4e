"""A TCP proxy in front of a storage server that stops answering on cue, as a storage server can.

python tests/helpers/freezing_proxy.py LISTEN_PORT TARGET_PORT FREEZE_FILE

Relays every connection to 127.0.0.1:TARGET_PORT until FREEZE_FILE exists; from then on it accepts connections
and reads what clients send but relays nothing, in either direction, and never closes: a request waits for an
answer that never comes.
"""

import asyncio
import os
import sys

LISTEN_PORT, TARGET_PORT, FREEZE_FILE = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]


async def pipe(reader, writer):
  try:
    while data := await reader.read(65536):
      while os.path.exists(FREEZE_FILE):
        await asyncio.sleep(3600)
      writer.write(data)
      await writer.drain()
  except (ConnectionError, asyncio.CancelledError):
    pass
  finally:
    if not os.path.exists(FREEZE_FILE):
      writer.close()


async def serve(client_reader, client_writer):
  while os.path.exists(FREEZE_FILE):
    await client_reader.read(65536)  # swallow the request, answer nothing
    await asyncio.sleep(1)
  server_reader, server_writer = await asyncio.open_connection('127.0.0.1', TARGET_PORT)
  await asyncio.gather(pipe(client_reader, server_writer), pipe(server_reader, client_writer))


async def main():
  server = await asyncio.start_server(serve, '127.0.0.1', LISTEN_PORT)
  async with server:
    await server.serve_forever()


if __name__ == '__main__':
  asyncio.run(main())
