"""Keras callbacks for distributed training: aggregation, checks, warmup, throughput.

Every callback here is a `keras.callbacks.Callback` on one base
(`keras_dist.callbacks.base.Callback`), one module per callback. Pass the same list to
`fit` on every worker: some of them run a collective (all workers must take part), and
the ones that print do so from the chief only. Each extends `logs` and never replaces it,
so `History`, `ProgbarLogger` and `TensorBoard` see the new keys; put
`GradientNormLogger` and `Throughput` before `TensorBoard` in the list.
`BackupAndRestore`, `ModelCheckpoint` and `TensorBoard` live in `keras_dist.checkpointing`.
"""

from __future__ import annotations

from keras_dist.callbacks.gradient_aggregation import GradientAggregation
from keras_dist.callbacks.gradient_norm_logger import GradientNormLogger
from keras_dist.callbacks.learning_rate_warmup import LearningRateWarmup
from keras_dist.callbacks.profiler import Profiler
from keras_dist.callbacks.replica_sync_check import ReplicaDivergenceError, ReplicaSyncCheck
from keras_dist.callbacks.step_time_monitor import StepTimeMonitor
from keras_dist.callbacks.throughput import Throughput

__all__ = [
    "BackupAndRestore",
    "BackupError",
    "GradientAggregation",
    "GradientNormLogger",
    "LearningRateWarmup",
    "ModelCheckpoint",
    "Profiler",
    "ReplicaDivergenceError",
    "ReplicaSyncCheck",
    "StepTimeMonitor",
    "TensorBoard",
    "Throughput",
]

# The checkpointing callbacks are public here too, looked up on first use (PEP 562):
# keras_dist.checkpointing's callbacks are built on `keras_dist.callbacks.base`, so
# importing that package here would import it half-way through its own import.
_FROM_CHECKPOINTING = ("BackupAndRestore", "BackupError", "ModelCheckpoint", "TensorBoard")


def __getattr__(name):
    if name in _FROM_CHECKPOINTING:
        from keras_dist import checkpointing

        value = getattr(checkpointing, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'keras_dist.callbacks' has no attribute {name!r}")
