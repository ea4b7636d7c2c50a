"""keras_dist: distributed training with TensorFlow and Keras 3 that works from one line."""

from keras_dist.cluster import (
    ClusterConfig,
    ClusterConfigError,
    is_chief,
    num_workers,
    worker_index,
)

__version__ = "0.1.0"
