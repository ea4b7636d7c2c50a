"""Input for data-parallel training: batch arithmetic and `distribute_dataset`.

* `batching`: global vs per-replica batch, learning-rate scaling.
* `pipeline`: `distribute_dataset` (shard at the source -> shuffle -> map -> batch ->
  prefetch, handed to the strategy) and `steps_per_epoch`.
* `sources`: what `distribute_dataset` accepts (arrays, tf.data, TFRecord patterns,
  dataset functions) and how each is sharded per worker.
"""

from keras_dist.data.batching import global_batch_size, per_replica_batch_size, scale_learning_rate
from keras_dist.data.pipeline import distribute_dataset, steps_per_epoch

__all__ = [
    "distribute_dataset",
    "steps_per_epoch",
    "global_batch_size",
    "per_replica_batch_size",
    "scale_learning_rate",
]
