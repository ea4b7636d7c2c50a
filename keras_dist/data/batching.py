"""Batch arithmetic for data-parallel training: global vs per-replica batch, LR scaling.

In synchronous data parallelism each of the N replicas (all devices on all workers)
processes `per_replica` examples per step, so one optimizer step sees
`global = per_replica * N` examples. Keeping the per-replica batch fixed while adding
replicas therefore grows the effective batch, and the learning rate is scaled with it
(Goyal et al. 2017, "Accurate, Large Minibatch SGD": linear; square-root for adaptive
optimizers such as Adam, Krizhevsky 2014 / Hoffer et al. 2017).
"""

from __future__ import annotations

import math
import numbers

from keras_dist import _validation
from keras_dist.strategies import resolve_strategy

__all__ = ["global_batch_size", "per_replica_batch_size", "scale_learning_rate"]

_RULES = ("linear", "sqrt", "none")


def _check_positive_int(name: str, value) -> int:
    return _validation.check_int(name, value, 1)


def _replicas(strategy) -> int:
    return int(resolve_strategy(strategy).num_replicas_in_sync)


def global_batch_size(per_replica: int, strategy=None) -> int:
    """The global batch (examples per optimizer step over all replicas on all workers).

    Args:
        per_replica: Examples each replica processes per step.
        strategy: The strategy; default: the active one, else the one
            `keras_dist.strategy()` created, else TensorFlow's default.

    Returns:
        `per_replica * strategy.num_replicas_in_sync`.

    Raises:
        ValueError: `per_replica` is not a positive integer.

    Example:
        >>> keras_dist.global_batch_size(64)   # on 2 workers x 2 GPUs
        256
    """
    per_replica = _check_positive_int("per_replica", per_replica)
    return per_replica * _replicas(strategy)


def per_replica_batch_size(global_batch: int, strategy=None) -> int:
    """The per-replica batch for a given global batch.

    Raises:
        ValueError: `global_batch` is not a positive integer or does not divide evenly by
            the number of replicas (the message gives both numbers and the nearest fits).

    Example:
        >>> keras_dist.per_replica_batch_size(256)   # on 4 replicas
        64
    """
    global_batch = _check_positive_int("global_batch", global_batch)
    replicas = _replicas(strategy)
    if global_batch % replicas:
        lower = (global_batch // replicas) * replicas
        upper = lower + replicas
        nearest = f"{lower} or {upper}" if lower else f"{upper}"
        raise ValueError(
            f"Argument `global_batch` ({global_batch}) must be divisible by the number of "
            f"replicas in sync ({replicas}). Use a multiple of {replicas}, e.g. {nearest}."
        )
    return global_batch // replicas


def scale_learning_rate(
    base_lr: float,
    strategy=None,
    rule: str = "linear",
    base_batch: int | None = None,
    *,
    per_replica: int | None = None,
) -> float:
    """Scales a learning rate to the global batch of data-parallel training.

    Use it when moving a recipe from one device to N replicas. Without `base_batch`,
    `base_lr` is taken to be tuned for one replica's batch, so the batch grows by the
    number of replicas k. With `base_batch` (the batch `base_lr` was tuned for, e.g.
    Goyal et al.'s 256) and `per_replica`, the factor is
    k = per_replica * num_replicas_in_sync / base_batch.

    Args:
        base_lr: The learning rate that works at the reference batch, > 0.
        strategy: The strategy (see `global_batch_size`).
        rule: `"linear"` (lr * k, for SGD/momentum), `"sqrt"` (lr * sqrt(k), for
            Adam-like optimizers) or `"none"` (lr unchanged).
        base_batch: The batch `base_lr` was tuned for; needs `per_replica`.
        per_replica: The per-replica batch now trained with (only with `base_batch`).

    Returns:
        The scaled learning rate (a Python float).

    Raises:
        ValueError: `base_lr` is not a positive finite number, `rule` is unknown, or
            `base_batch`/`per_replica` are invalid or given without each other.

    Example:
        >>> keras_dist.scale_learning_rate(0.1)                    # 4 replicas
        0.4
        >>> keras_dist.scale_learning_rate(1e-3, rule="sqrt")      # 4 replicas
        0.002
    """
    if (
        isinstance(base_lr, bool)
        or not isinstance(base_lr, numbers.Real)
        or not math.isfinite(base_lr)
        or base_lr <= 0
    ):
        raise ValueError(
            f"Argument `base_lr` must be a positive finite number. Received: base_lr={base_lr!r}"
        )
    if rule not in _RULES:
        raise ValueError(f"Argument `rule` must be one of {list(_RULES)}. Received: rule={rule!r}")
    factor = _batch_growth(_replicas(strategy), base_batch, per_replica)
    if rule == "linear":
        return float(base_lr) * factor
    if rule == "sqrt":
        return float(base_lr) * math.sqrt(factor)
    return float(base_lr)


def _batch_growth(replicas: int, base_batch, per_replica) -> float:
    """How many times the global batch grew over the one `base_lr` was tuned for."""
    if base_batch is None:
        if per_replica is not None:
            raise ValueError(
                "Argument `per_replica` only has a meaning together with `base_batch` (the "
                f"batch base_lr was tuned for). Received: per_replica={per_replica!r}, "
                "base_batch=None"
            )
        return float(replicas)
    base_batch = _check_positive_int("base_batch", base_batch)
    if per_replica is None:
        raise ValueError(
            f"Argument `base_batch` ({base_batch}) needs `per_replica`, the per-replica "
            "batch you train with now, to know the new global batch."
        )
    per_replica = _check_positive_int("per_replica", per_replica)
    return per_replica * replicas / base_batch
