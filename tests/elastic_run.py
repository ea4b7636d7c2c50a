"""One deterministic training run for the elastic tests, on any worker/replica count.

`train(...)` is called in the test process (one device), on the shared 2-worker pool, in
a subprocess with virtual devices and from `tests/workers/elastic_train.py` under
`keras-dist launch`: the same model, data, optimizer and global batch everywhere, so a
run on N workers, or one interrupted and resumed on M, must end with one device's
uninterrupted weights. Shuffling is on: the global data order makes that possible.

Model: Dense(16, tanh) -> Dense(4) on 8 features (`helpers.initial_weights`); Adam on an
exponentially decaying learning rate (so the restored `iterations` matter); 200 examples,
global batch 16: 12 full global batches and a partial one of 8 per epoch.
"""

from __future__ import annotations

import os

NUM_EXAMPLES = 200
GLOBAL_BATCH = 16
EPOCHS = 3
SEED = 3


def data_arrays():
    import numpy as np

    rng = np.random.default_rng(11)
    x = rng.normal(size=(NUM_EXAMPLES, 8)).astype("float32")
    y = np.tanh(x[:, :4] * 1.5 - x[:, 4:]).astype("float32")
    return x, y


def train(backup_dir=None, *, stop_after=None, keep_backup=False, repeat=False,
          sleep_ms=0, epochs=EPOCHS, callbacks=()):
    """Trains and returns `{"weights", "iterations", "backup_step", "worker"}`.

    Args:
        backup_dir: Use `keras_dist.callbacks.BackupAndRestore(backup_dir, save_freq=5)`
            (resuming from a backup there).
        stop_after: Stop `fit` after this many trained batches of this call (an
            interruption that leaves the backup in place).
        keep_backup: Keep the backup when `fit` ends (`delete_checkpoint=False`).
        repeat: The `repeat=True` + `steps_per_epoch` fit form.
        sleep_ms: Sleep this long after every batch (gives chaos time to strike).
        epochs: Epochs to train.
        callbacks: More callbacks, before the backup's.
    """
    import time

    import keras
    import numpy as np

    import keras_dist
    from helpers import initial_weights

    strategy = keras_dist.strategy()
    x, y = data_arrays()
    data = keras_dist.distribute_dataset(
        (x, y), keras_dist.per_replica_batch_size(GLOBAL_BATCH), seed=SEED, repeat=repeat)
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, "tanh"),
                                  keras.layers.Dense(4)])
        model.set_weights(initial_weights())
        schedule = keras.optimizers.schedules.ExponentialDecay(0.02, 10, 0.8)
        model.compile(optimizer=keras.optimizers.Adam(schedule), loss="mse")

    class Interrupt(keras.callbacks.Callback):
        trained = 0

        def on_train_batch_end(self, batch, logs=None):
            if logs:  # batches skipped while resuming come with empty logs
                self.trained += 1
            if sleep_ms:
                time.sleep(sleep_ms / 1000)
            if stop_after is not None and self.trained >= stop_after:
                self.model.stop_training = True

    callbacks = [Interrupt(), *callbacks]
    if backup_dir is not None:
        callbacks.append(keras_dist.callbacks.BackupAndRestore(
            backup_dir, save_freq=5, delete_checkpoint=not keep_backup))
    steps = {"steps_per_epoch": data.steps_per_epoch} if repeat else {}
    model.fit(data, epochs=epochs, verbose=0, callbacks=callbacks, **steps)
    backup_step = None
    if backup_dir is not None and os.path.exists(os.path.join(backup_dir, "backup.json")):
        from keras_dist.checkpointing.files import read_backup

        backup = read_backup(backup_dir)
        backup_step = (backup.epoch, backup.step)
    return {"weights": [np.asarray(w) for w in model.get_weights()],
            "iterations": int(model.optimizer.iterations.numpy()),
            "backup_step": backup_step, "worker": keras_dist.worker_index()}
