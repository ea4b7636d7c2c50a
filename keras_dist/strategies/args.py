"""Argument checks and keys of `keras_dist.strategy()`: what it accepts, and when two calls agree.

Split from the factory (`keras_dist.strategies.factory`, house rule 2). Every error names
the argument, what was received, what is expected and what to do.
"""

from __future__ import annotations

from typing import Sequence

from keras_dist.strategies.communication import CommunicationSettings

_KINDS = ("auto", "mirrored", "multi_worker", "one_device")


def _validate(kind, devices, implementation, bytes_per_pack, timeout_seconds,
              cross_device_ops=None):
    """Checks every argument of `keras_dist.strategy()` that needs no cluster."""
    if kind not in _KINDS:
        raise ValueError(
            f"Argument `kind` must be one of {list(_KINDS)}. Received: kind={kind!r}"
        )
    CommunicationSettings(implementation, bytes_per_pack, timeout_seconds)
    if devices is not None:
        if isinstance(devices, str) or not isinstance(devices, Sequence) or not devices:
            raise ValueError(
                "Argument `devices` must be a non-empty list of device names such as "
                f"['/gpu:0', '/gpu:1'], or None. Received: devices={devices!r}"
            )
        if not all(isinstance(d, str) and d for d in devices):
            raise ValueError(
                f"Argument `devices` must hold device name strings. Received: {devices!r}"
            )
        if len(set(devices)) != len(devices):
            raise ValueError(f"Argument `devices` repeats a device. Received: {devices!r}")
    if cross_device_ops is not None:
        _validate_cross_device_ops(kind, implementation, cross_device_ops)


def _validate_cross_device_ops(kind, implementation, cross_device_ops):
    import tensorflow as tf

    if not isinstance(cross_device_ops, tf.distribute.CrossDeviceOps):
        raise ValueError(
            "Argument `cross_device_ops` must be a tf.distribute.CrossDeviceOps instance "
            "such as tf.distribute.HierarchicalCopyAllReduce(), ReductionToOneDevice() or "
            "NcclAllReduce(), or None. Received: "
            f"cross_device_ops={cross_device_ops!r} of type {type(cross_device_ops).__name__}"
        )
    if kind in ("multi_worker", "one_device"):
        raise ValueError(
            f"Argument `cross_device_ops` only applies to MirroredStrategy, but kind={kind!r}. "
            "Use kind='auto' or 'mirrored' with it, or drop `cross_device_ops`"
            + (" (multi-worker all-reduce is chosen with `implementation`)."
               if kind == "multi_worker" else ".")
        )
    if implementation != "auto":
        raise ValueError(
            "Arguments `cross_device_ops` and `implementation` both choose the all-reduce. "
            f"Received: implementation={implementation!r} and "
            f"cross_device_ops={cross_device_ops!r}. Pass only one of them."
        )


_KEY_FIELDS = ("kind", "devices", "implementation", "bytes_per_pack", "timeout_seconds",
               "cluster", "cross_device_ops")


def _normalized_implementation(implementation):
    """`"auto"` is `"ring"` on a worker without GPUs: TensorFlow picks RING there."""
    if implementation == "auto":
        from keras_dist.devices import physical_devices

        if not physical_devices("GPU"):
            return "ring"
    return implementation


def _second_multi_worker_message(created_key, requested_key):
    differences = ", ".join(
        f"{field}={new!r} (the existing one has {old!r})"
        for field, old, new in zip(_KEY_FIELDS, created_key, requested_key)
        if old != new
    )
    return (
        "A MultiWorkerMirroredStrategy already exists in this process, and TensorFlow "
        "allows only one per process (its collective server cannot be restarted). This "
        f"call asks for a different one: {differences}. Call keras_dist.strategy() with "
        "the arguments of the first call to get it back, or start a new process."
    )
