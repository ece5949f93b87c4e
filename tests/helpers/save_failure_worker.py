"""train.py whose checkpoint writes fail from step `FAIL_FROM_STEP` on, inside Orbax's save: FAIL_KIND=write
(default) fails the data-state file as a full disk would; FAIL_KIND=folder refuses the step's folder as a
read-only or immutable checkpoints/ would. The run must report that save and exit, not wait in Orbax's
background threads."""

import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from flax_transformer import checkpointing  # noqa: E402

FAIL_FROM_STEP = int(os.environ['FAIL_FROM_STEP'])
_save = checkpointing.DataStateHandler.save


def failing_save(self, directory, args):
  if args.state['step'] >= FAIL_FROM_STEP:
    raise OSError(28, 'No space left on device')
  return _save(self, directory, args)


def failing_mkdir(self, *args, **kwargs):
  step = re.search(r'/checkpoints/(\d+)\.orbax-checkpoint-tmp', os.fspath(self))
  if step and int(step.group(1)) >= FAIL_FROM_STEP:
    raise PermissionError(1, 'Operation not permitted', os.fspath(self))
  return _mkdir(self, *args, **kwargs)


if os.environ.get('FAIL_KIND', 'write') == 'write':
  checkpointing.DataStateHandler.save = failing_save
else:
  from etils.epath import gpath
  _mkdir = gpath._GPath.mkdir
  gpath._GPath.mkdir = failing_mkdir

if __name__ == '__main__':
  import runpy
  sys.argv[0] = 'train.py'
  runpy.run_path(os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), 'train.py'),
                 run_name='__main__')
