"""One save called by every worker with one path: the chief's file, the others' temp copies.

The protocol behind `keras_dist.compat.writers` (the patches of Keras' and TensorFlow's
stock writers), free of upstream internals:

* Every worker runs the save (saving may read distributed variables, a collective).
* The chief writes to a hidden temporary sibling of the path (same directory, same
  file name ending, so Keras' format checks pass), then `os.replace`s it into place: a
  file appears complete or not at all. A directory (SavedModel) is renamed into place;
  an older one at the path is first renamed aside, then deleted.
* The other workers write under a private temporary directory, deleted at once.
* Saves are paired across workers by file name and order: the chief's n-th save of a
  file named `B` pairs with every other worker's n-th save of a file named `B` (in
  whatever directory), so a worker that saves into its own `tempfile.mkdtemp()` (Ray's
  documented pattern) pairs with the chief's save of its own directory, and one path
  shared by every worker pairs with itself.
* The chief publishes "started" (with its path) for the pair before writing, then "done"
  (or its error) in TensorFlow's coordination service; the others wait for both before
  returning, so a load of the chief's file right after the save works on every worker.
  The chief never waits, so a script that saves on the chief only
  (`if is_chief(): model.save(p)`) still runs. A worker whose chief never makes the
  paired save gets `StockWriterError` after `KERAS_DIST_STOCK_WRITERS_TIMEOUT` seconds
  (default 600), naming the path and the variable.

Paths keras_dist already made private (`chief_path()` on other workers, keras_dist's
own ModelCheckpoint/TensorBoard/BackupAndRestore temporaries) are written as given.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import os
import shutil
import tempfile
import threading
import uuid
from typing import Any, Callable

ENV_SWITCH = "KERAS_DIST_STOCK_WRITERS"
ENV_TIMEOUT = "KERAS_DIST_STOCK_WRITERS_TIMEOUT"
# How long another worker waits for the chief to reach the paired save; a mismatch (a
# save the chief never makes) is an error after this. Once the chief has started, its
# write is waited for as long as it takes (a chief that dies ends the wait: the
# coordination service runs in the chief).
_DEFAULT_TIMEOUT_SECONDS = 600.0
_WRITE_WAIT_SECONDS = 24 * 3600.0
_KEY_ROOT = "keras_dist/stock_writers"
TMP_PREFIX = ".tmp-keras-dist-"
PRIVATE_PREFIX = "keras_dist-worker"
USER_WORKER_PREFIX = "workertemp_"

_state = threading.local()
_counts: collections.Counter = collections.Counter()
_counts_lock = threading.Lock()


class StockWriterError(RuntimeError):
    """The chief's save failed or did not finish, seen from another worker."""


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
    parts = os.path.abspath(path).split(os.sep)
    return any(part.startswith((PRIVATE_PREFIX, TMP_PREFIX, USER_WORKER_PREFIX))
               for part in parts)


@contextlib.contextmanager
def _nested():
    depth = getattr(_state, "depth", 0)
    _state.depth = depth + 1
    try:
        yield depth > 0
    finally:
        _state.depth = depth


def private_dir(kind: str) -> str:
    """A new temporary directory for this worker (the caller removes it)."""
    from keras_dist import _runtime

    return tempfile.mkdtemp(prefix=f"{PRIVATE_PREFIX}{_runtime.worker_index()}-{kind}-")


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
        return write_to(path)
    with _nested() as nested:
        from keras_dist import _runtime

        if nested:  # e.g. BackupAndRestore's save_weights inside the outer protocol
            atomic = _runtime.is_chief() and not in_place
            return replace_into(path, write_to) if atomic else write_to(path)

        key = _key(path)
        if _runtime.is_chief():
            return _chief_write(path, write_to, key, in_place)
        # Another worker: whether `path` is the chief's path or this worker's own (a
        # mkdtemp() of its own), its file goes to a removed temporary; the chief's file
        # is the one that stays (tf_keras' rule).
        result = _private_write(path, write_to)
        wait_for_chief(key, path)
        return path if returns_path else result


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

    key = _key(path)
    if _runtime.is_chief():
        return _chief_write(path, write_to, key, in_place=True)
    result = write_to(path)
    wait_for_chief(key, path)
    return result


