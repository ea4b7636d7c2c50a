"""Resuming a backup on another number of workers or replicas: exact, or refused.

A backup records the worker and replica counts it was written with and what its input
promised about the order (`keras_dist.data.order.InputOrder`). `check_resume` compares
that with the resuming run:

* same global batch, input in the global order (`distribute_dataset` over arrays or
  another index-able source; under a `keras.distribution` distribution, a
  `tf.data.Dataset` of global batches, which Keras splits between the processes):
  exact on any count. The resumed epoch reads the same
  global batches, so skipping the `step` already trained lands on the next unseen one.
* another global batch: refused. The position in the epoch counts global batches, and
  the steps per epoch, a learning-rate schedule over `iterations` and the weights of the
  uninterrupted run all depend on it.
* an input whose order depends on the worker count (TFRecord files, a `tf.data.Dataset`,
  a dataset function, `cache=True`), or one keras_dist cannot see: at an epoch boundary
  it resumes with a warning that the following epochs' order (so the result) differs
  from the uninterrupted run; mid-epoch it is refused (no way to tell which samples of
  the epoch were trained on).

Pure Python; no TensorFlow.
"""

from __future__ import annotations

from keras_dist.checkpointing.files import Backup, BackupError
from keras_dist.data.order import InputOrder

__all__ = ["check_resume"]


def _layout(workers: int, replicas: int | None) -> str:
    text = f"{workers} worker{'s' if workers != 1 else ''}"
    return f"{text} ({replicas} replica{'s' if replicas != 1 else ''})" if replicas else text


def check_resume(backup: Backup, backup_dir: str, input_now: InputOrder | None,
                 workers_now: int, replicas_now: int) -> tuple[str | None, str | None]:
    """Whether `backup` resumes exactly in this run.

    Returns:
        `(note, warning)`: a line for the chief to print when the count changed and the
        resume is exact, or a warning when it resumes at an epoch boundary but inexactly.

    Raises:
        BackupError: the global batch differs, or a mid-epoch backup on another count
            with an input whose order depends on the worker count (or is unknown).
    """
    before = InputOrder.from_json(backup.input_order)
    if before is not None and input_now is not None and before.global_batch and (
            input_now.global_batch) and before.global_batch != input_now.global_batch:
        raise BackupError(
            f"The backup in {backup_dir!r} was written with global batch "
            f"{before.global_batch} ({_layout(backup.num_workers, backup.num_replicas)}); "
            f"this run's global batch is {input_now.global_batch} "
            f"({_layout(workers_now, replicas_now)}). Resuming needs the same global "
            "batch: compute the per-replica batch from it, e.g. "
            f"`keras_dist.per_replica_batch_size({before.global_batch})`, or delete the "
            "backup directory to start from scratch."
        )
    same = backup.num_workers == workers_now and backup.num_replicas in (None, replicas_now)
    if same:
        return None, None
    change = (f"the backup in {backup_dir!r} was written by "
              f"{_layout(backup.num_workers, backup.num_replicas)}, this run has "
              f"{_layout(workers_now, replicas_now)}")
    if before is not None and before.global_order and input_now is not None and (
            input_now.global_order):
        return (f"BackupAndRestore: {change}; the input ({input_now.source}) is in one "
                "global order, so training continues exactly as it would have."), None
    why = _why_inexact(before, input_now)
    if backup.step:
        raise BackupError(
            f"Cannot resume exactly: {change}, and the backup is {backup.step} batch(es) "
            f"into epoch {backup.epoch}, but {why}, so which samples of that epoch were "
            "already trained on cannot be told on the new count. Resume on "
            f"{backup.num_workers} worker(s) with {backup.num_replicas or 'the same'} "
            "replicas, pass arrays (or another index-able source) to "
            "keras_dist.distribute_dataset, or back up at epoch ends "
            "(save_freq='epoch')."
        )
    return None, (f"BackupAndRestore: warning: {change}, and {why}: training resumes at "
                  f"the start of epoch {backup.epoch}, but the order of the following "
                  "epochs, so the result, differs from the uninterrupted run.")


def _why_inexact(before: InputOrder | None, now: InputOrder | None) -> str:
    if now is None:
        return "this run's input does not come from keras_dist.distribute_dataset"
    if before is None:
        return "the backup does not record its input's order"
    source = now if not now.global_order else before
    return (f"the order of its input ({source.source}) depends on the worker count "
            "(each worker shuffles its own shard)")
