"""Corpora fetched on first use, from a local HTTP server standing in for the internet: every file checked
against its SHA-256 before it is kept, nothing half-downloaded left, offline a one-line error naming the fetch
command; configs/multi30k.py without ../shared reads (and fills) the user's cache folder."""

import functools
import http.server
import os
import shutil
import threading

import pytest

from configs import multi30k
from flax_transformer import corpora, parallel_text, settings

SHARED = multi30k.MULTI30K_DIR


@pytest.fixture
def server(tmp_path):
  """An HTTP server on 127.0.0.1 serving a folder (the six files copied from ../shared/data/multi30k); yields
  (the download URL with {name}, the folder)."""
  folder = tmp_path / 'served'
  folder.mkdir()
  for name in corpora.SHA256:
    shutil.copy(os.path.join(SHARED, name), folder / name)
  handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(folder))
  handler.log_message = lambda *args: None
  httpd = http.server.ThreadingHTTPServer(('127.0.0.1', 0), handler)
  threading.Thread(target=httpd.serve_forever, daemon=True).start()
  try:
    yield f'http://127.0.0.1:{httpd.server_address[1]}/{{name}}', folder
  finally:
    httpd.shutdown()


def test_missing_files_are_downloaded_checked_and_kept_once(server, tmp_path, capsys):
  url, _ = server
  paths = [str(tmp_path / 'data' / name) for name in corpora.SHA256]
  assert corpora.fetch(paths, url) == paths
  assert all(corpora.sha256(p) == corpora.SHA256[os.path.basename(p)] for p in paths)
  said = capsys.readouterr().out.splitlines()
  assert said[0].startswith(f'downloading {url.format(name="train.en.gz")} to ') and said[1].endswith('checksum ok')
  assert corpora.fetch(paths, url) == []  # present and correct: nothing fetched again
  assert sorted(os.listdir(tmp_path / 'data')) == sorted(corpora.SHA256)


def test_a_changed_file_is_not_kept_and_offline_names_the_fetch_command(server, tmp_path):
  url, folder = server
  (folder / 'val.de.gz').write_bytes((folder / 'val.de.gz').read_bytes()[:100])  # cut short on the way
  target = tmp_path / 'data' / 'val.de.gz'
  with pytest.raises(corpora.DownloadError, match=r'val.de.gz from .* does not match its SHA-256; nothing was kept'):
    corpora.fetch([str(target)], url)
  assert os.listdir(tmp_path / 'data') == []  # no partial file either
  with pytest.raises(corpora.DownloadError) as error:
    corpora.fetch([str(target)], 'http://127.0.0.1:9/{name}')
  message = str(error.value)
  assert message.startswith(f'{target} does not exist and downloading it from http://127.0.0.1:9/val.de.gz failed (')
  assert 'run python tools/get_multi30k.py --dir=DIR' in message and '\n' not in message
  with pytest.raises(corpora.DownloadError, match='no checksum is recorded for it'):
    corpora.fetch([str(tmp_path / 'other.gz')], url)


def test_the_main_config_without_shared_data_reads_and_fills_the_cache(server, tmp_path, monkeypatch):
  url, _ = server
  monkeypatch.setattr(multi30k, 'MULTI30K_DIR', str(tmp_path / 'no_shared_here'))
  monkeypatch.setenv('XDG_CACHE_HOME', str(tmp_path / 'cache'))
  config = multi30k.get_config()
  cache = str(tmp_path / 'cache' / 'flax_transformer' / 'multi30k')
  assert config.train_source == os.path.join(cache, 'train.en.gz') and config.download_url == corpora.MULTI30K_URL
  config.download_url = url  # the internet, served locally
  data = settings.resolve(config, 'cpu').data
  for split in ('train', 'eval'):
    parallel_text.check_split(data, split)
  assert sorted(os.listdir(cache)) == ['train.de.gz', 'train.en.gz', 'val.de.gz', 'val.en.gz']
  assert multi30k.get_config(str(tmp_path / 'mine')).download_url == ''  # a folder given: read as it is
