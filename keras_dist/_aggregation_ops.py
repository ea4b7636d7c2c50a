"""Old import path of `keras_dist.aggregation.ops` (kept working: the same module)."""

import sys

from keras_dist.aggregation import ops as _module

sys.modules[__name__] = _module
