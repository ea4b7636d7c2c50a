"""`BackupAndRestore`: resume a killed, crashed or preempted run where it stopped.

The on-disk format is `checkpointing.files`, the SIGTERM agreement
`checkpointing.preemption`, the mid-epoch skip `checkpointing.step_skipper`, resuming on
another worker count `checkpointing.elastic`.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

from keras_dist import _validation
from keras_dist.callbacks.base import Callback
from keras_dist.checkpointing import elastic, files, preemption, sharded_state, step_state
from keras_dist.checkpointing.background import BackgroundWrite, join_writes_into
from keras_dist.checkpointing.files import BackupError
from keras_dist.checkpointing.preemption import PREEMPTION_EXIT_CODE
from keras_dist.checkpointing.step_skipper import StepSkipper
from keras_dist.cluster import is_chief, num_workers, worker_index
from keras_dist.data import order
from keras_dist.stall import progress as stall_progress

__all__ = ["BackupAndRestore"]


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
    batch within the epoch. With `keras_dist.distribute_dataset` over arrays (or another
    index-able source) the data order is global (`keras_dist/data/order.py`: epoch e's
    order depends on `seed` and e only), so the resumed run reads exactly the global
    batches the lost one would have, also with `shuffle=True`, `repeat=True` and on
    another number of workers or replicas (the backup records both counts and the
    global batch; `checkpointing/elastic.py` says what resumes exactly and what is
    refused). Not restored: Python or NumPy random state, metric values of the
    interrupted epoch (its metrics cover only the batches trained after resuming),
    other callbacks' state (e.g. EarlyStopping's best value). Skipped batches reach
    other callbacks' `on_train_batch_end` with empty logs.

    Elastic: a backup written by N workers resumes on M. The global batch must stay
    the same (compute the per-replica batch with `keras_dist.per_replica_batch_size`);
    a different one is refused with `BackupError`. An input whose order depends on the
    worker count (TFRecord files, a `tf.data.Dataset`, a dataset function,
    `cache=True`) resumes on another count only from an epoch-end backup, with a
    warning; a mid-epoch backup of such an input is refused on another count.

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
        BackupError: (from `fit`) the backup is damaged, belongs to another model, was
            written with another global batch, or cannot resume exactly on this worker
            count (the message names the folder, what differs and what to do).

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
        self.backup_dir = files.check_backup_dir(backup_dir)
        if save_freq != "epoch" and not (_validation.is_int(save_freq) and save_freq >= 1):
            raise ValueError(_validation.message(
                "save_freq", "'epoch' or an integer >= 1 (a number of batches)", save_freq))
        _validation.check_bool("delete_checkpoint", delete_checkpoint)
        _validation.check_bool("handle_sigterm", handle_sigterm)
        if preemption_exit_code is not None and not (
                _validation.is_int(preemption_exit_code) and 0 <= preemption_exit_code <= 255):
            raise ValueError(_validation.message(
                "preemption_exit_code", "an integer in 0..255 or None (return from fit)",
                preemption_exit_code))
        if not (_validation.is_int(preemption_check_freq) and preemption_check_freq >= 1):
            raise ValueError(_validation.message(
                "preemption_check_freq", "an integer >= 1 (batches between SIGTERM checks)",
                preemption_check_freq))
        self.save_freq = save_freq
        self.preemption_check_freq = preemption_check_freq
        self.delete_checkpoint = delete_checkpoint
        self.handle_sigterm = handle_sigterm
        self.preemption_exit_code = preemption_exit_code
        self.preempted = False
        self._sigterm = preemption.SigtermFlag()
        self._writing = BackgroundWrite(os.path.abspath(self.backup_dir))
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
        self._multi_worker = preemption.is_multi_worker(strategy)
        join_writes_into(self._writing.key)  # a write of a fit that raised, still going
        backup = files.read_backup(self.backup_dir)
        found = (1, backup.epoch, backup.step, backup.seq) if backup else (0, 0, 0, 0)
        if self._multi_worker:
            files.check_same_backup(preemption.gather_rows(strategy, found), self.backup_dir)
        self._next_seq = files.next_seq(self.backup_dir)
        if backup is not None:
            with stall_progress.phase("backup restore", self.backup_dir, slow=True):
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

    def wait_until_finished(self) -> None:
        """Blocks until the backup being written in the background (under a
        `keras.distribution` distribution) is complete.

        `fit`'s end, the next save and a SIGTERM stop call it; call it yourself after a
        `fit` that raised, before reading `backup_dir` (the next `fit` with a
        `BackupAndRestore` on the same directory waits for it too).

        Raises:
            BackupError: That write failed (the previous backup is still the current one).
        """
        self._writing.wait()

    def on_train_end(self, logs=None):
        self.wait_until_finished()  # the last backup is complete (or its error raised)
        self._sigterm.uninstall()
        if self._skipper is not None:
            self._skipper.remove(self.model)
        if self._set_initial_epoch:
            # Keras reads `_initial_epoch` in every later `fit`; leave no stale value.
            self.model._initial_epoch = None
        if self.delete_checkpoint and not self.preempted and is_chief():
            files.delete_backup(self.backup_dir)

    # -- helpers --------------------------------------------------------------------
    def _restore(self, backup):
        note, warning = elastic.check_resume(
            backup, self.backup_dir, order.fit_input(self.model), num_workers(),
            int(self.model.distribute_strategy.num_replicas_in_sync))
        optimizer = self.model.optimizer
        deferred = step_state.unbuilt_step_optimizers(self.model)
        if optimizer is not None and not optimizer.built and not step_state.step_optimizers(
                self.model):
            with self.model.distribute_strategy.scope():
                optimizer.build(self.model.trainable_variables)
        if not deferred:
            self._load(backup.weights_path)
        epoch, step = backup.epoch, backup.step
        steps = self.params.get("steps") if self.params else None
        if steps and step >= steps:
            epoch, step = epoch + 1, 0
        self.model._initial_epoch = epoch
        self._set_initial_epoch = True
        self._resume_epoch, self._resume_step = epoch, step
        if step:
            self._skipper = StepSkipper.install(self.model, step)
        if deferred:
            # A custom train_step builds these on its first step: load once they exist.
            _LoadOnFirstStep.install(self.model, lambda: self._load(backup.weights_path))
        if is_chief():
            print(f"BackupAndRestore: resuming at epoch {epoch} (0-based), {step} batch(es) "
                  f"into it, from {backup.weights_path}", flush=True)
            if note:
                print(note, flush=True)
        if warning:
            print(warning, file=sys.stderr, flush=True)

    def _stop_requested(self) -> bool:
        if not self.handle_sigterm:
            return False
        if not self._multi_worker:
            return self._sigterm.received
        rows = preemption.gather_rows(
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
        self._writing.wait()
        if self._multi_worker:
            # Barrier: nobody exits (and gets its peers killed) before the chief's backup
            # is complete on disk.
            preemption.gather_rows(self.model.distribute_strategy, (0, 0, 0, 0))
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
        # The start-up budget, not the stall timeout: a large model's save may be slow.
        with stall_progress.phase("backup save", self.backup_dir, slow=True):
            self._write(epoch, step)

    def _write(self, epoch, step):
        if sharded_state.is_sharded(self.model):
            self._write_sharded(epoch, step)
        elif is_chief():
            input_order = order.fit_input(self.model)
            files.write_backup(
                self.backup_dir, self._save_weights, epoch, step, num_workers(),
                num_replicas=int(self.model.distribute_strategy.num_replicas_in_sync),
                input_order=input_order.to_json() if input_order else None,
            )
        else:
            # A fresh directory per save, removed at once: even a crash of this worker
            # can leave at most the one save it was in the middle of.
            directory = tempfile.mkdtemp(prefix=f"keras_dist-worker{worker_index()}-backup-")
            try:
                self._save_weights(os.path.join(directory, "backup.weights.h5"))
            finally:
                shutil.rmtree(directory, ignore_errors=True)

    def _write_sharded(self, epoch, step):
        """Under a distribution: this process's blocks, snapshotted now, written in the
        background (`checkpointing/shards.py`); the chief commits once all are there."""
        self._writing.wait()
        state = sharded_state.snapshot(self.model)
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        directory = os.path.join(self.backup_dir, files.state_name(seq))
        input_order = order.fit_input(self.model)
        chief, workers = is_chief(), num_workers()
        replicas = int(self.model.distribute_strategy.num_replicas_in_sync)

        def write():
            sharded_state.write_snapshot(state, directory, {"epoch": epoch, "step": step},
                                         commit=chief)
            if chief:
                files.commit_state(
                    self.backup_dir, seq, epoch, step, workers, num_replicas=replicas,
                    input_order=input_order.to_json() if input_order else None)

        self._writing.submit(directory, write)

    def _save_weights(self, path):
        step_state.mark_built(self.model)
        self.model.save_weights(path, overwrite=True)

    def _load(self, path):
        step_state.mark_built(self.model)
        if path.endswith(".state"):
            sharded_state.restore_state(self.model, path)
            return
        try:
            self.model.load_weights(path)
        except (ValueError, KeyError, OSError) as error:
            raise BackupError(
                f"The backup {path!r} does not fit this model or optimizer "
                f"({error}). A backup directory belongs to one training run: delete it, "
                "or use another `backup_dir`, to start from scratch."
            ) from error


class _LoadOnFirstStep:
    """Wraps `model.train_function`: on the first call, builds what the model's own
    `train_step` creates (tracing it, training nothing), loads the backup, then steps."""

    def __init__(self, model, function, load):
        self.model, self.function, self.load = model, function, load

    @classmethod
    def install(cls, model, load):
        model.train_function = cls(model, model.train_function, load)

    def __call__(self, iterator):
        step_state.build_step_state(self.model, iterator)
        self.load()
        if self.model.train_function is self:
            self.model.train_function = self.function
        return self.function(iterator)
