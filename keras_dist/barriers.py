"""`keras_dist.barrier()`: every worker waits here until all of them have arrived.

Use it for a "chief writes, then every worker reads" step of your own, or to keep workers
in step around anything that is not a collective. It goes through TensorFlow's
coordination service (not a collective op), so it needs no tensors and works outside
`strategy.run`.
"""

from __future__ import annotations

import itertools
import threading

__all__ = ["barrier", "BarrierTimeoutError"]

# About a day: `None` means "wait as long as it takes"; a dead peer still fails the
# barrier at once (the coordination service notices missed heartbeats).
_FOREVER_SECONDS = 24 * 3600.0
_counter = itertools.count()
_lock = threading.Lock()


class BarrierTimeoutError(TimeoutError):
    """Some workers did not reach a `keras_dist.barrier()` in time.

    Attributes:
        missing: `(worker index, address)` of each worker that did not arrive.
    """

    def __init__(self, message: str, missing: list[tuple[int, str]]):
        super().__init__(message)
        self.missing = missing


def barrier(name: str | None = None, timeout_seconds: float | None = None) -> None:
    """Blocks until every worker of the multi-worker job has called `barrier` as often.

    Every worker must call it the same number of times, in the same order and with the
    same `name` (calls are matched by their position and name). In one process it
    returns at once. Call it after `keras_dist.strategy()` (or, in a multi-worker job,
    after `import keras_dist` and TensorFlow's first op).

    Args:
        name: A label for this barrier, shown in errors (letters, digits, `_-.`).
        timeout_seconds: Raise `BarrierTimeoutError` when not every worker arrived
            within this many seconds. `None`: wait as long as it takes (a worker that
            dies still ends the wait with an error).

    Raises:
        ValueError: `name` or `timeout_seconds` is invalid.
        keras_dist.barriers.BarrierTimeoutError: Workers were missing at the timeout;
            the message names them (worker index and address).
        RuntimeError: The job has no coordination service (TF started before
            `import keras_dist` without a strategy).

    Example:
        >>> if keras_dist.is_chief():
        ...     write_vocabulary("/shared/run1/vocab.txt")
        >>> keras_dist.barrier("vocabulary")
        >>> vocabulary = read_vocabulary("/shared/run1/vocab.txt")
    """
    name = _check_name(name)
    timeout = _check_timeout(timeout_seconds)
    from keras_dist import _runtime

    cluster = _runtime.cluster()
    if cluster.num_workers <= 1:
        return
    from keras_dist.compat import coordination, registry

    registry.check("barrier")
    if not coordination.available():
        raise RuntimeError(
            "keras_dist.barrier() needs TensorFlow's coordination service, which this "
            "multi-worker process does not have. Call keras_dist.strategy() before "
            "keras_dist.barrier(), and `import keras_dist` before TensorFlow's first op."
        )
    with _lock:
        barrier_id = f"keras_dist/barrier/{next(_counter)}/{name}"
    from keras_dist.stall import progress as stall_progress

    try:
        # An event for the stall detector: waiting here is ahead of not having arrived.
        with stall_progress.phase("barrier", name):
            coordination.wait_at_barrier(barrier_id, timeout)
    except Exception as error:  # TF raises DeadlineExceededError (or Unavailable)
        timed_out = "timed out" in str(error).lower()
        if not timed_out and "deadline" not in type(error).__name__.lower():
            raise
        raise _timeout_error(name, timeout_seconds, error, cluster) from error


def _timeout_error(name, timeout_seconds, error, cluster) -> BarrierTimeoutError:
    from keras_dist.compat import coordination

    missing = []
    for job, index in coordination.missing_tasks(error):
        addresses = cluster.cluster.get(job, ())
        address = addresses[index] if index < len(addresses) else "?"
        rank = index + (1 if job == "worker" and cluster.cluster.get("chief") else 0)
        missing.append((rank, address))
    named = ", ".join(f"worker {rank} ({address})" for rank, address in missing) or (
        "(TensorFlow did not say which)")
    return BarrierTimeoutError(
        f"keras_dist.barrier({name!r}) timed out after {timeout_seconds} s: {named} did "
        "not arrive. Every worker must call keras_dist.barrier() the same number of times; "
        "check that worker's log for an error or a longer step, or raise "
        "`timeout_seconds`.",
        missing,
    )


def _check_name(name) -> str:
    if name is None:
        return "barrier"
    if not isinstance(name, str) or not name or not all(
        c.isalnum() or c in "_-." for c in name
    ):
        raise ValueError(
            "Argument `name` must be None or a non-empty string of letters, digits, '_', "
            f"'-' and '.'. Received: name={name!r}"
        )
    return name


def _check_timeout(timeout_seconds) -> float:
    if timeout_seconds is None:
        return _FOREVER_SECONDS
    if isinstance(timeout_seconds, bool) or not isinstance(timeout_seconds, (int, float)) \
            or not timeout_seconds > 0 or timeout_seconds != timeout_seconds:
        raise ValueError(
            "Argument `timeout_seconds` must be a positive number of seconds or None (wait "
            f"as long as it takes). Received: timeout_seconds={timeout_seconds!r}"
        )
    return float(timeout_seconds)
