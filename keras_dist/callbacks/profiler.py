"""`Profiler`: a TensorFlow profiler trace of steps a..b on every worker, one folder each.

Each worker traces the same global steps into `log_dir/worker_<i>/` (TensorFlow's
`plugins/profile/<run>/<host>.xplane.pb` layout below it), so `tensorboard --logdir
log_dir` lists one run per worker and the Profile tab shows each worker's collectives
and input waits side by side. Every worker keeps its own trace (the per-worker view is
the point); the folders never collide, so no worker writes over another's files.
"""

from __future__ import annotations

import os

from keras_dist import _validation
from keras_dist.callbacks.base import Callback

__all__ = ["Profiler"]


class Profiler(Callback):
    """Traces global training steps `a..b` (1-based, inclusive) with TensorFlow's profiler.

    Use it to see where a step's time goes on each worker: waiting for input, compute,
    all-reduce, waiting for a straggler (`StepTimeMonitor` says which worker; this says
    why). Skip the first steps (tracing and warm-up).

    Args:
        log_dir: The TensorBoard directory; worker `i` writes to `log_dir/worker_<i>`.
        steps: `(a, b)` with `1 <= a <= b`: trace from the start of step a to the end of
            step b, counted over the whole `fit` (epochs do not restart the count).

    Example:
        >>> model.fit(data, epochs=2, callbacks=[
        ...     keras_dist.callbacks.Profiler("logs/profile", steps=(5, 8))])
        >>> # tensorboard --logdir logs/profile   (Profile tab, runs worker_0, worker_1)
    """

    def __init__(self, log_dir: str | os.PathLike, steps: tuple[int, int] = (2, 4)):
        super().__init__()
        if not isinstance(log_dir, (str, os.PathLike)) or not os.fspath(log_dir):
            raise ValueError(_validation.message("log_dir", "a non-empty path", log_dir))
        if (not isinstance(steps, (tuple, list)) or len(steps) != 2
                or not all(_validation.is_int(s) for s in steps)
                or not 1 <= steps[0] <= steps[1]):
            raise ValueError(_validation.message("steps", "a pair (a, b) of integers with "
                                                 "1 <= a <= b", steps))
        self.log_dir = os.fspath(log_dir)
        self.steps = (int(steps[0]), int(steps[1]))
        self._step = 0
        self._tracing = False

    def on_train_begin(self, logs=None):
        self._step = 0

    def on_train_batch_begin(self, batch, logs=None):
        self._step += 1
        if self._step == self.steps[0] and not self._tracing:
            import tensorflow as tf

            from keras_dist import cluster

            directory = os.path.join(self.log_dir, f"worker_{cluster.worker_index()}")
            os.makedirs(directory, exist_ok=True)
            tf.profiler.experimental.start(directory)
            self._tracing = True

    def on_train_batch_end(self, batch, logs=None):
        if self._step >= self.steps[1]:
            self._stop()

    def on_train_end(self, logs=None):
        self._stop()

    def _stop(self):
        if self._tracing:
            import tensorflow as tf

            tf.profiler.experimental.stop()
            self._tracing = False
