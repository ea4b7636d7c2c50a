"""Old import path of `keras_dist.checkpointing.chief_outputs` (kept working)."""

from keras_dist.checkpointing.chief_outputs import (  # noqa: F401
    ModelCheckpoint,
    TensorBoard,
    chief_path,
    verbose,
)
