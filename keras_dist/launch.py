"""Old import path of `keras_dist.launching.local` (kept working)."""

from keras_dist.launching.local import (
    TIMEOUT_RETURNCODE,
    LaunchResult,
    free_ports,
    launch,
    launch_script,
)

__all__ = ["LaunchResult", "free_ports", "launch", "launch_script", "TIMEOUT_RETURNCODE"]
