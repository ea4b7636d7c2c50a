"""The cluster this process trains in: `ClusterConfig` from TF_CONFIG or Slurm.

* `config`: `ClusterConfig.from_env()`, the only place keras_dist reads `TF_CONFIG` (or,
  when it is absent, Slurm's variables, through `slurm`), validated field by field.
* `is_chief()`, `worker_index()`, `num_workers()`: this process's place in the cluster,
  answered by `keras_dist._runtime` (the cluster of the strategy this process created,
  else the environment).
"""

from keras_dist.cluster.config import ClusterConfig, ClusterConfigError, make_tf_config

__all__ = [
    "ClusterConfig",
    "ClusterConfigError",
    "is_chief",
    "worker_index",
    "num_workers",
    "make_tf_config",
]

_RUNTIME_NAMES = ("is_chief", "worker_index", "num_workers")


def __getattr__(name):
    # Answered by keras_dist._runtime, which depends on this package's `config`: a lazy
    # lookup keeps the import graph free of cycles.
    if name in _RUNTIME_NAMES:
        from keras_dist import _runtime

        return getattr(_runtime, name)
    raise AttributeError(f"module 'keras_dist.cluster' has no attribute {name!r}")
