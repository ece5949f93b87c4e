"""train.py whose process 0 takes SLOW_VOCABULARY_SECONDS longer to build the vocabulary (a big corpus).

python tests/helpers/slow_vocabulary_train.py [train.py flags]; used by tests/test_bad_input.py to check that the
other processes of a multi-process run wait for the vocabulary however long it takes.
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from flax_transformer.commands import train  # noqa: E402
from flax_transformer import tokenizer  # noqa: E402

_train_or_load = tokenizer.train_or_load


def slow_train_or_load(data, workdir, corpus):
  if corpus is not None:  # only the process that trains the vocabulary is handed the corpus
    time.sleep(float(os.environ['SLOW_VOCABULARY_SECONDS']))
  return _train_or_load(data, workdir, corpus)


tokenizer.train_or_load = slow_train_or_load

if __name__ == '__main__':
  train.console()
