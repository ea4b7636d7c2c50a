"""Starting workers: `keras-dist launch`, `notebook_launcher`, the test helpers' core.

* `local.py`: `launch`, `launch_script`, `LaunchResult`, `free_ports` (N local workers
  with TF_CONFIG on loopback ports, fail fast, restarts, log files, the root cause last);
* `notebook.py`: `notebook_launcher` (a function instead of a script);
* `_core.py`: the run-a-function core shared by `notebook_launcher` and
  `keras_dist.testing`; `worker.py` is its other end, in each worker process;
* `output.py`: prefixes, live '\\r' progress, the noise filter, log files;
* `processes.py`: a worker's process: started with its output reader, described when
  it ends, stopped with everything it started;
* `pool.py`: `WorkerPool`, workers started once that run many functions (tests);
* `cli.py`: the `keras-dist` command line; `doctor.py`: `keras-dist doctor`.
"""


import importlib

# Public name -> module; imported on first access, so that `python -m
# keras_dist.launching.worker` does not import its own module first (runpy warns).
_LAZY = {
    "LaunchResult": "local", "free_ports": "local", "launch": "local",
    "launch_script": "local", "WorkerError": "_core", "notebook_launcher": "notebook",
}
__all__ = sorted(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(f"keras_dist.launching.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'keras_dist.launching' has no attribute {name!r}")
