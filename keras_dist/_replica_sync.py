"""Old import path of `keras_dist.callbacks.replica_sync_check` (kept working)."""

from keras_dist.callbacks.replica_sync_check import ReplicaDivergenceError, ReplicaSyncCheck  # noqa: F401
