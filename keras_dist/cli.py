"""Old import path of `keras_dist.launching.cli` (the `keras-dist` console script)."""

from keras_dist.launching.cli import main

__all__ = ["main"]
