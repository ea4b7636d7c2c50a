"""Old import path of `keras_dist.callbacks.profiler` (kept working)."""

from keras_dist.callbacks.profiler import Profiler  # noqa: F401
