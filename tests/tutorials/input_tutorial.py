"""TensorFlow tutorial "Distributed input", as one plain script.

Source: tensorflow/docs site/en/tutorials/distribute/input.ipynb (code cells, in order).
Changed, nothing else:
- strategy lines: every tf.distribute.MirroredStrategy() -> keras_dist.strategy(), and
  `import keras_dist` as the first import (before any TensorFlow op);
- the cell that splits the CPU into 2 virtual devices is dropped: the tests choose the
  devices (one device, 2 virtual devices, or 2 launched workers);
- sizes: the two loops over epochs 10 -> 2 and 5 -> 2, steps_per_epoch 5 -> 2;
- what the cells print is also appended to `recorded`, and a result JSON is written at the
  end (per-replica values as this worker's `experimental_local_results`).
Run: python input_tutorial.py [result.json]   or   keras-dist launch --workers 2 input_tutorial.py
"""

import keras_dist  # noqa: F401  (first: before any TensorFlow op)

import tensorflow as tf

# Helper libraries
import numpy as np
import os

from _results import write_result

print(tf.__version__)

recorded = {}


def local(strategy, value):
  return [t.numpy().tolist() for t in strategy.experimental_local_results(value)]


print("Available devices:")
for i, device in enumerate(tf.config.list_logical_devices()):
  print("%d) %s" % (i, device))

global_batch_size = 16
# Create a tf.data.Dataset object.
dataset = tf.data.Dataset.from_tensors(([1.], [1.])).repeat(100).batch(global_batch_size)


@tf.function
def train_step(inputs):
  features, labels = inputs
  return labels - 0.3 * features


# Iterate over the dataset using the for..in construct.
recorded["before_strategy"] = []
for inputs in dataset:
  print(train_step(inputs))
  recorded["before_strategy"].append(train_step(inputs).numpy().tolist())

global_batch_size = 16
mirrored_strategy = keras_dist.strategy()

dataset = tf.data.Dataset.from_tensors(([1.], [1.])).repeat(100).batch(global_batch_size)
# Distribute input using the `experimental_distribute_dataset`.
dist_dataset = mirrored_strategy.experimental_distribute_dataset(dataset)
# 1 global batch of data fed to the model in 1 step.
print(next(iter(dist_dataset)))
recorded["first_batch"] = [local(mirrored_strategy, part) for part in next(iter(dist_dataset))]

dataset = tf.data.Dataset.from_tensors(([1.], [1.])).repeat(64).batch(16)
options = tf.data.Options()
options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
dataset = dataset.with_options(options)

mirrored_strategy = keras_dist.strategy()


def dataset_fn(input_context):
  batch_size = input_context.get_per_replica_batch_size(global_batch_size)
  dataset = tf.data.Dataset.from_tensors(([1.], [1.])).repeat(64).batch(16)
  dataset = dataset.shard(
      input_context.num_input_pipelines, input_context.input_pipeline_id)
  dataset = dataset.batch(batch_size)
  dataset = dataset.prefetch(2)  # This prefetches 2 batches per device.
  return dataset


dist_dataset = mirrored_strategy.distribute_datasets_from_function(dataset_fn)
recorded["from_function_shapes"] = [
    [list(t.shape) for t in mirrored_strategy.experimental_local_results(part)]
    for part in next(iter(dist_dataset))]

global_batch_size = 16
mirrored_strategy = keras_dist.strategy()

dataset = tf.data.Dataset.from_tensors(([1.], [1.])).repeat(100).batch(global_batch_size)
dist_dataset = mirrored_strategy.experimental_distribute_dataset(dataset)


@tf.function
def train_step(inputs):
  features, labels = inputs
  return labels - 0.3 * features


recorded["for_loop"] = []
for x in dist_dataset:
  # train_step trains the model using the dataset elements
  loss = mirrored_strategy.run(train_step, args=(x,))
  print("Loss is ", loss)
  recorded["for_loop"].append(local(mirrored_strategy, loss))

num_epochs = 2
steps_per_epoch = 2
recorded["iterator"] = []
for epoch in range(num_epochs):
  dist_iterator = iter(dist_dataset)
  for step in range(steps_per_epoch):
    # train_step trains the model using the dataset elements
    loss = mirrored_strategy.run(train_step, args=(next(dist_iterator),))
    # which is the same as
    # loss = mirrored_strategy.run(train_step, args=(dist_iterator.get_next(),))
    print("Loss is ", loss)
    recorded["iterator"].append(local(mirrored_strategy, loss))

# You can break the loop with `get_next_as_optional` by checking if the `Optional` contains a value
global_batch_size = 4
steps_per_loop = 5
strategy = keras_dist.strategy()

