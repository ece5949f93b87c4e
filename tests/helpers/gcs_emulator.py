"""A local Google Cloud Storage for tests: pip's gcp-storage-emulator, with two GCS behaviours it lacks.

python tests/helpers/gcs_emulator.py PORT DATA_DIR   (serves bucket `bucket` on 127.0.0.1:PORT until killed);
`start(DATA_DIR)` starts one as a process (the tests, bench/soak.py).

Real GCS sends an object's generation with its content (`x-goog-generation`; TensorStore, which Orbax
writes arrays with, needs it to read an OCDBT manifest back) and honours `ifGenerationMatch=0` on upload
(create only if absent: the workdir lock). The emulator does neither; the two handlers below add them.
"""

import os
import socket
import subprocess
import sys
import time
from http import HTTPStatus


def free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def start(data_dir) -> tuple[subprocess.Popen, dict]:
  """An emulator with bucket `bucket`, storing under `data_dir`, as a process on a free port of 127.0.0.1: (the
  process, the environment variables that point the product at it). SIGSTOP of the process is a storage server
  that stops answering: connections are still accepted, and nothing comes back."""
  port = free_port()
  server = subprocess.Popen([sys.executable, os.path.abspath(__file__), str(port), str(data_dir)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  url = f'http://127.0.0.1:{port}'
  variables = {'STORAGE_EMULATOR_HOST': url, 'TENSORSTORE_GCS_HTTP_URL': url, 'GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT': 'false',
               'EPATH_USE_TF': 'false'}
  deadline = time.time() + 30
  while True:
    try:
      socket.create_connection(('127.0.0.1', port), timeout=1).close()
      return server, variables
    except OSError:
      if time.time() > deadline or server.poll() is not None:
        server.kill()
        raise RuntimeError('the GCS emulator did not start')
      time.sleep(0.1)


def _serve(port: int, data_dir: str) -> None:
  from gcp_storage_emulator import server
  from gcp_storage_emulator.exceptions import NotFound
  from gcp_storage_emulator.handlers import objects
  _download, _insert = objects.download, objects.insert

  def download(request, response, storage, *args, **kwargs):
    _download(request, response, storage, *args, **kwargs)
    try:
      resource = storage.get_file_obj(request.params['bucket_name'], request.params['object_id'])
    except NotFound:
      return
    response['x-goog-generation'] = resource['generation']
    response['x-goog-metageneration'] = resource['metageneration']

  def insert(request, response, storage, *args, **kwargs):
    if request.query.get('ifGenerationMatch') == ['0']:
      name = (request.query.get('name') or [None])[0]
      if name is None and isinstance(request.data, dict):  # a multipart upload names the object in its metadata
        name = (request.data.get('meta') or request.data).get('name')
      try:
        storage.get_file_obj(request.params['bucket_name'], name)
      except NotFound:
        pass
      else:
        response.status = HTTPStatus.PRECONDITION_FAILED
        response.json({'error': {'code': 412,
                                 'message': 'At least one of the pre-conditions you specified did not hold.'}})
        return
    return _insert(request, response, storage, *args, **kwargs)

  def _patched(handlers: dict) -> dict:
    replaced = {_download: download, _insert: insert}
    return {method: replaced.get(handler, handler) for method, handler in handlers.items()}

  server.HANDLERS = tuple((regex, _patched(handlers)) for regex, handlers in server.HANDLERS)
  objects.insert = insert  # the router's fallback for uploads posted without the /upload prefix
  objects.download = download  # what a JSON-API get with alt=media calls

  emulator = server.create_server('127.0.0.1', port, in_memory=False, default_bucket='bucket', data_dir=data_dir)
  emulator.run()


if __name__ == '__main__':
  _serve(int(sys.argv[1]), sys.argv[2])
