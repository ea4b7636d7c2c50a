"""`Throughput`: examples per second, globally and per replica, in the epoch logs."""

from __future__ import annotations

import time

from keras_dist import _validation
from keras_dist.callbacks.base import Callback
from keras_dist.cluster import is_chief

__all__ = ["Throughput"]


class Throughput(Callback):
    """Adds training throughput to the epoch logs: examples/s globally and per replica.

    Keys: `examples_per_second`, `examples_per_second_per_replica` and, when
    `single_replica_examples_per_second` is given, `scaling_efficiency` (global
    throughput / (N x single-replica throughput)). Timing starts after each epoch's
    first batch, so tracing and input-pipeline start-up do not count (an epoch of one
    batch is timed whole). Without `global_batch_size` the examples are counted exactly
    from Keras' loss tracker (a collective read under multi-worker, on every worker).
    Every worker logs the same measure; only the chief prints (`verbose=1`).

    Args:
        global_batch_size: Examples per step over all replicas, if known.
        single_replica_examples_per_second: Baseline for `scaling_efficiency`.
        verbose: 1 prints one line per epoch on the chief.

    Example:
        >>> tp = keras_dist.callbacks.Throughput(global_batch_size=256)
        >>> history = model.fit(dataset, callbacks=[tp])         # doctest: +SKIP
        >>> history.history["examples_per_second"]               # doctest: +SKIP
    """

    def __init__(self, global_batch_size=None, single_replica_examples_per_second=None,
                 verbose=0):
        super().__init__()
        if global_batch_size is not None:
            _validation.check_int("global_batch_size", global_batch_size, 1)
        if single_replica_examples_per_second is not None:
            _validation.check_number("single_replica_examples_per_second",
                                    single_replica_examples_per_second, minimum=0)
        self.global_batch_size = global_batch_size
        self.single_replica_examples_per_second = single_replica_examples_per_second
        self.verbose = verbose

    def _examples_seen(self, steps):
        """Examples this epoch after `steps` steps (global, over all replicas)."""
        if self.global_batch_size is not None:
            return steps * self.global_batch_size
        from keras_dist import compat

        compat.check("callbacks")
        tracker = getattr(self.model, "_loss_tracker", None)
        if tracker is None:
            raise ValueError(
                "Throughput cannot count examples for this model; pass global_batch_size="
            )
        return float(tracker.count.numpy())

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch_start = time.perf_counter()
        self._window = None  # (time, steps, examples) after the first batch
        self._steps = 0

    def on_train_batch_end(self, batch, logs=None):
        self._steps = batch + 1  # `batch` is the last step run (steps_per_execution)
        if self._window is None:
            self._window = (time.perf_counter(), self._steps, self._examples_seen(self._steps))

    def on_epoch_end(self, epoch, logs=None):
        if logs is None or not self._steps:
            return
        now = time.perf_counter()
        examples = self._examples_seen(self._steps)
        start, first_steps, first_examples = self._window
        if self._steps > first_steps:
            examples, elapsed = examples - first_examples, now - start
        else:
            elapsed = now - self._epoch_start
        replicas = self.model.distribute_strategy.num_replicas_in_sync
        per_second = examples / max(elapsed, 1e-9)
        logs["examples_per_second"] = per_second
        logs["examples_per_second_per_replica"] = per_second / replicas
        if self.single_replica_examples_per_second:
            logs["scaling_efficiency"] = per_second / (
                replicas * self.single_replica_examples_per_second
            )
        if self.verbose and is_chief():
            print(f"Throughput: epoch {epoch + 1}: {per_second:.1f} examples/s "
                  f"({per_second / replicas:.1f} per replica, {replicas} replicas)")
