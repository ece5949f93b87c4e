"""train.py whose checkpoint writes fail from step `FAIL_FROM_STEP` on, inside Orbax's save (as a full disk or a
revoked permission would): the run must report that save and exit, not hang in Orbax's background threads."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from flax_transformer import checkpointing  # noqa: E402

FAIL_FROM_STEP = int(os.environ['FAIL_FROM_STEP'])
_save = checkpointing.DataStateHandler.save


def failing_save(self, directory, args):
  if args.state['step'] >= FAIL_FROM_STEP:
    raise OSError(28, 'No space left on device')
  return _save(self, directory, args)


checkpointing.DataStateHandler.save = failing_save

if __name__ == '__main__':
  import runpy
  sys.argv[0] = 'train.py'
  runpy.run_path(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'train.py'),
                 run_name='__main__')
