"""Old import path of `keras_dist.checkpointing.preemption` (kept working)."""

from keras_dist.checkpointing.preemption import (  # noqa: F401
    PREEMPTION_EXIT_CODE,
    SigtermFlag,
    gather_rows,
    is_multi_worker,
)
