"""The on-disk format of `BackupAndRestore`: atomic weight files plus a metadata file.

A backup directory holds at most one *current* backup:

    backup.json                     written last; names the weights file and its checksum
    backup-000007.weights.h5        the Keras weights (model + optimizer), never overwritten
    backup-000007.state/            or, under a keras.distribution distribution, the sharded
                                    state (`checkpointing/shards.py`): each process's blocks
                                    and an index; the checksum is the index's

Saving writes the weights to a hidden temporary file in the same directory, fsyncs it,
`os.replace`s it to a new, never-used name (the sequence number grows), then writes
`backup.json` the same way and only then deletes older weight files. `os.replace` within
one directory is atomic on POSIX filesystems (and on NFS/most FUSE mounts that claim
POSIX semantics), so a crash at any point leaves either the previous backup or the new
one complete and loadable: the metadata never names a file that is missing or half
written. Pure Python; no TensorFlow.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import time
import uuid
from typing import Callable

from keras_dist.checkpointing.shards import INDEX_NAME

METADATA_NAME = "backup.json"
FORMAT = "keras_dist.BackupAndRestore/1"
_WEIGHTS_RE = re.compile(r"^backup-(\d{6,})\.(weights\.h5|state)$")
_TMP_PREFIX = ".tmp-keras-dist-"


class BackupError(RuntimeError):
    """A backup exists but cannot be used (damaged, or from another model)."""


@dataclasses.dataclass(frozen=True)
class Backup:
    """What `backup.json` says; `weights_path` is checked to exist with the right checksum."""

    epoch: int
    step: int
    seq: int
    weights_path: str
    num_workers: int
    # Newer backups also record the replica count and the input's order (`InputOrder`
    # as JSON), so a resume on another worker count can check it can be exact.
    num_replicas: int | None = None
    input_order: dict | None = None


def sha256_of(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for chunk in iter(lambda: file.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync_file(path: str) -> None:
    with open(path, "rb+") as file:
        os.fsync(file.fileno())


def _fsync_dir(directory: str) -> None:
    # Makes the renames themselves durable; not every filesystem allows it.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def temporary_name(directory: str, suffix: str) -> str:
    return os.path.join(directory, f"{_TMP_PREFIX}{os.getpid()}-{uuid.uuid4().hex}{suffix}")


def read_backup(directory: str, verify: bool = True) -> Backup | None:
    """The current backup in `directory`, or None when there is none.

    Raises:
        BackupError: `backup.json` is unreadable, names a missing weights file, or the
            file's checksum differs (it was changed or damaged after it was written).
    """
    metadata_path = os.path.join(directory, METADATA_NAME)
    if not os.path.isfile(metadata_path):
        return None
    try:
        with open(metadata_path) as file:
            metadata = json.load(file)
        if metadata.get("format") != FORMAT:
            raise ValueError(f"format is {metadata.get('format')!r}, expected {FORMAT!r}")
        epoch, step, seq = (int(metadata[key]) for key in ("epoch", "step", "seq"))
        weights_name = str(metadata["weights"])
        sha256 = str(metadata["sha256"])
        num_workers = int(metadata.get("num_workers", 1))
        num_replicas = metadata.get("num_replicas")
        num_replicas = None if num_replicas is None else int(num_replicas)
        input_order = metadata.get("input")
        if input_order is not None and not isinstance(input_order, dict):
            raise ValueError(f"input={input_order!r}")
        if epoch < 0 or step < 0 or not _WEIGHTS_RE.match(weights_name):
            raise ValueError(f"epoch={epoch}, step={step}, weights={weights_name!r}")
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise BackupError(
            f"The backup metadata {metadata_path!r} is damaged ({error}). It is written "
            "atomically, so something else changed it. Delete the backup directory to "
            "start training from scratch."
        ) from None
    weights_path = os.path.join(directory, weights_name)
    checked = (os.path.join(weights_path, INDEX_NAME) if weights_name.endswith(".state")
               else weights_path)
    if not os.path.isfile(checked):
        raise BackupError(
            f"The backup metadata {metadata_path!r} names {weights_name!r}, which is "
            "missing from the directory. Is the directory shared between hosts but not "
            "fully synchronised? Delete it to start training from scratch."
        )
    if verify and sha256_of(checked) != sha256:
        raise BackupError(
            f"The backup weights {weights_path!r} do not match the checksum in "
            f"{metadata_path!r}: the file was changed or damaged after it was saved. "
            "Delete the backup directory to start training from scratch."
        )
    return Backup(epoch, step, seq, weights_path, num_workers, num_replicas, input_order)


def write_backup(
    directory: str,
    save_weights: Callable[[str], None],
    epoch: int,
    step: int,
    num_workers: int,
    *,
    num_replicas: int | None = None,
    input_order: dict | None = None,
) -> Backup:
    """Saves a new backup atomically (see the module docstring) and returns it."""
    os.makedirs(directory, exist_ok=True)
    try:
        previous = read_backup(directory, verify=False)
    except BackupError:
        previous = None
    seq = _next_seq(directory, previous)
    weights_name = f"backup-{seq:06d}.weights.h5"
    temporary = temporary_name(directory, ".weights.h5")  # Keras wants this suffix
    try:
        save_weights(temporary)
        _fsync_file(temporary)
        sha256 = sha256_of(temporary)
        weights_path = os.path.join(directory, weights_name)
        os.replace(temporary, weights_path)
        _write_metadata(directory, weights_name, sha256, os.path.getsize(weights_path),
                        epoch, step, seq, num_workers, num_replicas, input_order)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)
    _remove_stale(directory, keep=weights_name)
    return Backup(epoch, step, seq, weights_path, num_workers, num_replicas, input_order)


def commit_state(directory: str, seq: int, epoch: int, step: int, num_workers: int, *,
                 num_replicas: int | None = None, input_order: dict | None = None) -> Backup:
    """Makes the complete sharded state `backup-<seq>.state` the current backup."""
    name = state_name(seq)
    path = os.path.join(directory, name)
    size = sum(os.path.getsize(os.path.join(path, entry)) for entry in os.listdir(path))
    _write_metadata(directory, name, sha256_of(os.path.join(path, INDEX_NAME)), size, epoch,
                    step, seq, num_workers, num_replicas, input_order)
    _remove_stale(directory, keep=name, below=seq)
    return Backup(epoch, step, seq, path, num_workers, num_replicas, input_order)


def state_name(seq: int) -> str:
    return f"backup-{seq:06d}.state"


def next_seq(directory: str) -> int:
    """The sequence number the next backup in `directory` takes."""
    try:
        previous = read_backup(directory, verify=False)
    except BackupError:
        previous = None
    return _next_seq(directory, previous) if os.path.isdir(directory) else 1


def _write_metadata(directory, name, sha256, size, epoch, step, seq, num_workers,
                    num_replicas, input_order) -> None:
    metadata = {
        "format": FORMAT,
        "epoch": epoch,
        "step": step,
        "seq": seq,
        "weights": name,
        "sha256": sha256,
        "bytes": size,
        "num_workers": num_workers,
        "num_replicas": num_replicas,
        "input": input_order,
        "files": [name, METADATA_NAME],
        "saved_at": time.time(),
    }
    temporary = temporary_name(directory, ".json")
    try:
        with open(temporary, "w") as file:
            json.dump(metadata, file, indent=1)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, os.path.join(directory, METADATA_NAME))
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)
    _fsync_dir(directory)


def delete_backup(directory: str) -> None:
    """Removes the backup files (only ours) and the directory if that leaves it empty."""
    if not os.path.isdir(directory):
        return
    metadata_path = os.path.join(directory, METADATA_NAME)
    if os.path.exists(metadata_path):
        # Metadata first: a crash half-way leaves unreferenced files, never a dangling name.
        os.remove(metadata_path)
    _remove_stale(directory, keep=None)
    try:
        os.rmdir(directory)
    except OSError:
        pass  # not empty: the user keeps other files there


def _next_seq(directory: str, previous: Backup | None) -> int:
    seqs = [previous.seq] if previous else []
    for name in os.listdir(directory):
        match = _WEIGHTS_RE.match(name)
        if match:
            seqs.append(int(match.group(1)))
    return max(seqs, default=0) + 1


def _remove_stale(directory: str, keep: str | None, below: int | None = None) -> None:
    for name in os.listdir(directory):
        if name == keep:
            continue
        match = _WEIGHTS_RE.match(name)
        # A sharded save in flight (the others' blocks of a later save) is not stale.
        if match and below is not None and int(match.group(1)) >= below:
            continue
        # Only the chief writes here, one save at a time, so any other temporary file
        # is an orphan of a save that crashed (possibly in an earlier attempt).
        if match or (name.startswith(_TMP_PREFIX) and below is None):
            path = os.path.join(directory, name)
            try:
                shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
            except OSError:
                pass


def check_directory(path, argument: str, *, caller: str = "", hint: str = "") -> str:
    """`path` as a str, or a clear error for what cannot be a directory argument.

    `argument` names the argument in the message, `caller` (e.g. "save_state") prefixes
    it, and `hint` says what to do when `path` is an existing file.
    """
    where = f"{caller}: argument" if caller else "Argument"
    if isinstance(path, os.PathLike):
        path = os.fspath(path)
    if not isinstance(path, str):
        raise TypeError(
            f"{where} `{argument}` must be a directory path (str or os.PathLike). "
            f"Received: {argument}={path!r} of type {type(path).__name__}"
        )
    if not path.strip():
        raise ValueError(f"{where} `{argument}` must be a non-empty directory path. "
                         f"Received: {argument}={path!r}")
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{where} `{argument}` must be a directory, but {path!r} is a "
                         f"file.{' ' + hint if hint else ''}")
    return path


def check_backup_dir(backup_dir) -> str:
    """`backup_dir` as a str, or a clear error for what cannot be a backup directory."""
    return check_directory(backup_dir, "backup_dir",
                           hint="Give BackupAndRestore a directory of its own.")


def check_same_backup(rows, backup_dir: str) -> None:
    """Refuses workers that found different backups (`rows`: one per worker, gathered)."""
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
