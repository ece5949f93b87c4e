"""Download Multi30k task 1 (EN, DE) from the multi30k/dataset repository and verify every file.

  python tools/get_multi30k.py --dir=data/multi30k
  python train.py --config=configs/multi30k.py --workdir=runs/m30k --config.data_dir=data/multi30k

Six gzipped files (train 29,000, val 1,014, test_2016_flickr 1,000 lines), 1.4 MB in all, fetched at a
pinned commit and checked against SHA-256 sums; a file that does not match is deleted and named. Files
already present and correct are kept. Cite Elliott et al. (2016), Multi30K; the data are for research use.
"""

import argparse
import hashlib
import os
import sys
import urllib.request

COMMIT = 'a3d2e0d26b56f3846f66a952536ffed4e401d05a'
URL = f'https://raw.githubusercontent.com/multi30k/dataset/{COMMIT}/data/task1/raw/{{name}}'
SHA256 = {
    'train.en.gz': 'd79cfa999dd4c51d2cb42499b6796d5a882c3a8a961923c25a898c90f8bbd56f',
    'train.de.gz': '726e39b2fa9eb9ffb6dc763fb35a179f80fae06ffc5d28b6ace5faa883de28a6',
    'val.en.gz': '14f7d25ddd868909a9213e361768460edcacdd6ab9d1e77b92560dc10c10dc28',
    'val.de.gz': 'f0cba2f995189cf5770f29a8a9a537a3ad3f51657ad873405082ff6863a5e75a',
    'test_2016_flickr.en.gz': '611d361c6334bc7246101d48097c13cf5c4413c5befc793cc629934359d532d9',
    'test_2016_flickr.de.gz': '9204244e408ccb38d2a55cfcd344df15005fc42a07a6e55ca6c52b6ababb8cc8',
}


def sha256(path: str) -> str:
  with open(path, 'rb') as f:
    return hashlib.sha256(f.read()).hexdigest()


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--dir', default='data/multi30k', help='where the files go')
  args = parser.parse_args()
  os.makedirs(args.dir, exist_ok=True)
  for name, expected in SHA256.items():
    path = os.path.join(args.dir, name)
    if os.path.exists(path) and sha256(path) == expected:
      print(f'{path}: present, checksum ok')
      continue
    try:
      urllib.request.urlretrieve(URL.format(name=name), path + '.part')
    except OSError as error:
      print(f'error: downloading {URL.format(name=name)} failed ({error}); check the connection and rerun',
            file=sys.stderr)
      return 1
    if sha256(path + '.part') != expected:
      os.remove(path + '.part')
      print(f'error: {name} from {URL.format(name=name)} does not match its SHA-256; nothing was kept',
            file=sys.stderr)
      return 1
    os.replace(path + '.part', path)
    print(f'{path}: downloaded, checksum ok')
  return 0


if __name__ == '__main__':
  sys.exit(main())