def _chief_write(path, write_to, key, in_place):
    from keras_dist.compat import coordination

    coordination.set_value(f"{key}/started", os.path.abspath(path))
    try:
        result = write_to(path) if in_place else replace_into(path, write_to)
    except BaseException as error:
        coordination.set_value(f"{key}/done", f"error: {type(error).__name__}: {error}")
        raise
    coordination.set_value(f"{key}/done", "done")
    return result


def _private_write(path, write_to):
    directory = private_dir("write")
    try:
        return write_to(os.path.join(directory, os.path.basename(path.rstrip(os.sep))))
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def timeout_seconds() -> float:
    """How long another worker waits for the chief to reach a paired save."""
    raw = os.environ.get(ENV_TIMEOUT, "").strip()
    if not raw:
        return _DEFAULT_TIMEOUT_SECONDS
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise ValueError(
            f"{ENV_TIMEOUT} must be a positive number of seconds (how long other workers "
            f"wait for the chief to make the same save). Received: {ENV_TIMEOUT}={raw!r}")
    return value


def wait_for_chief(key: str, path: str) -> None:
    """Returns once the chief's save paired with `key` is complete.

    Raises:
        StockWriterError: The chief did not reach that save within `timeout_seconds()`,
            or its write failed.
    """
    from keras_dist import _runtime
    from keras_dist.compat import coordination

    timeout = timeout_seconds()
    name, count = _key_parts(key)
    try:
        coordination.get_value(f"{key}/started", timeout)
    except Exception as error:
        text = f"{type(error).__name__}: {error}"
        if "deadline" not in text.lower() and "timed out" not in text.lower():
            raise StockWriterError(
                f"Worker {_runtime.worker_index()} saved {path!r} and could not hear from "
                f"the chief about its paired save ({text})."
            ) from None
        raise StockWriterError(
            f"Worker {_runtime.worker_index()} saved {path!r}, its save number {count} of a "
            f"file named {name!r}, but the chief made no save number {count} of a file "
            f"named {name!r} within {timeout:g} s ({type(error).__name__}). keras_dist "
            "pairs a save on the other workers with the chief's save of the same file "
            "name, in order, and waits until the chief's file is complete: every worker "
            "must make the same saves with the same file names in the same order (a save "
            "made on the chief only, or a file name that differs per worker, breaks that). "
            f"Set {ENV_TIMEOUT} (seconds) to wait longer for a chief that is slow to get "
            f"there, or {ENV_SWITCH}=0 to turn keras_dist's stock-writer handling off."
        ) from None
    try:
        value = coordination.get_value(f"{key}/done", _WRITE_WAIT_SECONDS)
    except Exception as error:
        raise StockWriterError(
            f"The chief started its save paired with {path!r} but did not report it "
            f"complete ({type(error).__name__}: {error})."
        ) from None
    if value != "done":
        raise StockWriterError(f"The chief failed to write its file paired with {path!r}: "
                               f"{value}")


def _key(path: str) -> str:
    """The pairing key of this process's next save of a file named like `path`."""
    name = os.path.basename(os.path.abspath(path.rstrip(os.sep) or path))
    with _counts_lock:
        _counts[name] += 1
        return f"{_KEY_ROOT}/{_counts[name]}/{name}"


def _key_parts(key: str) -> tuple[str, int]:
    count, name = key[len(_KEY_ROOT) + 1:].split("/", 1)
    return name, int(count)


def replace_into(path: str, write_to: Callable[[str], Any]) -> Any:
    """Writes via a hidden sibling, then renames it to `path` (file or directory)."""
    path = path.rstrip(os.sep) or path
    directory, name = os.path.split(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    temporary = os.path.join(directory, f"{TMP_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}-{name}")
    try:
        result = write_to(temporary)
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


def is_remote(path: str) -> bool:
    return "://" in str(path)


class PrivateOutput:
    """A callback's output redirected to a private directory on non-chief workers."""

    def __init__(self, kind: str):
        self.directory = private_dir(kind)
        # on_train_end removes it; this covers evaluate()-only use and crashes.
        atexit.register(shutil.rmtree, self.directory, True)

    def path_for(self, path: str) -> str:
        relative = os.path.splitdrive(os.path.abspath(path))[1].lstrip(os.sep)
        target = os.path.join(self.directory, relative)
        # Keras' writers do not create parent directories (the user's path had them).
        os.makedirs(os.path.dirname(target), exist_ok=True)
        return target

    def remove(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)
