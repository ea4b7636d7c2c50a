"""Worker 1 raises while worker 0 waits in an all-reduce (real TensorFlow collectives)."""

import tensorflow as tf

import keras_dist

strategy = keras_dist.strategy()
if keras_dist.worker_index() == 1:
    raise ValueError("worker 1 failed before its all-reduce")


@tf.function
def step():
    return tf.distribute.get_replica_context().all_reduce("sum", tf.constant(1.0))


print("worker 0 enters the all-reduce", flush=True)
strategy.run(step)
