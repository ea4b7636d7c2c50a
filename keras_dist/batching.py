"""Old import path; batch arithmetic lives in `keras_dist.data.batching`."""

from keras_dist.data.batching import *  # noqa: F401,F403
from keras_dist.data.batching import __all__  # noqa: F401
