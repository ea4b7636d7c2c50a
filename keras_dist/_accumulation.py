"""Old import path of `keras_dist.aggregation.accumulation` (kept working: the same module)."""

import sys

from keras_dist.aggregation import accumulation as _module

sys.modules[__name__] = _module
