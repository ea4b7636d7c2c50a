"""TensorFlow tutorial "Save and load a model using a distribution strategy", as one script.

Source: tensorflow/docs site/en/tutorials/distribute/save_and_load.ipynb (code cells, in
order).
Changed, nothing else:
- strategy lines: tf.distribute.MirroredStrategy() -> keras_dist.strategy(), and
  `import keras_dist` as the first import (before any TensorFlow op); the cell that loads
  into `tf.distribute.OneDeviceStrategy('/cpu:0')` keeps that strategy (it is the point);
- data: tfds.load('mnist') -> offline digits with MNIST's shapes and dtypes
  (`_offline.tfds_mnist`), 256 train / 128 test;
- paths: '/tmp/keras_save.keras' -> 'keras_save.keras', '/tmp/tf_save' -> 'tf_save'
  (the tests give each run its own working directory);
- Keras 3 (what tf.keras is in TF 2.21): `hub.KerasLayer(loaded, trainable=True)` ->
  `tf.keras.layers.TFSMLayer(saved_model_path, call_endpoint='serving_default',
  trainable=True)`; `model.save(saved_model_path)`
  to a SavedModel -> `model.export(saved_model_path)`; `model.save(..., options=...)` and
  `load_model(..., options=...)` for a SavedModel -> `tf.saved_model.save/load(...,
  options=...)`; `save_spec()` (gone in Keras 3) dropped;
- sizes: BUFFER_SIZE 10000 -> 256; BATCH_SIZE_PER_REPLICA 64 -> 32 and 4 -> 4 (times the
  tests' batch multiplier); Conv2D 32 -> 8 filters, Dense 64 -> 16; epochs 2 -> 2;
  dataset_size 100 -> 32;
- each `fit` is assigned to a history, and a result JSON is written at the end.
Run: python save_and_load.py [result.json]   or   keras-dist launch --workers 2 save_and_load.py
"""

import keras_dist  # noqa: F401  (first: before any TensorFlow op)

import tensorflow as tf

from _offline import batch_multiplier, tfds_mnist
from _results import write_result

mirrored_strategy = keras_dist.strategy()


def get_data():
  datasets, _ = tfds_mnist(num_train=256, num_test=128)
  mnist_train, mnist_test = datasets['train'], datasets['test']

  BUFFER_SIZE = 256

  BATCH_SIZE_PER_REPLICA = 32 * batch_multiplier()
  BATCH_SIZE = BATCH_SIZE_PER_REPLICA * mirrored_strategy.num_replicas_in_sync

  def scale(image, label):
    image = tf.cast(image, tf.float32)
    image /= 255

    return image, label

  train_dataset = mnist_train.map(scale).cache().shuffle(BUFFER_SIZE).batch(BATCH_SIZE)
  eval_dataset = mnist_test.map(scale).batch(BATCH_SIZE)

  return train_dataset, eval_dataset


def get_model():
  with mirrored_strategy.scope():
    model = tf.keras.Sequential([
        tf.keras.layers.Conv2D(8, 3, activation='relu', input_shape=(28, 28, 1)),
        tf.keras.layers.MaxPooling2D(),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(16, activation='relu'),
        tf.keras.layers.Dense(10)
    ])

    model.compile(loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=tf.keras.optimizers.Adam(),
                  metrics=[tf.metrics.SparseCategoricalAccuracy()])
    return model


histories = {}
model = get_model()
train_dataset, eval_dataset = get_data()
histories["model"] = model.fit(train_dataset, epochs=2)
trained_model = model

keras_model_path = 'keras_save.keras'
model.save(keras_model_path)

restored_keras_model = tf.keras.models.load_model(keras_model_path)
histories["restored_keras_model"] = restored_keras_model.fit(train_dataset, epochs=2)

another_strategy = tf.distribute.OneDeviceStrategy('/cpu:0')
with another_strategy.scope():
  restored_keras_model_ds = tf.keras.models.load_model(keras_model_path)
  histories["restored_keras_model_ds"] = restored_keras_model_ds.fit(train_dataset, epochs=2)

model = get_model()  # get a fresh model
saved_model_path = 'tf_save'
tf.saved_model.save(model, saved_model_path)