dataset = tf.data.Dataset.range(9).batch(global_batch_size)
distributed_iterator = iter(strategy.experimental_distribute_dataset(dataset))


@tf.function
def train_fn(distributed_iterator):
  for _ in tf.range(steps_per_loop):
    optional_data = distributed_iterator.get_next_as_optional()
    if not optional_data.has_value():
      break
    per_replica_results = strategy.run(lambda x: x, args=(optional_data.get_value(),))
    tf.print(strategy.experimental_local_results(per_replica_results))


train_fn(distributed_iterator)

global_batch_size = 16
epochs = 2
steps_per_epoch = 2
mirrored_strategy = keras_dist.strategy()

dataset = tf.data.Dataset.from_tensors(([1.], [1.])).repeat(100).batch(global_batch_size)
dist_dataset = mirrored_strategy.experimental_distribute_dataset(dataset)


@tf.function(input_signature=[dist_dataset.element_spec])
def train_step(per_replica_inputs):
  def step_fn(inputs):
    return 2 * inputs

  return mirrored_strategy.run(step_fn, args=(per_replica_inputs,))


recorded["element_spec"] = []
for _ in range(epochs):
  iterator = iter(dist_dataset)
  for _ in range(steps_per_epoch):
    output = train_step(next(iterator))
    tf.print(output)
    recorded["element_spec"].append([local(mirrored_strategy, part) for part in output])

strategy = keras_dist.strategy()
vocab = ["a", "b", "c", "d", "f"]

with strategy.scope():
  # Create the layer(s) under scope.
  layer = tf.keras.layers.StringLookup(vocabulary=vocab)


def dataset_fn(input_context):
  # a tf.data.Dataset
  dataset = tf.data.Dataset.from_tensor_slices(["a", "c", "e"]).repeat()

  # Custom your batching, sharding, prefetching, etc.
  global_batch_size = 4
  batch_size = input_context.get_per_replica_batch_size(global_batch_size)
  dataset = dataset.batch(batch_size)
  dataset = dataset.shard(
      input_context.num_input_pipelines,
      input_context.input_pipeline_id)

  # Apply the preprocessing layer(s) to the tf.data.Dataset
  def preprocess_with_kpl(input):
    return layer(input)

  processed_ds = dataset.map(preprocess_with_kpl)
  return processed_ds


distributed_dataset = strategy.distribute_datasets_from_function(dataset_fn)

# Print out a few example batches.
distributed_dataset_iterator = iter(distributed_dataset)
recorded["string_lookup"] = []
for _ in range(3):
  batch = next(distributed_dataset_iterator)
  print(batch)
  recorded["string_lookup"].append(local(strategy, batch))

mirrored_strategy = keras_dist.strategy()
dataset_size = 24
batch_size = 6
dataset = tf.data.Dataset.range(dataset_size).enumerate().batch(batch_size)
dist_dataset = mirrored_strategy.experimental_distribute_dataset(dataset)


def predict(index, inputs):
  outputs = 2 * inputs
  return index, outputs


result = {}
for index, inputs in dist_dataset:
  output_index, outputs = mirrored_strategy.run(predict, args=(index, inputs))
  indices = list(mirrored_strategy.experimental_local_results(output_index))
  rindices = []
  for a in indices:
    rindices.extend(a.numpy())
  outputs = list(mirrored_strategy.experimental_local_results(outputs))
  routputs = []
  for a in outputs:
    routputs.extend(a.numpy())
  for i, value in zip(rindices, routputs):
    result[i] = value

print(result)
recorded["predict"] = {int(i): int(value) for i, value in result.items()}

mirrored_strategy = keras_dist.strategy()


def value_fn(ctx):
  return tf.constant(ctx.replica_id_in_sync_group)


distributed_values = mirrored_strategy.experimental_distribute_values_from_function(value_fn)
recorded["values_from_function"] = []
for _ in range(4):
  result = mirrored_strategy.run(lambda x: x, args=(distributed_values,))
  print(result)
  recorded["values_from_function"].append(local(mirrored_strategy, result))

mirrored_strategy = keras_dist.strategy()


def input_gen():
  while True:
    yield np.random.rand(4)


# use Dataset.from_generator
dataset = tf.data.Dataset.from_generator(
    input_gen, output_types=(tf.float32), output_shapes=tf.TensorShape([4]))
dist_dataset = mirrored_strategy.experimental_distribute_dataset(dataset)
iterator = iter(dist_dataset)
recorded["generator_shapes"] = []
for _ in range(4):
  result = mirrored_strategy.run(lambda x: x, args=(next(iterator),))
  print(result)
  recorded["generator_shapes"].append(
      [list(t.shape) for t in mirrored_strategy.experimental_local_results(result)])

write_result(mirrored_strategy, values=recorded)
