"""TensorFlow tutorial "Multi-worker training with Keras", as one plain script.

Source: tensorflow/docs site/en/tutorials/distribute/multi_worker_with_keras.ipynb: the
module `mnist_setup.py` (inlined), the single-worker run, `main.py`, and the notebook's
fault-tolerance cells (model.save / load, tf.train.Checkpoint, BackupAndRestore), in order.
Changed, nothing else:
- strategy line: tf.distribute.MultiWorkerMirroredStrategy() -> keras_dist.strategy(), and
  `import keras_dist` as the first import (before any TensorFlow op);
- data: tf.keras.datasets.mnist.load_data() -> offline digits of the same shapes and
  dtypes (`_offline.mnist_load_data`, 4096 train images);
- notebook set-up dropped: `os.environ.pop('TF_CONFIG')`, pip/bash/%%writefile cells, the
  hand-written TF_CONFIG and background processes (`keras-dist launch --workers 2` sets
  TF_CONFIG); main.py's `json.loads(os.environ['TF_CONFIG'])` falls back to a one-worker
  cluster so the same script also runs as one process;
- Keras 3: the SavedModel path '/tmp/keras-model' -> 'keras-model.keras' (Keras 3's
  model.save needs the suffix); '/tmp/ckpt' -> 'ckpt', '/tmp/backup' -> 'backup' (relative:
  the tests give each run its own working directory);
- sizes: shuffle(60000) -> shuffle(4096); batch 64 -> 32 (times the tests' batch multiplier
  for the per-worker batch); Conv2D 32 -> 8 filters, Dense 128 -> 16; epochs 3 -> 2,
  steps_per_epoch 70 -> 4, 20 -> 3; BackupAndRestore save_freq 30 -> 3. As in the
  tutorial (60000 images, at most 140 batches of 64 per fit), no `fit` reads its way
  through the shuffled data: `shuffle().repeat()` draws a new order from a seed generator
  that every iterator of the dataset shares, each time the repeat starts a new pass, also
  inside an iterator's background prefetch. With a pass shorter than a fit's read-ahead
  (it was 256 images, 4 batches), a discarded iterator (the symbolic build's, a finished
  fit's) may or may not have started the next pass by the time it is dropped, so the
  order the next fit sees depended on timing, and differed between one device and 2
  workers (up to 7e-4 in the weights); SGD learning_rate 0.001 -> 0.05: with a new
  sample each epoch (no longer the same 4 batches), 8 steps at 0.001 moved the loss by
  less than the batch-to-batch noise (main's loss rose in one run); at 0.05 every fit's
  loss falls by 0.05 to 0.2;
- each `fit` is assigned to a history, and a result JSON is written at the end.
Run: python multi_worker_with_keras.py [result.json]
     keras-dist launch --workers 2 multi_worker_with_keras.py [result.{worker}.json]
"""

import keras_dist  # noqa: F401  (first: before any TensorFlow op)

import json
import os
import sys

os.environ["CUDA_VISIBLE_DEVICES"] = "-1"

if '.' not in sys.path:
  sys.path.insert(0, '.')

import tensorflow as tf

from _offline import batch_multiplier, mnist_load_data
from _results import write_result

# ---- mnist_setup.py ----
import numpy as np


def mnist_dataset(batch_size):
  (x_train, y_train), _ = mnist_load_data(num_train=4096, num_test=0)
  # The `x` arrays are in uint8 and have values in the [0, 255] range.
  # You need to convert them to float32 with values in the [0, 1] range.
  x_train = x_train / np.float32(255)
  y_train = y_train.astype(np.int64)
  train_dataset = tf.data.Dataset.from_tensor_slices(
      (x_train, y_train)).shuffle(4096).repeat().batch(batch_size)
  return train_dataset


def build_and_compile_cnn_model():
  model = tf.keras.Sequential([
      tf.keras.layers.InputLayer(input_shape=(28, 28)),
      tf.keras.layers.Reshape(target_shape=(28, 28, 1)),
      tf.keras.layers.Conv2D(8, 3, activation='relu'),
      tf.keras.layers.Flatten(),
      tf.keras.layers.Dense(16, activation='relu'),
      tf.keras.layers.Dense(10)
  ])
  model.compile(
      loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
      optimizer=tf.keras.optimizers.SGD(learning_rate=0.05),
      metrics=['accuracy'])
  return model


# ---- Model training with a single worker ----
batch_size = 32
single_worker_dataset = mnist_dataset(batch_size)
single_worker_model = build_and_compile_cnn_model()
single_worker_history = single_worker_model.fit(
    single_worker_dataset, epochs=2, steps_per_epoch=4)

# ---- main.py ----
per_worker_batch_size = 32 * batch_multiplier()
tf_config = json.loads(os.environ.get('TF_CONFIG') or json.dumps(
    {'cluster': {'worker': ['localhost:12345']}, 'task': {'type': 'worker', 'index': 0}}))
num_workers = len(tf_config['cluster']['worker'])

strategy = keras_dist.strategy()

global_batch_size = per_worker_batch_size * num_workers
multi_worker_dataset = mnist_dataset(global_batch_size)

