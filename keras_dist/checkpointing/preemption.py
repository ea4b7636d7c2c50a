"""SIGTERM as a request to save and stop, and the tiny collective that makes workers agree.

A scheduler that stops a worker (Kubernetes deleting or evicting a pod, Slurm's
`--signal`, `keras-dist launch` stopping a group) sends SIGTERM and, after a grace
period, SIGKILL. `SigtermFlag` turns SIGTERM into a flag the training loop polls between
steps. The flag is only on the worker that got the signal, but MultiWorkerMirroredStrategy
needs every worker to stop at the same step (a worker that takes one more step waits for
ever in its all-reduce), so `gather_rows` all-gathers a few integers per worker and
every worker decides from the same table.
"""

from __future__ import annotations

import os
import signal
import threading

import numpy as np

from keras_dist.stall import progress as stall_progress

# 128 + SIGTERM: what a shell reports for a process ended by SIGTERM. Schedulers read it
# as "terminated, retry" (Kubeflow's restartPolicy ExitCode retries codes >= 128).
PREEMPTION_EXIT_CODE = 128 + signal.SIGTERM

_gather_functions: dict[int, tuple[object, object]] = {}


class SigtermFlag:
    """Installs a SIGTERM handler that only records the signal; restores the old one."""

    def __init__(self) -> None:
        self.received = False
        self._previous = None
        self._installed = False

    def install(self) -> bool:
        """Installs the handler; False where that is impossible (not the main thread)."""
        if self._installed:
            return True
        if threading.current_thread() is not threading.main_thread():
            return False
        self.received = False
        self._previous = signal.signal(signal.SIGTERM, self._handle)
        self._installed = True
        return True

    def ignore_from_now(self) -> None:
        """Ignores SIGTERM for the rest of the process (uninstall() still restores).

        Python resets its own handlers to the default action while the interpreter
        shuts down, but leaves SIG_IGN alone; so a SIGTERM that arrives during the exit
        (a launcher stopping the rest of the group) cannot turn a clean exit into a kill.
        """
        if self._installed:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)

    def uninstall(self) -> None:
        if self._installed:
            signal.signal(signal.SIGTERM, self._previous or signal.SIG_DFL)
            self._installed = False

    def _handle(self, signum, frame) -> None:
        if not self.received:
            # os.write: safe in a signal handler, and not held back by stdout buffering.
            os.write(2, b"keras_dist: SIGTERM received; will save a backup and stop at "
                        b"the end of the current step\n")
        self.received = True


def is_multi_worker(strategy) -> bool:
    """True for a MultiWorkerMirroredStrategy that spans more than one worker."""
    from keras_dist import _runtime

    return _runtime.workers_of(strategy) > 1


def gather_rows(strategy, row) -> np.ndarray:
    """All-gathers one int64 row from every worker: an array `(num_workers, len(row))`.

    Every worker must call it, the same number of times and with rows of the same
    length (it is a collective). Row `i` is worker `i`'s.
    """
    import tensorflow as tf

    key = id(strategy)
    if key not in _gather_functions or _gather_functions[key][0] is not strategy:
        _gather_functions[key] = (strategy, _make_gather(strategy))
    # An event for the stall detector: a worker waiting here is ahead of one that
    # never arrived (keras_dist.stall.policy names the one behind).
    with stall_progress.phase("collective", "keras_dist's all-gather of worker states"):
        gathered = _gather_functions[key][1](tf.constant(list(row), dtype=tf.int64)).numpy()
    # One row per replica; replicas of one worker are contiguous (chief first).
    per_worker = max(1, len(strategy.extended.worker_devices))
    return gathered[::per_worker]


def _make_gather(strategy):
    import tensorflow as tf

    def replica_fn(row):
        context = tf.distribute.get_replica_context()
        return context.all_gather(tf.expand_dims(row, 0), axis=0)

    @tf.function
    def gather(row):
        gathered = strategy.run(replica_fn, args=(row,))
        return strategy.experimental_local_results(gathered)[0]

    return gather
