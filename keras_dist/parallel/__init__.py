"""Model parallelism within one worker: pipeline stages and sharded layers across devices.

`split_sequential` cuts a `keras.Sequential` into stages, `PipelineModel` places stage s on
`devices[s]` and trains it with a GPipe schedule in one `tf.function`; `ShardedDense` and
`ShardedEmbedding` split one kernel or table across devices (Megatron-style). Importing this
package does not initialise the TensorFlow runtime.
"""

from keras_dist.parallel.pipeline import PipelineModel, split_sequential
from keras_dist.distribution.variables import shards
from keras_dist.parallel.sharded import ShardedDense, ShardedEmbedding

__all__ = ["PipelineModel", "split_sequential", "ShardedDense", "ShardedEmbedding", "shards"]
