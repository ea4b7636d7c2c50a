"""Keras callbacks for distributed training: aggregation, checks, warmup, throughput.

Every callback here is a `keras.callbacks.Callback` on one base
(`keras_dist._callback_base.Callback`), one module per callback. Pass the same list to
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
from keras_dist.checkpointing import BackupAndRestore, BackupError, ModelCheckpoint, TensorBoard

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
