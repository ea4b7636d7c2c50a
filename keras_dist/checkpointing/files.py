"""The on-disk format of `BackupAndRestore`: atomic weight files plus a metadata file.

A backup directory holds at most one *current* backup:

    backup.json                     written last; names the weights file and its checksum
    backup-000007.weights.h5        the Keras weights (model + optimizer), never overwritten

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
import time
import uuid
from typing import Callable

METADATA_NAME = "backup.json"
FORMAT = "keras_dist.BackupAndRestore/1"
_WEIGHTS_RE = re.compile(r"^backup-(\d{6,})\.weights\.h5$")
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
    if not os.path.isfile(weights_path):
        raise BackupError(
            f"The backup metadata {metadata_path!r} names {weights_name!r}, which is "
            "missing from the directory. Is the directory shared between hosts but not "
            "fully synchronised? Delete it to start training from scratch."
        )
    if verify and sha256_of(weights_path) != sha256:
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
        metadata = {
            "format": FORMAT,
            "epoch": epoch,
            "step": step,
            "seq": seq,
            "weights": weights_name,
            "sha256": sha256,
            "bytes": os.path.getsize(weights_path),
            "num_workers": num_workers,
            "num_replicas": num_replicas,
            "input": input_order,
            "files": [weights_name, METADATA_NAME],
            "saved_at": time.time(),
        }
        temporary = temporary_name(directory, ".json")
        with open(temporary, "w") as file:
            json.dump(metadata, file, indent=1)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, os.path.join(directory, METADATA_NAME))
        _fsync_dir(directory)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)
    _remove_stale(directory, keep=weights_name)
    return Backup(epoch, step, seq, weights_path, num_workers, num_replicas, input_order)


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


def _remove_stale(directory: str, keep: str | None) -> None:
    for name in os.listdir(directory):
        if name == keep:
            continue
        # Only the chief writes here, one save at a time, so any other temporary file
        # is an orphan of a save that crashed (possibly in an earlier attempt).
        if _WEIGHTS_RE.match(name) or name.startswith(_TMP_PREFIX):
            try:
                os.remove(os.path.join(directory, name))
            except OSError:
                pass