with strategy.scope():
  # Model building/compiling need to be within `strategy.scope()`.
  multi_worker_model = build_and_compile_cnn_model()


main_history = multi_worker_model.fit(multi_worker_dataset, epochs=2, steps_per_epoch=4)

# ---- Dataset sharding ----
options = tf.data.Options()
options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF

global_batch_size = 64
multi_worker_dataset = mnist_dataset(batch_size=64)
dataset_no_auto_shard = multi_worker_dataset.with_options(options)

# ---- Fault tolerance: model saving and loading ----
model_path = 'keras-model.keras'


def _is_chief(task_type, task_id):
  # Note: there are two possible `TF_CONFIG` configurations.
  #   1) In addition to `worker` tasks, a `chief` task type is use;
  #      in this case, this function should be modified to
  #      `return task_type == 'chief'`.
  #   2) Only `worker` task type is used; in this case, worker 0 is
  #      regarded as the chief. The implementation demonstrated here
  #      is for this case.
  # For the purpose of this Colab section, the `task_type` is `None` case
  # is added because it is effectively run with only a single worker.
  return (task_type == 'worker' and task_id == 0) or task_type is None


def _get_temp_dir(dirpath, task_id):
  base_dirpath = 'workertemp_' + str(task_id)
  temp_dir = os.path.join(dirpath, base_dirpath)
  tf.io.gfile.makedirs(temp_dir)
  return temp_dir


def write_filepath(filepath, task_type, task_id):
  dirpath = os.path.dirname(filepath)
  base = os.path.basename(filepath)
  if not _is_chief(task_type, task_id):
    dirpath = _get_temp_dir(dirpath, task_id)
  return os.path.join(dirpath, base)


task_type, task_id = (strategy.cluster_resolver.task_type,
                      strategy.cluster_resolver.task_id)
write_model_path = write_filepath(model_path, task_type, task_id)

multi_worker_model.save(write_model_path)

if not _is_chief(task_type, task_id):
  tf.io.gfile.rmtree(os.path.dirname(write_model_path))

loaded_model = tf.keras.models.load_model(model_path)

# Now that the model is restored, and can continue with the training.
loaded_history = loaded_model.fit(single_worker_dataset, epochs=2, steps_per_epoch=3)

# ---- Fault tolerance: checkpoint saving and restoring ----
checkpoint_dir = 'ckpt'

checkpoint = tf.train.Checkpoint(model=multi_worker_model)
write_checkpoint_dir = write_filepath(checkpoint_dir, task_type, task_id)
checkpoint_manager = tf.train.CheckpointManager(
    checkpoint, directory=write_checkpoint_dir, max_to_keep=1)

checkpoint_manager.save()
if not _is_chief(task_type, task_id):
  tf.io.gfile.rmtree(write_checkpoint_dir)

latest_checkpoint = tf.train.latest_checkpoint(checkpoint_dir)
checkpoint.restore(latest_checkpoint)
restored_history = multi_worker_model.fit(multi_worker_dataset, epochs=2, steps_per_epoch=3)

# ---- Fault tolerance: BackupAndRestore ----
# Multi-worker training with `MultiWorkerMirroredStrategy`
# and the `BackupAndRestore` callback. The training state
# is backed up at epoch boundaries by default.

callbacks = [tf.keras.callbacks.BackupAndRestore(backup_dir='backup')]
with strategy.scope():
  multi_worker_model = build_and_compile_cnn_model()
backup_history_1 = multi_worker_model.fit(multi_worker_dataset,
                                          epochs=2,
                                          steps_per_epoch=4,
                                          callbacks=callbacks)

# The training state is backed up at epoch boundaries because `save_freq` is
# set to `epoch`.

callbacks = [tf.keras.callbacks.BackupAndRestore(backup_dir='backup')]
with strategy.scope():
  multi_worker_model = build_and_compile_cnn_model()
backup_history_2 = multi_worker_model.fit(multi_worker_dataset,
                                          epochs=2,
                                          steps_per_epoch=4,
                                          callbacks=callbacks)

# The training state is backed up at every 30 steps because `save_freq` is set
# to an integer value of `30`.

callbacks = [tf.keras.callbacks.BackupAndRestore(backup_dir='backup', save_freq=3)]
with strategy.scope():
  multi_worker_model = build_and_compile_cnn_model()
backup_history_3 = multi_worker_model.fit(multi_worker_dataset,
                                          epochs=2,
                                          steps_per_epoch=4,
                                          callbacks=callbacks)

write_result(
    strategy,
    weights={"single_worker_model": single_worker_model, "loaded_model": loaded_model,
             "multi_worker_model": multi_worker_model},
    losses={"single_worker": single_worker_history.history["loss"],
            "main": main_history.history["loss"],
            "loaded": loaded_history.history["loss"],
            "restored": restored_history.history["loss"],
            "backup_1": backup_history_1.history["loss"],
            "backup_2": backup_history_2.history["loss"],
            "backup_3": backup_history_3.history["loss"]},
    values={"task": [task_type, task_id], "num_workers": num_workers,
            "latest_checkpoint": latest_checkpoint},
)
