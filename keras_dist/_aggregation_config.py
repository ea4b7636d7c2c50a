"""Old import path of `keras_dist.aggregation.config` (kept working: the same module)."""

import sys

from keras_dist.aggregation import config as _module

sys.modules[__name__] = _module
