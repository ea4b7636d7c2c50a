"""TensorFlow guide "Distributed training with TensorFlow", as one plain script.

Source: tensorflow/docs site/en/guide/distributed_training.ipynb (code cells, in order).
Changed, nothing else:
- strategy lines: tf.distribute.MirroredStrategy() and MultiWorkerMirroredStrategy() ->
  keras_dist.strategy(), MirroredStrategy(cross_device_ops=...) ->
  keras_dist.strategy(cross_device_ops=...), and `import keras_dist` as the first import;
- cells that need GPUs are dropped: MirroredStrategy(devices=["/gpu:0", "/gpu:1"]) and the
  NCCL CommunicationOptions; the cross_device_ops cell (a one-host MirroredStrategy option,
  rejected by keras_dist.strategy() under a multi-worker TF_CONFIG as documented) runs
  only when there is no multi-worker TF_CONFIG;
- sizes: BATCH_SIZE_PER_REPLICA 5 -> 5 (times the tests' batch multiplier), the custom
  loop's dataset repeat(1000) -> repeat(100);
- `fit`/`evaluate`/step results are kept in variables, and a result JSON is written at the
  end.
Run: python distributed_training_guide.py [result.json]
     keras-dist launch --workers 2 distributed_training_guide.py [result.{worker}.json]
"""

import keras_dist  # noqa: F401  (first: before any TensorFlow op)

import json
import os

import tensorflow as tf

from _offline import batch_multiplier
from _results import write_result

mirrored_strategy = keras_dist.strategy()

if len(json.loads(os.environ.get("TF_CONFIG") or "{}").get("cluster", {}).get("worker", [])) < 2:
  mirrored_strategy = keras_dist.strategy(
      cross_device_ops=tf.distribute.HierarchicalCopyAllReduce())

strategy = keras_dist.strategy()

central_storage_strategy = tf.distribute.experimental.CentralStorageStrategy()

default_strategy = tf.distribute.get_strategy()

# In optimizer or other library code
# Get currently active strategy
strategy = tf.distribute.get_strategy()
reduced = strategy.reduce("SUM", 1., axis=None)  # reduce some values

if tf.config.list_physical_devices('GPU'):
  strategy = keras_dist.strategy()
else:  # Use the Default Strategy
  strategy = tf.distribute.get_strategy()

with strategy.scope():
  # Do something interesting
  print(tf.Variable(1.))

mirrored_strategy = keras_dist.strategy()

with mirrored_strategy.scope():
  model = tf.keras.Sequential([
      tf.keras.layers.Dense(1, input_shape=(1,),
                            kernel_regularizer=tf.keras.regularizers.L2(1e-4))])
  model.compile(loss='mse', optimizer='sgd')

dataset = tf.data.Dataset.from_tensors(([1.], [1.])).repeat(100).batch(10)
dataset_history = model.fit(dataset, epochs=2)
evaluation = model.evaluate(dataset)

import numpy as np

inputs, targets = np.ones((100, 1)), np.ones((100, 1))
numpy_history = model.fit(inputs, targets, epochs=2, batch_size=10)
keras_model = model

mirrored_strategy.num_replicas_in_sync

# Compute a global batch size using a number of replicas.
BATCH_SIZE_PER_REPLICA = 5 * batch_multiplier()
global_batch_size = (BATCH_SIZE_PER_REPLICA *
                     mirrored_strategy.num_replicas_in_sync)
dataset = tf.data.Dataset.from_tensors(([1.], [1.])).repeat(100)
dataset = dataset.batch(global_batch_size)

LEARNING_RATES_BY_BATCH_SIZE = {5: 0.1, 10: 0.15, 20:0.175}
learning_rate = LEARNING_RATES_BY_BATCH_SIZE[global_batch_size]

with mirrored_strategy.scope():
  model = tf.keras.Sequential([
      tf.keras.layers.Dense(1, input_shape=(1,),
                            kernel_regularizer=tf.keras.regularizers.L2(1e-4))])
  optimizer = tf.keras.optimizers.SGD()

dataset = tf.data.Dataset.from_tensors(([1.], [1.])).repeat(100).batch(
    global_batch_size)
dist_dataset = mirrored_strategy.experimental_distribute_dataset(dataset)

# Sets `reduction=NONE` to leave it to tf.nn.compute_average_loss() below.
loss_object = tf.keras.losses.BinaryCrossentropy(
  from_logits=True,
  reduction=tf.keras.losses.Reduction.NONE)


def train_step(inputs):
  features, labels = inputs

  with tf.GradientTape() as tape:
    predictions = model(features, training=True)
    per_example_loss = loss_object(labels, predictions)
    loss = tf.nn.compute_average_loss(per_example_loss)
    model_losses = model.losses
    if model_losses:
      loss += tf.nn.scale_regularization_loss(tf.add_n(model_losses))

  gradients = tape.gradient(loss, model.trainable_variables)
  optimizer.apply_gradients(zip(gradients, model.trainable_variables))
  return loss


@tf.function
def distributed_train_step(dist_inputs):
  per_replica_losses = mirrored_strategy.run(train_step, args=(dist_inputs,))
  return mirrored_strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica_losses,
                         axis=None)


loop_losses = []
for dist_inputs in dist_dataset:
  loop_losses.append(float(distributed_train_step(dist_inputs)))
  print(loop_losses[-1])

iterator = iter(dist_dataset)
iterator_losses = []
for _ in range(10):
  iterator_losses.append(float(distributed_train_step(next(iterator))))
  print(iterator_losses[-1])

write_result(
    mirrored_strategy,
    weights={"keras_model": keras_model, "custom_loop_model": model},
    losses={"fit_dataset": dataset_history.history["loss"],
            "fit_numpy": numpy_history.history["loss"],
            "custom_loop": loop_losses, "custom_loop_iterator": iterator_losses},
    metrics={"evaluate": evaluation, "reduced": reduced},
    values={"global_batch_size": global_batch_size, "learning_rate": learning_rate},
)
