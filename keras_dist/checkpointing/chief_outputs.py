"""Chief-only outputs: `chief_path`, `verbose`, and the ModelCheckpoint/TensorBoard drop-ins.

Under MultiWorkerMirroredStrategy every worker runs the same script, so every worker
would write the same checkpoint and the same TensorBoard events to the same place,
racing each other on a shared filesystem. Saving cannot simply be skipped on the other
workers either: reading distributed variables (on-read metrics, for example) may run a
collective that all workers must join. So, as TensorFlow's own multi-worker guide
recommends, every worker saves, the chief to the real path and the others to private
temporary directories that are deleted again. Exported by `keras_dist.checkpointing`.
"""

from __future__ import annotations

import os
import shutil

import keras

from keras_dist.callbacks.base import Callback
from keras_dist.checkpointing import stock_writers
from keras_dist.cluster import is_chief

__all__ = ["ModelCheckpoint", "TensorBoard", "chief_path", "verbose"]

_VERBOSE_VALUES = ("auto", 0, 1, 2)
_worker_root: str | None = None
_chief_paths: dict[str, str] = {}


def chief_path(path: str | os.PathLike) -> str:
    """The path to write to: `path` on the chief, a private temporary path elsewhere.

    Use it for anything every worker must write but only the chief should keep: a
    final `model.save(...)`, exported artefacts, custom logs. On workers other than the
    chief it returns the same path placed under a per-process temporary directory
    (structure and `{epoch}`-style placeholders kept), which is deleted when the process
    exits. The same `path` always maps to the same result in one process.

    Args:
        path: A file or directory path (`str` or `os.PathLike`).

    Returns:
        A `str` path whose parent directory exists (it is created if missing).

    Raises:
        TypeError: `path` is not a `str` or `os.PathLike` of `str`.
        ValueError: `path` is empty.

    Example:
        >>> model.save(keras_dist.chief_path("/shared/run1/final.keras"))
    """
    path = _check_path("path", path)
    if is_chief():
        target = path
    else:
        root = _root()
        target = _chief_paths.setdefault(path, stock_writers.under(root, path))
    # Keras' savers do not create missing parent directories; make every worker alike.
    parent = os.path.dirname(target)
    if parent:
        os.makedirs(parent, exist_ok=True)
    return target


def verbose(chief: str | int = "auto") -> str | int:
    """The `verbose=` value for `fit`/`evaluate`/`predict` that prints on the chief only.

    Args:
        chief: The value the chief uses: `"auto"` (the default), `1` (progress bar) or
            `2` (one line per epoch); `0` silences every worker.

    Returns:
        `chief` on the chief, `0` on every other worker.

    Raises:
        ValueError: `chief` is not one of `"auto"`, 0, 1, 2.

    Example:
        >>> model.fit(dataset, epochs=3, verbose=keras_dist.verbose())
    """
    if isinstance(chief, bool) or chief not in _VERBOSE_VALUES:
        raise ValueError(
            f"Argument `chief` must be one of {list(_VERBOSE_VALUES)} (Keras' `verbose` "
            f"values). Received: chief={chief!r}"
        )
    return chief if is_chief() else 0


class ModelCheckpoint(keras.callbacks.ModelCheckpoint, Callback):
    """`keras.callbacks.ModelCheckpoint` that keeps files on the chief only.

    Takes exactly Keras' arguments. Every worker saves (so collectives inside the save
    line up), but only the chief writes `filepath`; the others write under a private
    temporary directory that is deleted at the end of training. Use it instead of
    Keras' class in multi-worker scripts; it is the same class alone.

    Example:
        >>> checkpoint = keras_dist.callbacks.ModelCheckpoint(
        ...     "/shared/run1/epoch-{epoch:02d}.keras", save_best_only=True)
        >>> model.fit(dataset, epochs=3, callbacks=[checkpoint])
    """

    def __init__(self, filepath, *args, **kwargs):
        super().__init__(_check_path("filepath", filepath), *args, **kwargs)
        self._chief_filepath = self.filepath
        self._private_dir: str | None = None

    def on_train_begin(self, logs=None):
        self._remove_private_dir()
        if is_chief():
            self.filepath = self._chief_filepath
        else:
            self._private_dir = _private_dir("checkpoint")
            self.filepath = stock_writers.under(self._private_dir, self._chief_filepath)
        super().on_train_begin(logs)

    def on_train_end(self, logs=None):
        super().on_train_end(logs)
        self._remove_private_dir()
        self.filepath = self._chief_filepath

    def _remove_private_dir(self):
        if self._private_dir:
            shutil.rmtree(self._private_dir, ignore_errors=True)
            self._private_dir = None


class TensorBoard(keras.callbacks.TensorBoard, Callback):
    """`keras.callbacks.TensorBoard` that writes event files on the chief only.

    Takes exactly Keras' arguments. The other workers write to a private temporary
    directory that is deleted at the end of training (or of evaluation, when used with
    `evaluate` alone), so TensorBoard shows one run, not one per worker.

    Example:
        >>> model.fit(dataset, epochs=3,
        ...           callbacks=[keras_dist.callbacks.TensorBoard("/shared/run1/logs")])
    """

    def __init__(self, log_dir="logs", *args, **kwargs):
        super().__init__(_check_path("log_dir", log_dir), *args, **kwargs)
        self._chief_log_dir = self.log_dir
        self._private_dir: str | None = None

    def set_model(self, model):
        # Keras fixes the writers' directories here, before on_train_begin.
        if is_chief():
            self.log_dir = self._chief_log_dir
        else:
            if self._private_dir is None:
                self._private_dir = _private_dir("tensorboard")
            self.log_dir = os.path.join(self._private_dir, "logs")
        super().set_model(model)

    def on_train_end(self, logs=None):
        super().on_train_end(logs)
        if self._private_dir:
            shutil.rmtree(self._private_dir, ignore_errors=True)
            self._private_dir = None


def _check_path(name: str, path) -> str:
    if isinstance(path, os.PathLike):
        path = os.fspath(path)
    if not isinstance(path, str):
        raise TypeError(
            f"Argument `{name}` must be a path (str or os.PathLike). "
            f"Received: {name}={path!r} of type {type(path).__name__}"
        )
    if not path:
        raise ValueError(f"Argument `{name}` must be a non-empty path. Received: {name}=''")
    return path


def _private_dir(kind: str) -> str:
    """A new temporary directory for this worker, removed at exit if still there."""
    return stock_writers.private_dir(kind, remove_at_exit=True)


def _root() -> str:
    global _worker_root
    if _worker_root is None or not os.path.isdir(_worker_root):
        _worker_root = _private_dir("outputs")
        _chief_paths.clear()
    return _worker_root
