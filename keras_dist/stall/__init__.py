"""Stuck workers: a worker that is alive but makes no progress is found, named, its stack
shown, and the job stopped so that it restarts and resumes (DESIGN.md, "Stuck workers").

* `progress.py`: this process's place in Keras's loops (step, phase), the heartbeat;
* `keras_loops.py`: Keras's `CallbackList` hooks that feed it, for every fit/evaluate/predict;
* `reporter.py`: publishes it, to the launcher's file (with stacks on `SIGUSR1`) or to
  the in-worker watchdog;
* `policy.py`: the stall rule and budgets (`--stall-timeout`, `KERAS_DIST_STALL_TIMEOUT`),
  who is behind, the message;
* `watchdog.py`: the in-worker watchdog of a job started without the launcher.

The launcher's side is `keras_dist.launching.stall_monitor`.
"""
