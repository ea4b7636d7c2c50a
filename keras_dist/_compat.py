"""Old import path of keras_dist's compatibility layer; it lives in `keras_dist.compat`."""

from keras_dist.compat import *  # noqa: F401,F403
from keras_dist.compat import FIXES, apply, applied, keras_version, probe_report, revert  # noqa: F401
