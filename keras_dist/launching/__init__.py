"""Starting workers: `keras-dist launch`, `notebook_launcher`, the test helpers' core.

* `local.py`: `launch`, `launch_script`, `LaunchResult`, `free_ports` (N local workers
  with TF_CONFIG on loopback ports, fail fast, restarts, log files, the root cause last);
* `notebook.py`: `notebook_launcher` (a function instead of a script);
* `_core.py`: the run-a-function core shared by `notebook_launcher` and
  `keras_dist.testing`; `worker.py` is its other end, in each worker process;
* `output.py`: prefixes, live '\\r' progress, the noise filter, log files;
* `processes.py`: stopping a worker group with everything it started;
* `cli.py`: the `keras-dist` command line; `doctor.py`: `keras-dist doctor`.
"""

from keras_dist.launching.local import LaunchResult, free_ports, launch, launch_script
from keras_dist.launching.notebook import WorkerError, notebook_launcher

__all__ = ["LaunchResult", "WorkerError", "free_ports", "launch", "launch_script",
           "notebook_launcher"]
