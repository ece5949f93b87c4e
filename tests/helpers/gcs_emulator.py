"""A local Google Cloud Storage for tests: pip's gcp-storage-emulator, with two GCS behaviours it lacks.

python tests/helpers/gcs_emulator.py PORT DATA_DIR   (serves bucket `bucket` on 127.0.0.1:PORT until killed)

Real GCS sends an object's generation with its content (`x-goog-generation`; TensorStore, which Orbax
writes arrays with, needs it to read an OCDBT manifest back) and honours `ifGenerationMatch=0` on upload
(create only if absent: the workdir lock). The emulator does neither; the two handlers below add them.
"""

import sys
from http import HTTPStatus

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
      response.json({'error': {'code': 412, 'message': 'At least one of the pre-conditions you specified did not hold.'}})
      return
  return _insert(request, response, storage, *args, **kwargs)


def _patched(handlers: dict) -> dict:
  return {method: {_download: download, _insert: insert}.get(handler, handler) for method, handler in handlers.items()}


server.HANDLERS = tuple((regex, _patched(handlers)) for regex, handlers in server.HANDLERS)
objects.insert = insert  # the router's fallback for uploads posted without the /upload prefix
objects.download = download  # what a JSON-API get with alt=media calls

if __name__ == '__main__':
  port, data_dir = int(sys.argv[1]), sys.argv[2]
  emulator = server.create_server('127.0.0.1', port, in_memory=False, default_bucket='bucket', data_dir=data_dir)
  emulator.run()
