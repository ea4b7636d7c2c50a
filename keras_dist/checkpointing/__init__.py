"""Fault tolerance: multi-worker-safe backup/restore, SIGTERM handling, chief-only outputs.

Modules: `backup_and_restore` (the callback), `files` (the atomic on-disk format),
`preemption` (SIGTERM and the agreement collective), `step_skipper` (mid-epoch resume),
`chief_outputs` (`chief_path`, `verbose`, ModelCheckpoint/TensorBoard drop-ins),
`shards` + `sharded_state` (`save_state` / `restore_state`: a model's and optimizer's
state, each process writing only the blocks it holds, restored onto any mesh, process
count or one device).

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

from keras_dist.checkpointing.backup_and_restore import BackupAndRestore
from keras_dist.checkpointing.chief_outputs import (
    ModelCheckpoint,
    TensorBoard,
    chief_path,
    verbose,
)
from keras_dist.checkpointing.files import BackupError
from keras_dist.checkpointing.pairing import StockWriterError
from keras_dist.checkpointing.preemption import PREEMPTION_EXIT_CODE
from keras_dist.checkpointing.sharded_state import restore_state, save_state

__all__ = [
    "BackupAndRestore",
    "BackupError",
    "ModelCheckpoint",
    "TensorBoard",
    "PREEMPTION_EXIT_CODE",
    "StockWriterError",
    "chief_path",
    "restore_state",
    "save_state",
    "verbose",
]
