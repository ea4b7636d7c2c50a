"""Keras 3 + keras_dist inside Ray Train's `TensorflowTrainer`: what Ray lacks.

`keras_dist.strategy()`, `distribute_dataset` (including a Ray Data shard) and the
callbacks already work unchanged in a `train_loop_per_worker`: Ray sets `TF_CONFIG` in
each worker and keras_dist reads it. This module exists for three gaps of Ray 2.60 that
users hit with Keras 3, each measured in `tests/test_ray.py`:

* `ReportCheckpointCallback`: in place of Ray's `ray.train.tensorflow.keras.
  ReportCheckpointCallback` (a full `model.keras` from every worker, through
  `TensorflowCheckpoint.from_model`, which Ray 2.60 marks deprecated). Ray sets
  `TF_USE_LEGACY_KERAS=1` too late to matter (TensorFlow is already imported in the
  worker; `tf.keras` there is Keras 3, measured), so checkpoints need Keras 3 names. This
  callback saves the weights (`model.weights.h5`) with `chief_path()` (the others write
  to a private path) and every worker reports a checkpoint directory (Ray Train requires
  every worker to call `ray.train.report`); the others' directories are empty, so the
  Ray checkpoint holds the chief's file only. Reporting from every worker, as Ray's own
  callback does, matters under Ray Train V1 (`RAY_TRAIN_V2_ENABLED=0`): there each
  worker numbers the checkpoints it reported itself, so a chief-only checkpoint followed
  by any all-worker report (Ray's documented pattern) fails Ray's same-path assertion in
  `DataParallelTrainer._propagate_results` (measured; V2 numbers them centrally).
* `init_local`: Ray's `ray.init(_node_ip_address="127.0.0.1")` does not keep Ray on
  loopback: `resolve_ip_for_localhost` (`ray/_private/services.py`) replaces a loopback
  address with the machine's routable one, so `TF_CONFIG` names that address and
  TensorFlow's gRPC collectives talk over it. `init_local` starts a one-machine Ray
  cluster whose node address, TF_CONFIG and listening sockets are all 127.0.0.1, with
  quiet logs: what tests, notebooks and laptops want.
* `restore_weights`: loads the weights of a Ray checkpoint written by
  `ReportCheckpointCallback` (e.g. `result.checkpoint` after `trainer.fit()`).

Restarts: with `RunConfig(failure_config=FailureConfig(max_failures=...))` Ray restarts
the whole worker group after a worker dies; keras_dist's `BackupAndRestore(backup_dir)`
on a directory every worker sees then resumes from the last backed-up epoch.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import keras

from keras_dist.callbacks.base import Callback
from keras_dist.checkpointing import chief_path

__all__ = ["ReportCheckpointCallback", "init_local", "restore_weights"]

WEIGHTS_FILE = "model.weights.h5"


def init_local(num_cpus: int = 2, **init_kwargs):
    """Starts (or joins) a local Ray cluster that binds and talks on 127.0.0.1 only.

    Use it instead of `ray.init()` for one-machine runs (tests, notebooks, a laptop).
    Call it before importing `ray` yourself, or set `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`
    in the environment: Ray reads that variable once, at import.

    Args:
        num_cpus: CPUs Ray may schedule (one per training worker plus Ray Train's own
            actors' share).
        **init_kwargs: Passed to `ray.init` (they override the defaults here).

    Raises:
        RuntimeError: Ray would use a non-loopback node address (it was imported before
            the variable was set, or the environment overrides it).

    Returns:
        What `ray.init` returns.

    Example:
        >>> from keras_dist.integrations import ray as kd_ray
        >>> kd_ray.init_local(num_cpus=2)
    """
    # On Linux Ray resolves 127.0.0.1 to the routable address unless it believes it is a
    # single-machine install (the Windows/macOS default); children inherit the variable.
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
    import logging

    import ray

    if not ray.is_initialized() and ray.util.get_node_ip_address() != "127.0.0.1":
        # Ray read the variable when it was first imported; starting now would bind the
        # routable address.
        raise RuntimeError(
            "Ray was imported before RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 was set, so it "
            f"would start on {ray.util.get_node_ip_address()}, not 127.0.0.1. Set "
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 in the environment (or call init_local "
            "before importing ray)."
        )
    settings = dict(num_cpus=num_cpus, _node_ip_address="127.0.0.1",
                    include_dashboard=False, logging_level=logging.ERROR,
                    log_to_driver=False)
    settings.update(init_kwargs)
    context = ray.init(**settings)
    address = ray.util.get_node_ip_address()
    if address != "127.0.0.1":
        ray.shutdown()
        raise RuntimeError(
            f"Ray chose node address {address} instead of 127.0.0.1; refusing to run "
            "a local cluster on a routable address. Is RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER "
            "overridden in this environment?"
        )
    return context


class ReportCheckpointCallback(Callback):
    """Reports metrics (and a chief-written checkpoint) to Ray Train after each epoch.

    Use it in a `TensorflowTrainer`'s `train_loop_per_worker` with a Keras 3 model, in
    place of Ray's tf_keras-based callback of the same name.

    Args:
        checkpoint: Attach a checkpoint (the model's weights) to each report.
        metrics: Log names to report; default all of `logs`.

    Example:
        >>> model.fit(data, epochs=3, callbacks=[ReportCheckpointCallback()])
    """

    def __init__(self, checkpoint: bool = True, metrics: list[str] | None = None):
        super().__init__()
        self.checkpoint = bool(checkpoint)
        self.metrics = list(metrics) if metrics is not None else None

    def on_epoch_end(self, epoch, logs=None):
        import ray.train

        logs = dict(logs or {})
        names = self.metrics if self.metrics is not None else list(logs)
        report = {name: float(logs[name]) for name in names if name in logs}
        report["epoch"] = epoch
        if not self.checkpoint:
            ray.train.report(report)
            return
        directory = tempfile.mkdtemp(prefix="keras_dist_ray_checkpoint_")
        try:
            # Every worker saves (reading distributed variables may need collectives);
            # the others write to keras_dist's private path, so their directory stays
            # empty. Every worker still reports its directory: Ray merges them into one
            # checkpoint (the chief's file), and Train V1's per-worker checkpoint
            # numbering stays in step for any later all-worker report.
            self.model.save_weights(chief_path(os.path.join(directory, WEIGHTS_FILE)))
            ray.train.report(report, checkpoint=ray.train.Checkpoint.from_directory(directory))
        finally:
            shutil.rmtree(directory, ignore_errors=True)


def restore_weights(model: keras.Model, checkpoint) -> keras.Model:
    """Loads into `model` the weights of a checkpoint `ReportCheckpointCallback` wrote.

    Args:
        model: A built model of the same architecture.
        checkpoint: A `ray.train.Checkpoint` (e.g. `result.checkpoint`).

    Returns:
        `model`.
    """
    with checkpoint.as_directory() as directory:
        model.load_weights(os.path.join(directory, WEIGHTS_FILE))
    return model