DEFAULT_FUNCTION_KEY = 'serving_default'
loaded = tf.saved_model.load(saved_model_path)
inference_func = loaded.signatures[DEFAULT_FUNCTION_KEY]

predict_dataset = eval_dataset.map(lambda image, label: image)
for batch in predict_dataset.take(1):
  print(inference_func(batch))
  first_inference = inference_func(batch)

another_strategy = keras_dist.strategy()
with another_strategy.scope():
  loaded = tf.saved_model.load(saved_model_path)
  inference_func = loaded.signatures[DEFAULT_FUNCTION_KEY]

  dist_predict_dataset = another_strategy.experimental_distribute_dataset(
      predict_dataset)

  # Calling the function in a distributed manner
  for batch in dist_predict_dataset:
    result = another_strategy.run(inference_func, args=(batch,))
    print(result)
    break
distributed_inference = [
    t.numpy().tolist() for output in result.values()
    for t in another_strategy.experimental_local_results(output)]


def build_model(loaded):
  x = tf.keras.layers.Input(shape=(28, 28, 1), name='input_x')
  # Wrap what's loaded to a KerasLayer
  keras_layer = tf.keras.layers.TFSMLayer(
      saved_model_path, call_endpoint=DEFAULT_FUNCTION_KEY, trainable=True)(x)
  model = tf.keras.Model(x, keras_layer)
  return model


another_strategy = keras_dist.strategy()
with another_strategy.scope():
  loaded = tf.saved_model.load(saved_model_path)
  model = build_model(loaded)

  model.compile(loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                optimizer=tf.keras.optimizers.Adam(),
                metrics=[tf.metrics.SparseCategoricalAccuracy()])
  histories["tfsm_layer_model"] = model.fit(train_dataset, epochs=2)

model = get_model()

# Saving the model using Keras `Model.save`
model.export(saved_model_path)

another_strategy = keras_dist.strategy()
# Loading the model using the lower-level API
with another_strategy.scope():
  loaded = tf.saved_model.load(saved_model_path)

model = get_model()

# Saving the model to a path on localhost.
saved_model_path = 'tf_save'
save_options = tf.saved_model.SaveOptions(experimental_io_device='/job:localhost')
tf.saved_model.save(model, saved_model_path, options=save_options)

# Loading the model from a path on localhost.
another_strategy = keras_dist.strategy()
with another_strategy.scope():
  load_options = tf.saved_model.LoadOptions(experimental_io_device='/job:localhost')
  loaded = tf.saved_model.load(saved_model_path, options=load_options)


class SubclassedModel(tf.keras.Model):
  """Example model defined by subclassing `tf.keras.Model`."""

  output_name = 'output_layer'

  def __init__(self):
    super(SubclassedModel, self).__init__()
    self._dense_layer = tf.keras.layers.Dense(
        5, dtype=tf.dtypes.float32, name=self.output_name)

  def call(self, inputs):
    return self._dense_layer(inputs)


my_model = SubclassedModel()
try:
  my_model.save(saved_model_path)
except ValueError as e:
  print(f'{type(e).__name__}: ', *e.args)

tf.saved_model.save(my_model, saved_model_path)
x = tf.saved_model.load(saved_model_path)
x.signatures

BATCH_SIZE_PER_REPLICA = 4 * batch_multiplier()
BATCH_SIZE = BATCH_SIZE_PER_REPLICA * mirrored_strategy.num_replicas_in_sync

dataset_size = 32
dataset = tf.data.Dataset.from_tensors(
    (tf.range(5, dtype=tf.float32), tf.range(5, dtype=tf.float32))
    ).repeat(dataset_size).batch(BATCH_SIZE)

my_model.compile(optimizer='adam', loss='mean_squared_error')
histories["my_model"] = my_model.fit(dataset, epochs=2)

my_model.export(saved_model_path)

write_result(
    mirrored_strategy,
    weights={"trained_model": trained_model, "restored_keras_model": restored_keras_model,
             "restored_keras_model_ds": restored_keras_model_ds, "my_model": my_model},
    losses={label: history.history["loss"] for label, history in histories.items()},
    values={"first_inference": {key: value.numpy().tolist()
                                for key, value in first_inference.items()},
            "distributed_inference": distributed_inference},
)
