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

# The public API, declared once: each public name -> the module that defines it. A name
# mapped to `keras_dist.<name>` itself is a public submodule. `__all__`, `dir()` and the
# lookup on first access (PEP 562) are all derived from this table.
_PUBLIC = {
    # cluster, devices, the strategy
    "ClusterConfig": "keras_dist.cluster",
    "ClusterConfigError": "keras_dist.cluster",
    "is_chief": "keras_dist.cluster",
    "num_workers": "keras_dist.cluster",
    "worker_index": "keras_dist.cluster",
    "virtual_devices": "keras_dist.devices",
    "physical_devices": "keras_dist.devices",
    "local_devices": "keras_dist.devices",
    "strategy": "keras_dist.strategies",
    "resolve_strategy": "keras_dist.strategies",
    # data
    "global_batch_size": "keras_dist.data.batching",
    "per_replica_batch_size": "keras_dist.data.batching",
    "scale_learning_rate": "keras_dist.data.batching",
    "distribute_dataset": "keras_dist.data",
    "steps_per_epoch": "keras_dist.data",
    # launching, outputs, synchronisation
    "notebook_launcher": "keras_dist.launching.notebook",
    "WorkerError": "keras_dist.launching.notebook",
    "chief_path": "keras_dist.checkpointing",
    "verbose": "keras_dist.checkpointing",
    "barrier": "keras_dist.barriers",
    # public submodules
    **{name: f"keras_dist.{name}" for name in (
        "aggregation", "barriers", "callbacks", "checkpointing", "cluster", "compat", "data",
        "distribution",
        "devices", "integrations", "launching", "parallel", "planning", "strategies",
        "testing")},
}

__all__ = list(_PUBLIC)

# The one import-time side effect (house rule 4), only under a multi-worker TF_CONFIG or
# Slurm job: TensorFlow's collective ops must be configured before its first op, so that
# datasets and tensors may be built before keras_dist.strategy(). A lone process is
# untouched and TensorFlow is not even imported.
from keras_dist.startup import early_init as _early_init  # noqa: E402

_early_init.configure_collectives_at_import()

# `keras.distribution` on the TensorFlow backend (Keras ships only a prototype): applied
# once Keras is imported, now or later; TensorFlow is not imported here.
from keras_dist.startup import keras_hook as _keras_hook  # noqa: E402

_keras_hook.install()

__version__ = "0.1.0"


def __getattr__(name):
    module_name = _PUBLIC.get(name)
    if module_name is None:
        raise AttributeError(f"module 'keras_dist' has no attribute {name!r}")
    module = importlib.import_module(module_name)
    value = module if module_name == f"keras_dist.{name}" else getattr(module, name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
