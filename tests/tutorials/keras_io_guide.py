"""keras.io guide "Multi-GPU distributed training with TensorFlow", as one plain script.

Source: keras-team/keras-io guides/distributed_training_with_tensorflow.py (code, in order).
Changed, nothing else:
- strategy lines: tf.distribute.MirroredStrategy() -> keras_dist.strategy() (twice), and
  `import keras_dist` before TensorFlow (after the KERAS_BACKEND line);
- data: keras.datasets.mnist.load_data() -> offline digits of the same shapes and dtypes
  (`_offline.mnist_load_data`), 320 train (of which 64 for validation) / 64 test;
- sizes: num_val_samples 10000 -> 64; Dense 256 -> 32 units;
- `fit`/`evaluate` results are kept, `run_training` returns its model, and a result JSON
  is written at the end;
- `os.makedirs(checkpoint_dir)` -> `os.makedirs(checkpoint_dir, exist_ok=True)`: the
  guide's `if not os.path.exists(...)` then `makedirs` races when several workers share one
  directory (a shared filesystem, as in tests/test_tutorials.py): both saw no ./ckpt, the
  second makedirs raised FileExistsError (CI, 2026-12-06).
Run: python keras_io_guide.py [result.json]   or   keras-dist launch --workers 2 keras_io_guide.py
"""

import os

os.environ["KERAS_BACKEND"] = "tensorflow"

import keras_dist  # noqa: F401  (before any TensorFlow op)

import tensorflow as tf
import keras

from _offline import mnist_load_data
from _results import write_result


def get_compiled_model():
    # Make a simple 2-layer densely-connected neural network.
    inputs = keras.Input(shape=(784,))
    x = keras.layers.Dense(32, activation="relu")(inputs)
    x = keras.layers.Dense(32, activation="relu")(x)
    outputs = keras.layers.Dense(10)(x)
    model = keras.Model(inputs, outputs)
    model.compile(
        optimizer=keras.optimizers.Adam(),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=[keras.metrics.SparseCategoricalAccuracy()],
    )
    return model


def get_dataset():
    batch_size = 32
    num_val_samples = 64

    # Return the MNIST dataset in the form of a `tf.data.Dataset`.
    (x_train, y_train), (x_test, y_test) = mnist_load_data(num_train=320, num_test=64)

    # Preprocess the data (these are Numpy arrays)
    x_train = x_train.reshape(-1, 784).astype("float32") / 255
    x_test = x_test.reshape(-1, 784).astype("float32") / 255
    y_train = y_train.astype("float32")
    y_test = y_test.astype("float32")

    # Reserve num_val_samples samples for validation
    x_val = x_train[-num_val_samples:]
    y_val = y_train[-num_val_samples:]
    x_train = x_train[:-num_val_samples]
    y_train = y_train[:-num_val_samples]
    return (
        tf.data.Dataset.from_tensor_slices((x_train, y_train)).batch(batch_size),
        tf.data.Dataset.from_tensor_slices((x_val, y_val)).batch(batch_size),
        tf.data.Dataset.from_tensor_slices((x_test, y_test)).batch(batch_size),
    )


# Create a MirroredStrategy.
strategy = keras_dist.strategy()
print("Number of devices: {}".format(strategy.num_replicas_in_sync))

# Open a strategy scope.
with strategy.scope():
    # Everything that creates variables should be under the strategy scope.
    # In general this is only model construction & `compile()`.
    model = get_compiled_model()

    # Train the model on all available devices.
    train_dataset, val_dataset, test_dataset = get_dataset()
    history = model.fit(train_dataset, epochs=2, validation_data=val_dataset)

    # Test the model on all available devices.
    evaluation = model.evaluate(test_dataset)

# Prepare a directory to store all the checkpoints.
checkpoint_dir = "./ckpt"
if not os.path.exists(checkpoint_dir):
    os.makedirs(checkpoint_dir, exist_ok=True)


def make_or_restore_model():
    # Either restore the latest model, or create a fresh one
    # if there is no checkpoint available.
    checkpoints = [checkpoint_dir + "/" + name for name in os.listdir(checkpoint_dir)]
    if checkpoints:
        latest_checkpoint = max(checkpoints, key=os.path.getctime)
        print("Restoring from", latest_checkpoint)
        return keras.models.load_model(latest_checkpoint)
    print("Creating a new model")
    return get_compiled_model()


run_histories = []


def run_training(epochs=1):
    # Create a MirroredStrategy.
    strategy = keras_dist.strategy()

    # Open a strategy scope and create/restore the model
    with strategy.scope():
        model = make_or_restore_model()

        callbacks = [
            # This callback saves a SavedModel every epoch
            # We include the current epoch in the folder name.
            keras.callbacks.ModelCheckpoint(
                filepath=checkpoint_dir + "/ckpt-{epoch}.keras",
                save_freq="epoch",
            )
        ]
        run_histories.append(model.fit(
            train_dataset,
            epochs=epochs,
            callbacks=callbacks,
            validation_data=val_dataset,
            verbose=2,
        ))
    return model


# Running the first time creates the model
first_model = run_training(epochs=1)

# Calling the same function again will resume from where we left off
resumed_model = run_training(epochs=1)

write_result(
    strategy,
    weights={"model": model, "first_model": first_model, "resumed_model": resumed_model},
    losses={"fit": history.history["loss"], "val": history.history["val_loss"],
            "run_training": [h.history["loss"][0] for h in run_histories]},
    metrics={"evaluate_loss": evaluation[0], "evaluate_accuracy": evaluation[1]},
    values={"checkpoints": sorted(os.listdir(checkpoint_dir))},
)
