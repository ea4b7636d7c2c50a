"""One save called by every worker with one path: the chief's file, the others' temp copies.

The protocol behind `keras_dist.compat.writers` (the patches of Keras' and TensorFlow's
stock writers), free of upstream internals:

* Every worker runs the save (saving may read distributed variables, a collective).
* The chief writes to a hidden temporary sibling of the path (same directory, same
  file name ending, so Keras' format checks pass), then `os.replace`s it into place: a
  file appears complete or not at all. A directory (SavedModel) is renamed into place;
  an older one at the path is first renamed aside, then deleted.
* The other workers write under a private temporary directory, deleted at once.
* Saves are paired across workers and ordered by `keras_dist.checkpointing.pairing`:
  the chief's n-th save of a file named `B` with each other worker's n-th save of a
  file named `B`; the chief moves its file into place only once every worker taking
  part is done with the previous one, and the others return only once the chief's
  file is complete, so `save(p)` then a load of `p` works on every worker, however
  often `p` is saved. The chief's saves of a name no other worker saves (`if
  is_chief(): model.save(p)`) do not wait for anyone.

Paths keras_dist already made private (`chief_path()` on other workers, keras_dist's
own ModelCheckpoint/TensorBoard/BackupAndRestore temporaries) are written as given;
those that mirror a save of the chief's (`chief_path()`, keras_dist's ModelCheckpoint)
still count as that worker's paired save, so the chief does not replace the file while
the worker may be reading it.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import tempfile
import threading
import uuid
from typing import Any, Callable

from keras_dist.checkpointing import pairing
from keras_dist.checkpointing.pairing import ENV_SWITCH, ENV_TIMEOUT, StockWriterError

__all__ = ["ENV_SWITCH", "ENV_TIMEOUT", "PrivateOutput", "StockWriterError", "active",
           "private_dir", "remove_private_dirs", "replace_into", "write"]

TMP_PREFIX = ".tmp-keras-dist-"
PRIVATE_PREFIX = "keras_dist-worker"
USER_WORKER_PREFIX = "workertemp_"
# Kinds of private directory (`private_dir(kind)`) whose saves mirror one of the
# chief's: `chief_path()` and keras_dist's ModelCheckpoint on the other workers.
MIRROR_KINDS = ("outputs", "checkpoint")

_state = threading.local()


def active() -> bool:
    """True when stock writers get multi-worker semantics in this process now."""
    if os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "off", "no"):
        return False
    from keras_dist import _runtime

    entry = _runtime.latest()
    return entry is not None and entry.kind == "multi_worker"


def is_private(path: str) -> bool:
    """True for paths private to this worker, written as given.

    Those keras_dist made private, and those the user made per-worker with
    TensorFlow's own convention (`workertemp_<task_id>`, the multi_worker_with_keras
    tutorial's `write_filepath` and tf_keras' internal one): the chief saves another
    path then, so waiting for it to save this one would never end.
    """
    return any(part.startswith((PRIVATE_PREFIX, TMP_PREFIX, USER_WORKER_PREFIX))
               for part in os.path.abspath(path).split(os.sep))


def _mirrors_chief(path: str) -> bool:
    """True for a private path of a kind in `MIRROR_KINDS` (see `private_dir`)."""
    for part in os.path.abspath(path).split(os.sep):
        if part.startswith(PRIVATE_PREFIX):
            kind = part[len(PRIVATE_PREFIX):].split("-")[1:2]
            return kind[0] in MIRROR_KINDS if kind else False
    return False


@contextlib.contextmanager
def _nested():
    depth = getattr(_state, "depth", 0)
    _state.depth = depth + 1
    try:
        yield depth > 0
    finally:
        _state.depth = depth


def private_dir(kind: str, *, remove_at_exit: bool = False) -> str:
    """A new temporary directory for this worker, `keras_dist-worker<i>-<kind>-*`.

    The caller removes it; with `remove_at_exit`, so does the end of the process.
    """
    from keras_dist import _runtime

    directory = tempfile.mkdtemp(prefix=f"{PRIVATE_PREFIX}{_runtime.worker_index()}-{kind}-")
    if remove_at_exit:
        _REMOVE_AT_EXIT.append(directory)
    return directory


_REMOVE_AT_EXIT: list = []


@atexit.register
def remove_private_dirs() -> None:
    """Removes this process's `remove_at_exit` private directories (also at exit).

    For a process that ends with `os._exit` (a `WorkerPool` worker), which skips atexit.
    """
    while _REMOVE_AT_EXIT:
        shutil.rmtree(_REMOVE_AT_EXIT.pop(), ignore_errors=True)


def write(path: str, write_to: Callable[[str], Any], *, in_place: bool = False,
          returns_path: bool = False) -> Any:
    """Runs `write_to(target)` with multi-worker semantics for `path` (see module doc).

    Args:
        path: The path every worker asked to write.
        write_to: Writes the file or directory at the path it is given.
        in_place: The chief writes `path` itself (formats of several files whose
            writer already commits them last, e.g. TensorFlow checkpoints).
        returns_path: `write_to` returns the path it wrote; give back `path` instead
            of a worker's temporary one.

    Returns:
        What `write_to` returned.
    """
    if not active() or is_remote(path):
        return write_to(path)
    if chief_path_for(path) is not None:
        return _write_per_worker_path(path, write_to)
    if is_private(path):
        if _mirrors_chief(path) and not _nested_now():
            pairing.arrive(pairing.next_pair(path))
            with _nested():
                return write_to(path)
        return write_to(path)
    with _nested() as nested:
        from keras_dist import _runtime

        if nested:  # e.g. BackupAndRestore's save_weights inside the outer protocol
            atomic = _runtime.is_chief() and not in_place
            return replace_into(path, write_to) if atomic else write_to(path)

        pair = pairing.next_pair(path)
        if _runtime.is_chief():
            return _chief_write(path, write_to, pair, in_place)
        # Another worker: whether `path` is the chief's path or this worker's own (a
        # mkdtemp() of its own), its file goes to a removed temporary; the chief's file
        # is the one that stays (tf_keras' rule).
        pairing.arrive(pair)
        result = _private_write(path, write_to)
        pairing.wait_for_chief(pair, path)
        return path if returns_path else result


def _nested_now() -> bool:
    return getattr(_state, "depth", 0) > 0


def chief_path_for(path: str) -> str | None:
    """The chief's path for a per-worker path of TensorFlow's convention, else None.

    The multi_worker_with_keras tutorial (and tf_keras) save from worker i to
    `dir/workertemp_i/name` while the chief saves `dir/name`.
    """
    parts = os.path.abspath(path).split(os.sep)
    kept = [part for part in parts if not part.startswith(USER_WORKER_PREFIX)]
    return os.sep.join(kept) if len(kept) != len(parts) else None


def _write_per_worker_path(path, write_to):
    # The user chose this worker's own path (and removes it); write it as given, then
    # return once the chief's file of that name is complete, so loading the chief's path
    # right after works here too ("the chief saves, then every worker loads").
    from keras_dist import _runtime

    pair = pairing.next_pair(path)
    if _runtime.is_chief():
        return _chief_write(path, write_to, pair, in_place=True)
    pairing.arrive(pair)
    result = write_to(path)
    pairing.wait_for_chief(pair, path)
    return result


def _chief_write(path, write_to, pair, in_place):
    pairing.started(pair, path)
    try:
        if in_place:
            pairing.wait_for_other_workers(pair, path)
            result = write_to(path)
        else:
            result = replace_into(path, write_to, before_replace=lambda: (
                pairing.wait_for_other_workers(pair, path)))
    except BaseException as error:
        pairing.finished(pair, error)
        raise
    pairing.finished(pair)
    return result


def _private_write(path, write_to):
    directory = private_dir("write")
    try:
        return write_to(os.path.join(directory, os.path.basename(path.rstrip(os.sep))))
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def replace_into(path: str, write_to: Callable[[str], Any],
                 before_replace: Callable[[], None] | None = None) -> Any:
    """Writes via a hidden sibling, then renames it to `path` (file or directory).

    `before_replace` runs between the two: the chief waits there for the other workers
    to be done with the file at `path`.
    """
    path = path.rstrip(os.sep) or path
    directory, name = os.path.split(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    temporary = os.path.join(directory, f"{TMP_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}-{name}")
    try:
        result = write_to(temporary)
        if before_replace is not None:
            before_replace()
        if os.path.isdir(temporary):
            _replace_dir(temporary, path)
        else:
            os.replace(temporary, path)
    finally:
        if os.path.isdir(temporary):
            shutil.rmtree(temporary, ignore_errors=True)
        elif os.path.exists(temporary):
            os.remove(temporary)
    return result


def _replace_dir(temporary: str, path: str) -> None:
    if not os.path.lexists(path):
        os.rename(temporary, path)
        return
    # rename() cannot replace a non-empty directory: move the old one aside first (the
    # path is briefly absent, never half-written).
    old = f"{temporary}.old"
    os.rename(path, old)
    os.rename(temporary, path)
    if os.path.isdir(old):
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.remove(old)


def under(root: str, path: str) -> str:
    """`path` re-rooted under `root`, keeping its structure (and `{...}` placeholders)."""
    relative = os.path.splitdrive(os.path.abspath(path))[1].lstrip(os.sep)
    return os.path.join(root, relative)


def is_remote(path: str) -> bool:
    return "://" in str(path)


class PrivateOutput:
    """A callback's output redirected to a private directory on non-chief workers."""

    def __init__(self, kind: str):
        # on_train_end removes it; the exit covers evaluate()-only use and crashes.
        self.directory = private_dir(kind, remove_at_exit=True)

    def path_for(self, path: str) -> str:
        target = under(self.directory, path)
        # Keras' writers do not create parent directories (the user's path had them).
        os.makedirs(os.path.dirname(target), exist_ok=True)
        return target

    def remove(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)
