"""keras_dist: distributed training with TensorFlow and Keras 3 that works from one line.

Example:
    >>> import keras, keras_dist
    >>> with keras_dist.strategy().scope():
    ...     model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10)])
    ...     model.compile(optimizer="sgd", loss="mse")

Importing keras_dist does not initialise the TensorFlow runtime (and most names import
TensorFlow only when first used), so `keras_dist.virtual_devices(n)` can still run first.
"""

import importlib

from keras_dist.cluster import (
    ClusterConfig,
    ClusterConfigError,
    is_chief,
    num_workers,
    worker_index,
)
from keras_dist.devices import local_devices, physical_devices, virtual_devices

# `keras_dist.strategy` is the factory function. The old module of that name
# (keras_dist/strategy.py, now a re-export of keras_dist.strategies) is loaded first, so
# that a later `import keras_dist.strategy` finds it in sys.modules and does not rebind
# the package attribute; the function is bound after it.
importlib.import_module("keras_dist.strategy")
from keras_dist.strategies import resolve_strategy, strategy  # noqa: E402

# The one import-time side effect (house rule 4), only under a multi-worker TF_CONFIG or
# Slurm job: TensorFlow's collective ops must be configured before its first op, so that
# datasets and tensors may be built before keras_dist.strategy(). A lone process is
# untouched and TensorFlow is not even imported.
from keras_dist import _early_init  # noqa: E402

_early_init.configure_collectives_at_import()

__version__ = "0.1.0"

# Public name -> module that defines it; imported on first access (PEP 562).
_LAZY = {
    "global_batch_size": "keras_dist.batching",
    "per_replica_batch_size": "keras_dist.batching",
    "scale_learning_rate": "keras_dist.batching",
    "distribute_dataset": "keras_dist.data",
    "steps_per_epoch": "keras_dist.data",
    "notebook_launcher": "keras_dist.notebook",
    "WorkerError": "keras_dist.notebook",
    "chief_path": "keras_dist.checkpointing",
    "verbose": "keras_dist.checkpointing",
    "barrier": "keras_dist.barriers",
}
_LAZY_MODULES = ("callbacks", "aggregation", "launch", "testing", "data", "batching", "parallel")

__all__ = [
    "ClusterConfig",
    "ClusterConfigError",
    "is_chief",
    "num_workers",
    "worker_index",
    "virtual_devices",
    "physical_devices",
    "local_devices",
    "strategy",
    "resolve_strategy",
    *_LAZY,
    "callbacks",
]


def __getattr__(name):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    if name in _LAZY_MODULES:
        return importlib.import_module(f"keras_dist.{name}")
    raise AttributeError(f"module 'keras_dist' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
