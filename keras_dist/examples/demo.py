"""`keras-dist demo`: the seed example, trained on N local workers with keras_dist.

The seed is the classic tf.distribute MNIST MLP (784 -> 100 -> 10). Here the data is
scikit-learn's `load_digits` (1,797 8x8 images, shipped inside scikit-learn: no
download), so the model is 64 -> 100 -> 10. The parent process starts the workers with
`keras_dist.launching.launch` (loopback ports, TF_CONFIG each); each worker runs `train()`.

    keras-dist demo                 # 2 workers
    keras-dist demo --workers 3 --epochs 10
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Sequence

_WORKER_FLAG = "--run-as-worker"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="keras-dist demo",
        description="Train an MLP on scikit-learn's digits on N local workers.",
    )
    parser.add_argument("--workers", type=int, default=2,
                        help="number of local worker processes (default 2)")
    parser.add_argument("--epochs", type=int, default=8, help="epochs (default 8)")
    parser.add_argument("--per-replica-batch", type=int, default=32,
                        help="examples per replica per step (default 32)")
    parser.add_argument("--learning-rate", type=float, default=0.05,
                        help="SGD learning rate for one replica, scaled linearly (default 0.05)")
    parser.add_argument("--timeout", type=float, default=600,
                        help="stop the workers after this many seconds (default 600)")
    parser.add_argument("--verbose", action="store_true", default=None,
                        help="keep TensorFlow's start-up logs (also KERAS_DIST_TF_LOGS=1)")
    parser.add_argument(_WORKER_FLAG, action="store_true", help=argparse.SUPPRESS)
    return parser


def load_digits_split(test_fraction: float = 0.2, seed: int = 0):
    """scikit-learn's digits, scaled to [0, 1], split deterministically."""
    import numpy as np

    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise SystemExit(
            "keras-dist demo needs scikit-learn for its embedded dataset: "
            'pip install "keras-dist[demo]" (or pip install scikit-learn).'
        ) from None
    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    y = digits.target.astype("int64")
    order = np.random.default_rng(seed).permutation(len(x))
    split = int(len(x) * (1 - test_fraction))
    return (x[order[:split]], y[order[:split]]), (x[order[split:]], y[order[split:]])


def train(epochs: int, per_replica_batch: int, learning_rate: float) -> dict:
    """One worker's part of the demo; returns the final metrics."""
    import keras

    import keras_dist

    start = time.perf_counter()
    strategy = keras_dist.strategy()
    chief = keras_dist.is_chief()
    (x_train, y_train), (x_test, y_test) = load_digits_split()
    train_data = keras_dist.distribute_dataset(
        (x_train, y_train), per_replica_batch_size=per_replica_batch, repeat=True
    )
    test_data = keras_dist.distribute_dataset(
        (x_test, y_test), per_replica_batch_size=per_replica_batch, shuffle=False
    )
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((64,)),
            keras.layers.Dense(100, activation="relu"),
            keras.layers.Dense(10),
        ])
        model.compile(
            optimizer=keras.optimizers.SGD(
                keras_dist.scale_learning_rate(learning_rate), momentum=0.9
            ),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )

    def report(epoch, logs):
        if chief:
            print(f"epoch {epoch + 1}/{epochs}: loss={logs['loss']:.4f} "
                  f"accuracy={logs['accuracy']:.4f}", flush=True)

    model.fit(
        train_data,
        epochs=epochs,
        steps_per_epoch=keras_dist.steps_per_epoch(train_data),
        verbose=0,
        callbacks=[
            keras_dist.callbacks.GradientAggregation(clipnorm=5.0),
            keras.callbacks.LambdaCallback(on_epoch_end=report),
        ],
    )
    results = model.evaluate(test_data, verbose=0, return_dict=True)
    wall = time.perf_counter() - start
    if chief:
        print(
            f"demo: test accuracy {results['accuracy']:.4f}, loss {results['loss']:.4f} | "
            f"{keras_dist.num_workers()} worker(s), {strategy.num_replicas_in_sync} "
            f"replica(s) | {wall:.1f} s",
            flush=True,
        )
    return results


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `keras-dist demo`; returns the exit code."""
    parser = _parser()
    args = parser.parse_args(argv)
    for name in ("workers", "epochs", "per_replica_batch"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not args.learning_rate > 0:
        parser.error(f"--learning-rate must be > 0, got {args.learning_rate}")
    if args.run_as_worker:
        train(args.epochs, args.per_replica_batch, args.learning_rate)
        return 0
    from keras_dist.launching.local import launch

    command = [
        sys.executable, "-m", "keras_dist.examples.demo", _WORKER_FLAG,
        "--epochs", str(args.epochs),
        "--per-replica-batch", str(args.per_replica_batch),
        "--learning-rate", str(args.learning_rate),
    ]
    print(f"keras-dist demo: training on {args.workers} local worker(s)", flush=True)
    result = launch(command, num_workers=args.workers, timeout=args.timeout,
                    verbose=args.verbose)
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
