"""`tests/elastic_run.train` under `keras-dist launch`, for the shrink and chaos tests.

Usage: elastic_train.py OUT_DIR BACKUP_DIR [--gone-slot S] [--sleep-ms MS] [--epochs E]

Every worker writes its pid to OUT_DIR/pid-<slot>-<attempt> when it starts; after each
trained batch the chief replaces OUT_DIR/progress-<attempt> with "TRAINED LEFT" (batches
trained in this attempt, batches of the whole run still to train) and, after `fit`,
writes the final weights to OUT_DIR/weights.npz and its worker count to OUT_DIR/workers.

--gone-slot S   the host of slot S is gone after the first attempt: on attempt 0 it
                SIGKILLs itself after 22 trained batches (the backup is at batch 20);
                on every later attempt it exits with code 1 at once, before meeting its
                peers.
"""

import argparse
import math
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

parser = argparse.ArgumentParser()
parser.add_argument("out_dir")
parser.add_argument("backup_dir")
parser.add_argument("--gone-slot", type=int, default=None)
parser.add_argument("--sleep-ms", type=int, default=0)
parser.add_argument("--epochs", type=int, default=3)
args = parser.parse_args()

slot = int(os.environ.get("KERAS_DIST_SLOT", "0"))
attempt = int(os.environ.get("KERAS_DIST_RESTART", "0"))
with open(os.path.join(args.out_dir, f"pid-{slot}-{attempt}"), "w") as file:
    file.write(str(os.getpid()))
if slot == args.gone_slot and attempt > 0:
    print(f"slot {slot}: this host is gone", flush=True)
    sys.exit(1)

import keras_dist  # noqa: E402

keras_dist.strategy()

import keras  # noqa: E402
import numpy as np  # noqa: E402

import elastic_run  # noqa: E402


TOTAL_BATCHES = math.ceil(elastic_run.NUM_EXAMPLES / elastic_run.GLOBAL_BATCH) * args.epochs


class Events(keras.callbacks.Callback):
    trained = 0

    def on_train_batch_end(self, batch, logs=None):
        if not logs:
            return  # a batch skipped while resuming
        self.trained += 1
        if keras_dist.is_chief():
            left = TOTAL_BATCHES - int(self.model.optimizer.iterations.numpy())
            path = os.path.join(args.out_dir, f"progress-{attempt}")
            with open(path + ".tmp", "w") as file:
                file.write(f"{self.trained} {left}")
            os.replace(path + ".tmp", path)
        if self.trained == 22 and slot == args.gone_slot and attempt == 0:
            os.kill(os.getpid(), signal.SIGKILL)


extra = [Events()]
result = elastic_run.train(args.backup_dir, sleep_ms=args.sleep_ms, epochs=args.epochs,
                          callbacks=extra)
if keras_dist.is_chief():
    np.savez(os.path.join(args.out_dir, "weights.npz"), *result["weights"])
    with open(os.path.join(args.out_dir, "workers"), "w") as file:
        file.write(str(keras_dist.num_workers()))
print(f"slot {slot} finished", flush=True)
