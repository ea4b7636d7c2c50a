"""Old import path of `keras_dist.launching.notebook` (kept working)."""

from keras_dist.launching.notebook import WorkerError, notebook_launcher

__all__ = ["WorkerError", "notebook_launcher"]
