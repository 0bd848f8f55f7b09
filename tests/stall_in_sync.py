"""``examples/train_moe.py`` with rank 1 stalled (asleep) in ``data_parallel_sync`` at its third step: a wait
outside the Buffer's calls, in gloo's all-reduce of the gradients. Run by ``test_examples.py`` under torchrun;
arguments as train_moe.py's."""
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))

import train_moe  # noqa: E402

from ubep_torch import nn as unn  # noqa: E402

_sync, _calls = unn.data_parallel_sync, [0]


def _stalling_sync(*args, **kwargs):
    _calls[0] += 1
    if _calls[0] == 3 and os.environ.get("RANK") == "1":
        time.sleep(60)
    return _sync(*args, **kwargs)


train_moe.unn.data_parallel_sync = _stalling_sync

if __name__ == "__main__":
    train_moe.train(train_moe.parse_args())
