"""Old import path; data sources live in `keras_dist.data.sources`."""

from keras_dist.data.sources import *  # noqa: F401,F403
from keras_dist.data.sources import (  # noqa: F401
    _BATCHING_DATASETS,
    _PASS_THROUGH_DATASETS,
    DEFAULT_SHUFFLE_BUFFER,
)
