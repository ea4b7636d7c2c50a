"""Start-up of a multi-worker process, before and while TensorFlow starts its server.

* `early_init`: under a multi-worker TF_CONFIG/Slurm job, TensorFlow's collective ops
  configured at `import keras_dist`, before its first op (house rule 4's one exception);
* `rendezvous`: meeting every peer with a deadline, naming the missing ones;
* `signal_watcher`: SIGTERM/SIGINT still end a worker blocked in a collective once the
  server runs.

Nothing here is public API; `keras_dist.strategy()` and `import keras_dist` use it.
"""
