"""Old import path of `keras_dist.checkpointing.stock_writers` (kept working: the same module)."""

import sys

from keras_dist.checkpointing import stock_writers as _module

sys.modules[__name__] = _module
