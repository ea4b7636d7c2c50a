"""Run a Python function on N local workers from a notebook (or any Python program).

`notebook_launcher(fn, num_workers=2)` is `keras-dist launch` for a function: each worker
is a fresh Python process (never a fork, so it works after the caller imported
TensorFlow) with its own `TF_CONFIG`, the function travels there with cloudpickle, the
workers' output streams into the caller's `sys.stdout` prefixed `[worker i]` (in Jupyter
the chief's progress bar updates live), and the return values come back as a list.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

from keras_dist import _validation
from keras_dist.launching._core import WorkerError, run_function
from keras_dist.launching.options import Options
from keras_dist.stall.policy import check_stall_timeout

__all__ = ["WorkerError", "notebook_launcher"]


def notebook_launcher(
    fn: Callable[..., Any],
    args: Sequence[Any] = (),
    num_workers: int = 2,
    timeout: float | None = None,
    *,
    kwargs: Mapping[str, Any] | None = None,
    env: Mapping[str, str | None] | None = None,
    virtual_devices: int | None = None,
    min_workers: int | None = None,
    max_restarts: int = 0,
    preload: bool = False,
    stall_timeout: float | None = None,
) -> list:
    """Calls `fn(*args, **kwargs)` on `num_workers` local worker processes.

    Use it to try multi-worker training from Jupyter: define the training function in a
    cell (create `keras_dist.strategy()` *inside* it) and launch it here. Functions defined
    in the notebook are sent by value; functions from modules are imported by name in the
    workers, which see the caller's `sys.path`. When one worker fails the others are
    stopped at once. TensorFlow's start-up logs are left out unless
    `KERAS_DIST_TF_LOGS=1`.

    Args:
        fn: The function; it and `args`/`kwargs` must be picklable by cloudpickle.
        args: Positional arguments, the same for every worker.
        num_workers: Number of worker processes (>= 1).
        timeout: Seconds before all workers are stopped; `None` waits forever.
        kwargs: Keyword arguments, the same for every worker.
        env: Extra environment variables for the workers (`None` values unset).
        virtual_devices: When set, each worker calls `keras_dist.virtual_devices(k)`
            before unpickling `fn`, so it has k logical devices.
        min_workers: Shrink instead of stopping, down to this many workers, as
            `keras-dist launch --min-workers` (`None`: never).
        max_restarts: Restart the group up to this many times after a failure (`fn`
            resumes from its `BackupAndRestore` backup).
        preload: Fork the workers from a process that has already imported TensorFlow
            and Keras (kept for the next call), as `keras-dist launch --preload`: a
            notebook that launches again and again starts its workers in about a second
            instead of paying a TensorFlow import each time. Settings TensorFlow reads at
            import must then come from `env` or the environment.
        stall_timeout: Seconds in which no worker made progress in a Keras loop that make
            a stall, as `keras-dist launch --stall-timeout` (`None`:
            `KERAS_DIST_STALL_TIMEOUT`, else the default; 0: off). A stall stops the
            workers and, past `max_restarts`, raises `WorkerError` naming the stuck
            worker, with its Python stacks.

    Returns:
        The return values of the last attempt's workers, ordered by worker index (fewer
        than `num_workers` after shrinking).

    Raises:
        WorkerError: A worker raised (the message names it and contains its traceback),
            died without a result (the message gives its exit code or signal), or was
            stuck (the message names it and shows its stacks).
        TimeoutError: `timeout` elapsed; every worker was stopped.
        TypeError: `fn` or its arguments cannot be pickled.
        ValueError: An argument is invalid.

    Example:
        >>> def train(epochs):
        ...     import keras_dist
        ...     strategy = keras_dist.strategy()
        ...     return keras_dist.worker_index()
        >>> keras_dist.notebook_launcher(train, args=(3,), num_workers=2)
        [0, 1]
    """
    _validation.check_int("max_restarts", max_restarts, minimum=0)
    _validation.check_bool("preload", preload)
    check_stall_timeout(stall_timeout)
    return run_function("notebook_launcher", fn, args, kwargs, num_workers,
                        Options(env=env, timeout=timeout, max_restarts=max_restarts,
                                min_workers=min_workers, preload=preload,
                                stall_timeout=stall_timeout), virtual_devices)
