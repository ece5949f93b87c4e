"""Download Multi30k task 1 (EN, DE) from the multi30k/dataset repository and verify every file.

  python tools/get_multi30k.py --dir=data/multi30k
  python train.py --config=configs/multi30k.py:data/multi30k --workdir=runs/m30k

Six gzipped files (train 29,000, val 1,014, test_2016_flickr 1,000 lines), 1.4 MB in all, fetched at a
pinned commit and checked against SHA-256 sums (flax_transformer/corpora.py, which a run of
configs/multi30k.py also downloads through); a file that does not match is not kept, and named. Files already
present and correct are kept. Cite Elliott et al. (2016), Multi30K; the data are for research use.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from flax_transformer import corpora  # noqa: E402


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--dir', default='data/multi30k', help='where the files go')
  args = parser.parse_args()
  paths = [os.path.join(args.dir, name) for name in corpora.SHA256]
  try:
    fetched = corpora.fetch(paths, corpora.MULTI30K_URL)
  except corpora.DownloadError as error:
    print(f'error: {error}', file=sys.stderr)
    return 1
  for path in sorted(set(paths) - set(fetched)):
    print(f'{path}: present, checksum ok')
  return 0


if __name__ == '__main__':
  sys.exit(main())
