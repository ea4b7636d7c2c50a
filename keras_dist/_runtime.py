"""This process's distributed state: the single source every module asks.

What `keras_dist.strategy()` created (the strategy, its kind and the cluster it trains
on), and from that this process's rank and the world size. Module state on purpose:
TensorFlow allows one MultiWorkerMirroredStrategy per process (its collective server
cannot be restarted), so there is exactly one truth per process. `reset()` forgets it,
for tests.

Import graph: this module depends only on `keras_dist.cluster.config`; the strategy
factory writes here, and data, batching, callbacks and checkpointing read here, so
nothing imports the factory to learn the cluster.
"""

from __future__ import annotations

import dataclasses
import threading

from keras_dist.cluster.config import ClusterConfig

__all__ = [
    "Created", "remember", "find", "latest", "created", "reset",
    "cluster", "is_chief", "worker_index", "num_workers", "workers_of",
]


@dataclasses.dataclass(frozen=True)
class Created:
    """One strategy `keras_dist.strategy()` built, with what it was built from."""

    key: tuple
    strategy: object
    kind: str
    cluster: ClusterConfig


_lock = threading.RLock()
# Newest last: `strategy=None` means the most recently requested one.
_created: list[Created] = []


def remember(entry: Created) -> None:
    with _lock:
        if entry in _created:
            _created.remove(entry)
        _created.append(entry)


def find(key: tuple) -> Created | None:
    """The strategy built for `key`, made the most recent one; None if none was."""
    with _lock:
        for entry in _created:
            if entry.key == key:
                remember(entry)
                return entry
    return None


def latest() -> Created | None:
    with _lock:
        return _created[-1] if _created else None


def created() -> tuple[Created, ...]:
    with _lock:
        return tuple(_created)


def reset() -> None:
    """Forgets every created strategy (tests; TensorFlow's own state is not touched)."""
    with _lock:
        _created.clear()


def cluster() -> ClusterConfig:
    """The cluster this process trains in.

    The cluster of the strategy created here, if any: it fixed the cluster, and a later
    change to `os.environ` must not make helpers disagree with it. Else the environment.
    """
    entry = latest()
    return entry.cluster if entry is not None else ClusterConfig.from_env()


def is_chief() -> bool:
    """True on the process that should write files and print (chief, else worker 0)."""
    return cluster().is_chief


def worker_index() -> int:
    """This process's rank among the training processes (0 on the chief)."""
    return cluster().worker_index


def num_workers() -> int:
    """Number of training processes in the cluster (1 when running alone)."""
    return cluster().num_workers


def workers_of(strategy) -> int:
    """How many worker processes `strategy` trains on (1 for one-process strategies).

    A strategy keras_dist built answers from its cluster; any other
    MultiWorkerMirroredStrategy from its public `cluster_resolver`.
    """
    with _lock:
        for entry in _created:
            if entry.strategy is strategy:
                return entry.cluster.num_workers
    import tensorflow as tf

    if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        return 1
    resolver = strategy.cluster_resolver
    spec = resolver.cluster_spec().as_dict() if resolver is not None else {}
    return max(1, sum(len(spec.get(job, ())) for job in ("chief", "worker")))
