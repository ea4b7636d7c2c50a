"""Fault tolerance: multi-worker-safe backup/restore, SIGTERM handling, chief-only outputs.

`BackupAndRestore` lets a training run that was killed, crashed or preempted continue
where it stopped when the script is started again (by `keras-dist launch
--max-restarts`, Kubernetes, Slurm, or by hand). `chief_path`, `verbose`,
`ModelCheckpoint` and `TensorBoard` make the chief the only worker that keeps files and
prints progress. The callbacks are exported as `keras_dist.callbacks.*`.

What a dead or stuck peer does (measured on CPU, TF 2.21, 2 workers): TensorFlow's
coordination service notices a killed worker within seconds (a non-chief missed
heartbeats: ~6 s; the chief's socket closed: <1 s) and every surviving worker's
collective fails with `tf.errors.UnavailableError`, so the process exits non-zero and
the scheduler (or `keras-dist launch`) restarts the group. A peer that is alive but
stuck (never reaching its next collective) is only caught by
`keras_dist.strategy(timeout_seconds=...)`; see its docstring for the cost.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

import numpy as np

from keras_dist import _backup_files, _preemption
from keras_dist._callback_base import Callback
from keras_dist._backup_files import BackupError
from keras_dist._chief_outputs import ModelCheckpoint, TensorBoard, chief_path, verbose
from keras_dist._preemption import PREEMPTION_EXIT_CODE
from keras_dist.cluster import is_chief, num_workers, worker_index

__all__ = [
    "BackupAndRestore",
    "BackupError",
    "ModelCheckpoint",
    "TensorBoard",
    "PREEMPTION_EXIT_CODE",
    "chief_path",
    "verbose",
]


class BackupAndRestore(Callback):
    """Backs up the training state and resumes from it when training starts again.

    Use it in any run that may be interrupted. At the end of every epoch (or every
    `save_freq` batches) it saves the model's weights and the optimizer's variables
    (including `iterations`, so learning-rate schedules continue) together with the
    epoch and the batch reached. When `fit` starts and a backup exists, every worker
    loads it, training continues at that epoch, and the batches of that epoch that were
    already trained on are skipped (read from the input and dropped, not trained on).

    Multi-worker: every worker takes part in each save (so the collectives that reading
    distributed variables may need line up); the chief writes to `backup_dir`, the
    others to private temporary directories that are deleted at once. On restore every
    worker reads the chief's backup, so **`backup_dir` must be on a filesystem all
    workers see** (NFS, a shared volume, GCS FUSE...). The workers check at start that
    they all found the same backup and raise `RuntimeError` naming the ones that did
    not, instead of silently training from different states.

    Saves are atomic: the weights go to a temporary file in `backup_dir` that is
    renamed into place, then `backup.json` (epoch, batch, checksum, file list) is
    written the same way, last. A crash during a save leaves the previous backup
    loadable. The checksum is verified when loading.

    SIGTERM (`handle_sigterm=True`): a scheduler's SIGTERM no longer kills the worker
    mid-step. It sets a flag; at the next batch end the workers all-gather their flags
    (one tiny collective per check), so all of them stop after the same step, save a
    backup there, wait for each other, and exit with `preemption_exit_code` (143 =
    128 + SIGTERM, which schedulers read as "terminated, retry"); from then on it
    ignores further SIGTERMs while it exits (SIGKILL still ends it). With
    `preemption_exit_code=None`, `fit` returns instead and `callback.preempted` is True.
    On Kubernetes the kubelet sends SIGTERM to PID 1 of each container when a pod is
    deleted, evicted or preempted, then SIGKILL after `terminationGracePeriodSeconds`
    (30 s by default): run the training script as PID 1 (exec form, or an init such as
    tini that forwards signals) and give the pod a grace period longer than one step
    plus one save. Under Kubeflow's TFJob use `restartPolicy: ExitCode` (codes >= 128
    are retried) or `OnFailure`. `keras-dist launch` stops the other workers of a
    failed group with SIGTERM too, which they then honour the same way.

    What is restored: model weights, optimizer variables (incl. `iterations`), epoch,
    batch within the epoch. Not restored: the position of a stream that is not read
    from its start each epoch (with `steps_per_epoch` over a repeated dataset the
    resumed run restarts the stream), the order of a shuffle that differs per epoch
    (the resumed epoch sees a different order than the lost one would have), Python or
    NumPy random state, metric values of the interrupted epoch (its metrics cover only
    the batches trained after resuming), other callbacks' state (e.g. EarlyStopping's
    best value). Skipped batches reach other callbacks' `on_train_batch_end` with empty
    logs. Use deterministic input (or accept a different order) for bit-for-bit
    resumption.

    Args:
        backup_dir: Directory for the backup, shared by all workers. Use a directory
            of its own per training run; it is created if missing.
        save_freq: `"epoch"` (at the end of each epoch) or an integer `>= 1`: every that
            many batches (counted across epochs).
        delete_checkpoint: Delete the backup when training finishes (not when it was
            preempted: the backup is then what the restart resumes from).
        handle_sigterm: Install the SIGTERM handler during `fit` (main thread only).
        preemption_exit_code: Exit code after a SIGTERM-triggered save (0..255), or
            `None` to return from `fit` instead of exiting.
        preemption_check_freq: Check for SIGTERM every this many batches (and at every
            epoch end). Each multi-worker check is one small all-gather (measured
            ~6 ms on 2 busy CPU cores); raise it when steps are only milliseconds long,
            keeping `preemption_check_freq` steps plus one save within the grace period.

    Raises:
        TypeError: `backup_dir` is not a path.
        ValueError: An argument is invalid (the message says which and why).

    Example:
        >>> backup = keras_dist.callbacks.BackupAndRestore("/shared/run1/backup")
        >>> model.fit(dataset, epochs=10, callbacks=[backup],
        ...           verbose=keras_dist.verbose())
    """

    def __init__(
        self,
        backup_dir: str | os.PathLike,
        save_freq: str | int = "epoch",
        delete_checkpoint: bool = True,
        *,
        handle_sigterm: bool = True,
        preemption_exit_code: int | None = PREEMPTION_EXIT_CODE,
        preemption_check_freq: int = 1,
    ):
        super().__init__()
        self.backup_dir = _check_backup_dir(backup_dir)
        if save_freq != "epoch" and (
            isinstance(save_freq, bool) or not isinstance(save_freq, int) or save_freq < 1
        ):
            raise ValueError(
                "Argument `save_freq` must be 'epoch' or an integer >= 1 (a number of "
                f"batches). Received: save_freq={save_freq!r}"
            )
        for name, value in (("delete_checkpoint", delete_checkpoint),
                            ("handle_sigterm", handle_sigterm)):
            if not isinstance(value, bool):
                raise ValueError(
                    f"Argument `{name}` must be True or False. Received: {name}={value!r}"
                )
        if preemption_exit_code is not None and (
            isinstance(preemption_exit_code, bool)
            or not isinstance(preemption_exit_code, int)
            or not 0 <= preemption_exit_code <= 255
        ):
            raise ValueError(
                "Argument `preemption_exit_code` must be an integer in 0..255 or None "
                f"(return from fit). Received: preemption_exit_code={preemption_exit_code!r}"
            )
        if isinstance(preemption_check_freq, bool) or not isinstance(
            preemption_check_freq, int
        ) or preemption_check_freq < 1:
            raise ValueError(
                "Argument `preemption_check_freq` must be an integer >= 1 (batches between "
                f"SIGTERM checks). Received: preemption_check_freq={preemption_check_freq!r}"
            )
        self.save_freq = save_freq
        self.preemption_check_freq = preemption_check_freq
        self.delete_checkpoint = delete_checkpoint
        self.handle_sigterm = handle_sigterm
        self.preemption_exit_code = preemption_exit_code
        self.preempted = False
        self._sigterm = _preemption.SigtermFlag()
        self._reset_run_state()

    def _reset_run_state(self):
        self._multi_worker = False
        self._epoch = 0
        self._resume_epoch, self._resume_step = 0, 0
        self._steps_done = 0  # batches of the current epoch trained (or skipped) so far
        self._since_save = 0
        self._batches_trained = 0
        self._set_initial_epoch = False
        self._skipper = None
        self._signalled = [worker_index()]

    # -- hooks ----------------------------------------------------------------------
    def on_train_begin(self, logs=None):
        from keras_dist import compat

        compat.check("checkpointing")
        self._reset_run_state()
        self.preempted = False
        strategy = self.model.distribute_strategy
        self._multi_worker = _preemption.is_multi_worker(strategy)
        backup = _backup_files.read_backup(self.backup_dir)
        found = (1, backup.epoch, backup.step, backup.seq) if backup else (0, 0, 0, 0)
        if self._multi_worker:
            _check_same_backup(_preemption.gather_rows(strategy, found), self.backup_dir)
        if backup is not None:
            self._restore(backup)
        if self.handle_sigterm:
            self._sigterm.install()

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        resuming = epoch == self._resume_epoch and self._resume_step > 0
        self._steps_done = self._resume_step if resuming else 0
        if self._skipper is not None and not resuming:
            self._skipper.remaining = 0

    def on_train_batch_end(self, batch, logs=None):
        steps_done = batch + 1
        if steps_done <= self._steps_done:
            return  # a batch skipped while resuming
        trained, self._steps_done = steps_done - self._steps_done, steps_done
        self._batches_trained += 1
        # Every worker counts the same batches, so all of them check at the same ones.
        if self._batches_trained % self.preemption_check_freq == 0 and self._stop_requested():
            self._stop_for_preemption(self._epoch, steps_done)
            return
        if self.save_freq != "epoch":
            self._since_save += trained
            if self._since_save >= self.save_freq:
                self._since_save = 0
                self._save(self._epoch, steps_done)

    def on_epoch_end(self, epoch, logs=None):
        if self.preempted:
            return  # stopped mid-epoch: the backup already says where
        if self.save_freq == "epoch":
            self._save(epoch + 1, 0)
        if self._stop_requested():
            self._stop_for_preemption(epoch + 1, 0, saved=self.save_freq == "epoch")

    def on_train_end(self, logs=None):
        self._sigterm.uninstall()
        if self._skipper is not None:
            self._skipper.remove(self.model)
        if self._set_initial_epoch:
            # Keras reads `_initial_epoch` in every later `fit`; leave no stale value.
            self.model._initial_epoch = None
        if self.delete_checkpoint and not self.preempted and is_chief():
            _backup_files.delete_backup(self.backup_dir)

    # -- helpers --------------------------------------------------------------------
    def _restore(self, backup):
        optimizer = self.model.optimizer
        if optimizer is not None and not optimizer.built:
            with self.model.distribute_strategy.scope():
                optimizer.build(self.model.trainable_variables)
        try:
            self.model.load_weights(backup.weights_path)
        except (ValueError, KeyError, OSError) as error:
            raise BackupError(
                f"The backup {backup.weights_path!r} does not fit this model or optimizer "
                f"({error}). A backup directory belongs to one training run: delete it, "
                "or use another `backup_dir`, to start from scratch."
            ) from error
        epoch, step = backup.epoch, backup.step
        steps = self.params.get("steps") if self.params else None
        if steps and step >= steps:
            epoch, step = epoch + 1, 0
        self.model._initial_epoch = epoch
        self._set_initial_epoch = True
        self._resume_epoch, self._resume_step = epoch, step
        if step:
            self._skipper = _StepSkipper.install(self.model, step)
        if is_chief():
            print(f"BackupAndRestore: resuming at epoch {epoch} (0-based), {step} batch(es) "
                  f"into it, from {backup.weights_path}", flush=True)
        if backup.num_workers != num_workers() and step:
            print(f"BackupAndRestore: warning: the backup was made with "
                  f"{backup.num_workers} worker(s), this run has {num_workers()}; the "
                  f"{step} skipped batches were counted with the old global batch size.",
                  file=sys.stderr, flush=True)

    def _stop_requested(self) -> bool:
        if not self.handle_sigterm:
            return False
        if not self._multi_worker:
            return self._sigterm.received
        rows = _preemption.gather_rows(
            self.model.distribute_strategy, (int(self._sigterm.received), 0, 0, 0)
        )
        self._signalled = [i for i, row in enumerate(rows) if row[0]]
        return bool(self._signalled)

    def _stop_for_preemption(self, epoch, step, saved=False):
        steps = self.params.get("steps") if self.params else None
        if steps and step >= steps:
            epoch, step = epoch + 1, 0
        if not saved:
            self._save(epoch, step)
        if self._multi_worker:
            # Barrier: nobody exits (and gets its peers killed) before the chief's backup
            # is complete on disk.
            _preemption.gather_rows(self.model.distribute_strategy, (0, 0, 0, 0))
        self.preempted = True
        self.model.stop_training = True
        print(f"BackupAndRestore: worker {worker_index()}: SIGTERM on worker(s) "
              f"{self._signalled}; backup saved at epoch {epoch} (0-based), {step} batch(es) "
              "into it; stopping",
              flush=True)
        if self.preemption_exit_code is not None:
            if self._skipper is not None:
                self._skipper.remove(self.model)
            # A second SIGTERM (the launcher stopping the rest of the group, the
            # scheduler repeating itself) must not turn this clean exit into a kill;
            # SIGKILL after the grace period still ends a shutdown that hangs.
            self._sigterm.ignore_from_now()
            sys.stdout.flush()
            raise SystemExit(self.preemption_exit_code)

    def _save(self, epoch, step):
        if is_chief():
            _backup_files.write_backup(
                self.backup_dir, self._save_weights, epoch, step, num_workers()
            )
        else:
            # A fresh directory per save, removed at once: even a crash of this worker
            # can leave at most the one save it was in the middle of.
            directory = tempfile.mkdtemp(prefix=f"keras_dist-worker{worker_index()}-backup-")
            try:
                self._save_weights(os.path.join(directory, "backup.weights.h5"))
            finally:
                shutil.rmtree(directory, ignore_errors=True)

    def _save_weights(self, path):
        self.model.save_weights(path, overwrite=True)


class _StepSkipper:
    """Wraps `model.train_function` to read and drop the first `steps` batches.

    The Keras fit loop has no way to start an epoch part-way, but it calls
    `model.train_function(iterator)` once per `steps_per_execution` batches and passes
    the iterator; taking the batches from it without training advances the input to
    where the interrupted run stopped.
    """

    def __init__(self, function, steps, steps_per_execution):
        self.function = function
        self.remaining = steps
        self.steps_per_execution = max(1, int(steps_per_execution or 1))

    @classmethod
    def install(cls, model, steps):
        function = model.train_function
        while isinstance(function, _StepSkipper):  # left over from an aborted fit
            function = function.function
        skipper = cls(function, steps, getattr(model, "steps_per_execution", 1))
        model.train_function = skipper
        return skipper

    def remove(self, model):
        if model.train_function is self:
            model.train_function = self.function
        self.remaining = 0

    def __call__(self, iterator):
        if self.remaining <= 0:
            return self.function(iterator)
        count = min(self.remaining, self.steps_per_execution)
        for _ in range(count):
            if hasattr(iterator, "get_next"):
                iterator.get_next()
            else:
                next(iterator)
        self.remaining -= count
        return {}


def _check_backup_dir(backup_dir) -> str:
    if isinstance(backup_dir, os.PathLike):
        backup_dir = os.fspath(backup_dir)
    if not isinstance(backup_dir, str):
        raise TypeError(
            "Argument `backup_dir` must be a directory path (str or os.PathLike). "
            f"Received: backup_dir={backup_dir!r} of type {type(backup_dir).__name__}"
        )
    if not backup_dir:
        raise ValueError("Argument `backup_dir` must be a non-empty directory path. "
                         "Received: backup_dir=''")
    if os.path.exists(backup_dir) and not os.path.isdir(backup_dir):
        raise ValueError(
            f"Argument `backup_dir` must be a directory, but {backup_dir!r} is a file. "
            "Give BackupAndRestore a directory of its own."
        )
    return backup_dir


def _check_same_backup(rows: np.ndarray, backup_dir: str) -> None:
    chief = tuple(rows[0])
    differ = [i for i, row in enumerate(rows) if tuple(row) != chief]
    if not differ:
        return

    def describe(row):
        return (f"backup at epoch {row[1]} batch {row[2]} (#{row[3]})" if row[0]
                else "no backup")

    details = "; ".join(f"worker {i}: {describe(row)}" for i, row in enumerate(rows))
    raise RuntimeError(
        f"BackupAndRestore: the workers do not see the same backup in {backup_dir!r} "
        f"(workers {differ} differ from the chief): {details}. `backup_dir` must be on "
        "a filesystem shared by all workers (e.g. NFS or a shared volume) so that all "
        "of them resume from the chief's backup."
    )
