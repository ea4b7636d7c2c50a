"""TensorFlow tutorial "Distributed training with Keras", as one plain script.

Source: tensorflow/docs site/en/tutorials/distribute/keras.ipynb (code cells, in order).
Changed, nothing else:
- strategy line: tf.distribute.MirroredStrategy() -> keras_dist.strategy(), and
  `import keras_dist` as the first import (before any TensorFlow op);
- data: tfds.load('mnist') -> offline digits with MNIST's shapes and dtypes
  (`_offline.tfds_mnist`: (28, 28, 1) uint8 images, int64 labels), 256 train / 128 test;
- sizes: BUFFER_SIZE 10000 -> 256; BATCH_SIZE_PER_REPLICA 64 -> 32 (times the tests' batch
  multiplier); Conv2D 32 -> 8 filters; Dense 64 -> 16 units; EPOCHS 12 -> 4;
- notebook magics dropped (%load_ext tensorboard, %tensorboard, `!ls` -> os.listdir);
- `model.fit(...)` is assigned to `history`, and a result JSON is written at the end
  (`_results.write_result`, for tests/test_tutorials.py).
Run: python keras_tutorial.py [result.json]   or   keras-dist launch --workers 2 keras_tutorial.py
"""

import keras_dist  # noqa: F401  (first: before any TensorFlow op)

import tensorflow as tf

import os

from _offline import batch_multiplier, tfds_mnist
from _results import write_result

print(tf.__version__)

datasets, info = tfds_mnist(num_train=256, num_test=128)

mnist_train, mnist_test = datasets['train'], datasets['test']

strategy = keras_dist.strategy()

print('Number of devices: {}'.format(strategy.num_replicas_in_sync))

# You can also do info.splits.total_num_examples to get the total
# number of examples in the dataset.

num_train_examples = info.splits['train'].num_examples
num_test_examples = info.splits['test'].num_examples

BUFFER_SIZE = 256

BATCH_SIZE_PER_REPLICA = 32 * batch_multiplier()
BATCH_SIZE = BATCH_SIZE_PER_REPLICA * strategy.num_replicas_in_sync


def scale(image, label):
  image = tf.cast(image, tf.float32)
  image /= 255

  return image, label


train_dataset = mnist_train.map(scale).cache().shuffle(BUFFER_SIZE).batch(BATCH_SIZE)
eval_dataset = mnist_test.map(scale).batch(BATCH_SIZE)

with strategy.scope():
  model = tf.keras.Sequential([
      tf.keras.layers.Conv2D(8, 3, activation='relu', input_shape=(28, 28, 1)),
      tf.keras.layers.MaxPooling2D(),
      tf.keras.layers.Flatten(),
      tf.keras.layers.Dense(16, activation='relu'),
      tf.keras.layers.Dense(10)
  ])

  model.compile(loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                optimizer=tf.keras.optimizers.Adam(learning_rate=0.001),
                metrics=['accuracy'])

# Define the checkpoint directory to store the checkpoints.
checkpoint_dir = './training_checkpoints'
# Define the name of the checkpoint files.
checkpoint_prefix = os.path.join(checkpoint_dir, "ckpt_{epoch:04d}.weights.h5")


# Define a function for decaying the learning rate.
# You can define any decay function you need.
def decay(epoch):
  if epoch < 3:
    return 1e-3
  elif epoch >= 3 and epoch < 7:
    return 1e-4
  else:
    return 1e-5


# Define a callback for printing the learning rate at the end of each epoch.
class PrintLR(tf.keras.callbacks.Callback):
  def on_epoch_end(self, epoch, logs=None):
    print('\nLearning rate for epoch {} is {}'.format(epoch + 1, model.optimizer.learning_rate.numpy()))


# Put all the callbacks together.
callbacks = [
    tf.keras.callbacks.TensorBoard(log_dir='./logs'),
    tf.keras.callbacks.ModelCheckpoint(filepath=checkpoint_prefix,
                                       save_weights_only=True),
    tf.keras.callbacks.LearningRateScheduler(decay),
    PrintLR()
]

EPOCHS = 4

history = model.fit(train_dataset, epochs=EPOCHS, callbacks=callbacks)

# Check the checkpoint directory.
print(sorted(os.listdir(checkpoint_dir)))

import pathlib
latest_checkpoint = sorted(pathlib.Path(checkpoint_dir).glob('*'))[-1]

model.load_weights(latest_checkpoint)

eval_loss, eval_acc = model.evaluate(eval_dataset)

print('Eval loss: {}, Eval accuracy: {}'.format(eval_loss, eval_acc))
evaluation = (eval_loss, eval_acc)

print(sorted(os.listdir('./logs')))

path = 'my_model.keras'

model.save(path)

unreplicated_model = tf.keras.models.load_model(path)

unreplicated_model.compile(
    loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    optimizer=tf.keras.optimizers.Adam(),
    metrics=['accuracy'])

eval_loss, eval_acc = unreplicated_model.evaluate(eval_dataset)

print('Eval loss: {}, Eval Accuracy: {}'.format(eval_loss, eval_acc))
unreplicated_evaluation = (eval_loss, eval_acc)

with strategy.scope():
  replicated_model = tf.keras.models.load_model(path)
  replicated_model.compile(loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                           optimizer=tf.keras.optimizers.Adam(),
                           metrics=['accuracy'])

  eval_loss, eval_acc = replicated_model.evaluate(eval_dataset)
  print ('Eval loss: {}, Eval Accuracy: {}'.format(eval_loss, eval_acc))

write_result(
    strategy,
    weights={"model": model, "unreplicated_model": unreplicated_model,
             "replicated_model": replicated_model},
    losses={"fit": history.history["loss"]},
    metrics={"eval_loss": evaluation[0], "eval_acc": evaluation[1],
             "unreplicated_eval_loss": unreplicated_evaluation[0],
             "unreplicated_eval_acc": unreplicated_evaluation[1],
             "replicated_eval_loss": eval_loss, "replicated_eval_acc": eval_acc},
    values={"learning_rates": [float(decay(epoch)) for epoch in range(EPOCHS)],
            "final_learning_rate": model.optimizer.learning_rate.numpy(),
            "latest_checkpoint": latest_checkpoint.name},
)
