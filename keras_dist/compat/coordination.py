"""TensorFlow's coordination service: barriers and a key-value store shared by all workers.

MultiWorkerMirroredStrategy starts a coordination service on the chief (keras_dist
configures it at import under a multi-worker job, `keras_dist.startup.early_init`). It offers
barriers that report which tasks did not arrive, and a blocking key-value store; there
is no public API for either, so every use of `context.context()`'s methods lives here
(registry entries `tf.context.wait_at_barrier`, `tf.context.set_config_key_value`,
`tf.context.get_config_key_value`, `tf.context.delete_config_key_value`).
"""

from __future__ import annotations

import re

_TASK_RE = re.compile(r"/job:(\w+)/replica:\d+/task:(\d+)")


def _context():
    from tensorflow.python.eager import context

    return context.context()


def available() -> bool:
    """True when this process was configured with a coordination service."""
    return _context().coordination_service is not None


def wait_at_barrier(barrier_id: str, timeout_seconds: float) -> None:
    """Blocks until every task reached `barrier_id`; TF errors propagate unchanged."""
    _context().wait_at_barrier(barrier_id, max(1, int(timeout_seconds * 1000)))


def missing_tasks(error: BaseException) -> list[tuple[str, int]]:
    """The `(job, task index)` pairs a barrier error names, in order, without repeats."""
    message = str(error)
    # TF lists the first task to arrive too; only what follows this marker is missing.
    marker = message.find("timed out task")
    if marker >= 0:
        message = message[marker:]
    found = []
    for job, index in _TASK_RE.findall(message):
        if (job, int(index)) not in found:
            found.append((job, int(index)))
    return found


def set_value(key: str, value: str) -> None:
    _context().set_config_key_value(key, value)


def get_value(key: str, timeout_seconds: float) -> str:
    """Waits until `key` is set (by any task) and returns its value."""
    return _context().get_config_key_value(key, max(1, int(timeout_seconds * 1000)))


def delete_value(key: str) -> None:
    """Removes `key` (a key cannot be set again while it exists)."""
    _context().delete_config_key_value(key)
