"""A deterministic multi-worker training run with BackupAndRestore, for fault-tolerance tests.

Usage: ft_train.py OUT_DIR [--epochs E] [--backup DIR] [--save-freq epoch|N]
                   [--crash WORKER:EPOCH:BATCH] [--pause WORKER:EPOCH:BATCH]
                   [--exit-code-on-preemption C|none] [--collective-timeout S]
                   [--stuck WORKER:EPOCH:BATCH:sleep|spin] [--slow WORKER:SECONDS]
                   [--validate]

Every worker appends `attempt <a> epoch <e>` to OUT_DIR/epochs-<i>.txt at each epoch start
and writes its pid to OUT_DIR/pid-<i>-<a>, and after `fit` its final weights to
OUT_DIR/weights-<i>.npz. Input is fixed (no shuffle), the model is seeded, the optimizer
is SGD with momentum, so a run that is interrupted and resumed must end with the weights
of an uninterrupted one.

--crash W:E:B   on the first attempt (KERAS_DIST_RESTART=0), worker W exits with code 3
                at the end of batch B of epoch E.
--pause W:E:B   on worker W at the end of batch B of epoch E, write OUT_DIR/paused-<W>
                and wait (up to 60 s) until OUT_DIR/go exists; the test signals or
                kills the worker meanwhile.
--stuck W:E:B:H at the end of batch B of epoch E, worker W gets stuck for good, alive:
                sleeping (H=sleep) or in a Python busy loop (H=spin); once per OUT_DIR
                (it writes OUT_DIR/stuck-<W> first), so a restarted run goes on.
--slow W:S      worker W sleeps S seconds in every batch (slow, but progressing).
--validate      evaluate on the training data after every epoch (`validation_data`).
"""

import argparse
import os
import sys
import time

import keras_dist

parser = argparse.ArgumentParser()
parser.add_argument("out_dir")
parser.add_argument("--epochs", type=int, default=4)
parser.add_argument("--backup", default=None)
parser.add_argument("--save-freq", default="epoch")
parser.add_argument("--crash", default=None)
parser.add_argument("--pause", default=None)
parser.add_argument("--exit-code-on-preemption", default="143")
parser.add_argument("--collective-timeout", type=float, default=None)
parser.add_argument("--stuck", default=None)
parser.add_argument("--slow", default=None)
parser.add_argument("--validate", action="store_true")
args = parser.parse_args()

# First: it applies the Keras multi-worker fixes.
strategy = keras_dist.strategy(timeout_seconds=args.collective_timeout)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from keras_dist.checkpointing import BackupAndRestore  # noqa: E402

index = keras_dist.worker_index()
attempt = int(os.environ.get("KERAS_DIST_RESTART", "0"))
with open(os.path.join(args.out_dir, f"pid-{index}-{attempt}"), "w") as file:
    file.write(str(os.getpid()))


def where(spec):
    return tuple(int(part) for part in spec.split(":")[:3]) if spec else (None, None, None)


def get_stuck(how):
    marker = os.path.join(args.out_dir, f"stuck-{index}")
    if os.path.exists(marker):
        return
    with open(marker, "w") as file:
        file.write(how)
    print(f"worker {index} is stuck ({how}) at epoch {stuck_at[1]} batch {stuck_at[2]}",
          flush=True)
    while True:
        if how == "sleep":
            time.sleep(3600)


stuck_at = where(args.stuck)
slow_worker, slow_seconds = (args.slow.split(":") if args.slow else (None, 0))


class Events(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch
        with open(os.path.join(args.out_dir, f"epochs-{index}.txt"), "a") as file:
            file.write(f"attempt {attempt} epoch {epoch}\n")

    def on_train_batch_end(self, batch, logs=None):
        if (index, self.epoch, batch) == stuck_at:
            get_stuck(args.stuck.split(":")[3])
        if slow_worker is not None and index == int(slow_worker):
            time.sleep(float(slow_seconds))
        if (index, self.epoch, batch) == where(args.crash) and attempt == 0:
            print(f"worker {index} crashing at epoch {self.epoch} batch {batch}", flush=True)
            os._exit(3)
        if (index, self.epoch, batch) == where(args.pause):
            with open(os.path.join(args.out_dir, f"paused-{index}"), "w") as file:
                file.write(f"{self.epoch} {batch}")
            deadline = time.monotonic() + 60
            go = os.path.join(args.out_dir, "go")
            while not os.path.exists(go) and time.monotonic() < deadline:
                time.sleep(0.05)


rng = np.random.RandomState(0)
features = rng.rand(128, 4).astype("float32")
targets = features @ np.array([[1.0], [-2.0], [3.0], [0.5]], dtype="float32") + 0.25
dataset = tf.data.Dataset.from_tensor_slices((features, targets)).batch(16)  # 8 steps

keras.utils.set_random_seed(7)
with strategy.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"),
                              keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.05, momentum=0.9), "mse")

callbacks = [Events()]
if args.backup:
    exit_code = None if args.exit_code_on_preemption == "none" else int(
        args.exit_code_on_preemption)
    save_freq = args.save_freq if args.save_freq == "epoch" else int(args.save_freq)
    callbacks.append(BackupAndRestore(args.backup, save_freq=save_freq,
                                      preemption_exit_code=exit_code))
model.fit(dataset, epochs=args.epochs, verbose=0, callbacks=callbacks,
          validation_data=dataset if args.validate else None)
np.savez(os.path.join(args.out_dir, f"weights-{index}.npz"), *model.get_weights())
print(f"worker {index} finished", flush=True)
sys.exit(0)
