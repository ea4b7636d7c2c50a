"""Old import path of `keras_dist.callbacks.step_time_monitor` (kept working)."""

from keras_dist.callbacks.step_time_monitor import (  # noqa: F401
    StepTimeMonitor,
    format_report,
    summarise,
)
