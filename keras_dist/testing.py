"""Helpers for tests that need several workers or a fresh TensorFlow runtime.

TensorFlow configures its devices and cluster once per process, so a test that wants two
workers, or four virtual CPU devices after something already touched TensorFlow, has to
run its code in new processes. These helpers do that with the same machinery as
`keras_dist.notebook_launcher` and `keras-dist launch` (`keras_dist.launching`), with a default timeout so a
deadlocked collective fails the test instead of hanging it. Collect results as return
values and assert in the test process. `WorkerPool` keeps one group of workers for many
calls (e.g. a session-scoped pytest fixture), so a suite pays the start-up once.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Mapping, Sequence

from keras_dist.launching._core import WorkerError, run_function
from keras_dist.launching.options import Options
from keras_dist.launching.pool import WorkerPool

__all__ = ["Running", "WorkerError", "WorkerPool", "run_in_subprocess", "run_on_workers",
           "start_on_workers"]


def run_on_workers(
    fn: Callable[..., Any],
    num_workers: int = 2,
    *,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    timeout: float | None = 300,
    env: Mapping[str, str | None] | None = None,
    virtual_devices: int | None = None,
    preload: bool = True,
    stall_timeout: float | None = None,
) -> list:
    """Calls `fn(*args, **kwargs)` on `num_workers` local workers and returns the results.

    Each worker is a fresh process with its own `TF_CONFIG` (a worker-only cluster on
    loopback ports), exactly as under `keras-dist launch`. Define `fn` at module level in
    the test module (it is imported by name in the workers) or as a closure/lambda (sent
    by value). Import TensorFlow inside `fn`, not at the top of the test module, to keep
    workers that do not need it fast.

    Args:
        fn: The function to run; it and its arguments must be picklable by cloudpickle.
        num_workers: Number of worker processes (>= 1).
        args: Positional arguments, the same for every worker.
        kwargs: Keyword arguments, the same for every worker.
        timeout: Seconds before all workers are stopped and `TimeoutError` is raised.
        env: Extra environment variables for the workers (`None` values unset).
        virtual_devices: Give each worker this many logical devices
            (`keras_dist.virtual_devices(k)`) before `fn` runs.
        preload: Fork the workers from a server process that has already imported
            TensorFlow and Keras (seconds of CPU less per worker; see
            `keras_dist.launching.zygote`). Each is still a new process with its own
            TensorFlow runtime, environment and session. `False` starts fresh
            interpreters, for code that must run before TensorFlow is imported.
        stall_timeout: As `keras-dist launch --stall-timeout` (`None`:
            `KERAS_DIST_STALL_TIMEOUT`, else the default; 0: off).

    Returns:
        The return values, ordered by worker index.

    Raises:
        WorkerError: A worker raised, died or was stuck (a stall); the message names
            it and includes its traceback (or its stacks).
        TimeoutError: The workers did not finish within `timeout`.

    Example:
        >>> def task_index():
        ...     import keras_dist
        ...     return keras_dist.worker_index()
        >>> run_on_workers(task_index, num_workers=2)
        [0, 1]
    """
    return run_function("run_on_workers", fn, args, kwargs, num_workers,
                        Options(env=env, timeout=timeout, preload=preload,
                                stall_timeout=stall_timeout), virtual_devices)


def run_in_subprocess(
    fn: Callable[..., Any],
    *,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    timeout: float | None = 300,
    env: Mapping[str, str | None] | None = None,
    virtual_devices: int | None = None,
    preload: bool = True,
) -> Any:
    """Calls `fn(*args, **kwargs)` in one new Python process and returns its result.

    Use it when a test needs its own TensorFlow runtime, e.g. four virtual CPU devices for
    a `MirroredStrategy` test although the test process already initialised TensorFlow.
    The process has no `TF_CONFIG` (it is removed even if set here), so it runs alone.

    Args:
        fn: The function to run; it and its arguments must be picklable by cloudpickle.
        args: Positional arguments.
        kwargs: Keyword arguments.
        timeout: Seconds before the process is stopped and `TimeoutError` is raised.
        env: Extra environment variables (`None` values unset).
        virtual_devices: Call `keras_dist.virtual_devices(k)` in the process before `fn`.
        preload: Fork the process from one that has already imported TensorFlow (see
            `run_on_workers`); `False` starts a fresh interpreter.

    Returns:
        What `fn` returned.

    Raises:
        WorkerError: `fn` raised (the message contains the traceback) or the process died.
        TimeoutError: It did not finish within `timeout`.

    Example:
        >>> def replicas():
        ...     import keras_dist
        ...     return keras_dist.strategy().num_replicas_in_sync
        >>> run_in_subprocess(replicas, virtual_devices=4)
        4
    """
    (value,) = run_function("run_in_subprocess", fn, args, kwargs, 1,
                            Options(env=env, timeout=timeout, set_tf_config=False,
                                    preload=preload),
                            virtual_devices)
    return value


class Running:
    """Workers started by `start_on_workers`; `result()` waits for them."""

    def __init__(self, call: Callable[[], Any]):
        self._value = self._error = None
        self._thread = threading.Thread(target=self._run, args=(call,), daemon=True)
        self._thread.start()

    def _run(self, call):
        try:
            self._value = call()
        except BaseException as error:  # re-raised by result(), in the caller's thread
            self._error = error

    def result(self) -> Any:
        """What `run_on_workers` would have returned (or raises what it would have)."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value


def start_on_workers(fn: Callable[..., Any], num_workers: int = 2, **kwargs) -> Running:
    """`run_on_workers` in the background: returns at once, `.result()` waits.

    For a test module that needs a worker group and another subprocess (e.g. a
    multi-device reference): start the workers first, run the other process, then take
    the workers' results, so the processes share the machine instead of taking turns.
    Arguments are those of `run_on_workers`.

    Example:
        >>> running = start_on_workers(task_index, num_workers=2)  # doctest: +SKIP
        >>> reference = run_in_subprocess(replicas, virtual_devices=2)  # doctest: +SKIP
        >>> running.result()  # doctest: +SKIP
        [0, 1]
    """
    return Running(lambda: run_on_workers(fn, num_workers, **kwargs))
