"""Writes a backup while training goes on: one write at a time in a thread of its own.

`BackupAndRestore` under a distribution snapshots the state (the reads of the blocks
this process owns: the only part a step waits for) and hands the write to a
`BackgroundWrite`. The next save, the end of `fit` and a SIGTERM stop `wait()` for it; a
write that failed raises there, as a `BackupError` naming the backup, never silently.
A `fit` that raises leaves its write going: the thread is not a daemon, so the
interpreter's exit waits for it (a kill does not: the previous backup is then the
current one), and the next `fit` on the same directory joins it before it reads the
directory (`join_writes_into`).
"""

from __future__ import annotations

import threading
from typing import Callable

from keras_dist.checkpointing.files import BackupError

__all__ = ["BackgroundWrite", "join_writes_into"]

_LAST_WRITER: dict = {}  # key (a backup directory) -> the BackgroundWrite that wrote last


class BackgroundWrite:
    """At most one write in flight; its error is raised by the next `wait()`."""

    def __init__(self, key: str = ""):
        self.key = key
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._what = ""

    def submit(self, what: str, write: Callable[[], None]) -> None:
        """Waits for the write in flight, then starts `write()` in the background."""
        self.wait()
        self._what = what

        def run():
            try:
                write()
            except BaseException as error:  # surfaced by wait(), in the training thread
                self._error = error

        self._thread = threading.Thread(target=run, daemon=False,
                                        name="keras-dist-backup-write")
        self._thread.start()
        _LAST_WRITER[self.key] = self

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> None:
        """Blocks until the write in flight is done; raises `BackupError` if it failed."""
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        error, self._error = self._error, None
        if error is not None:
            raise BackupError(f"Writing the backup {self._what} in the background failed: "
                              f"{type(error).__name__}: {error}. The previous backup is "
                              "still the current one.") from error


def join_writes_into(key: str) -> None:
    """Waits for a write into `key` still going on (e.g. that of a `fit` that raised);
    its error, if any, stays with its own writer."""
    writer = _LAST_WRITER.get(key)
    thread = writer._thread if writer is not None else None
    if thread is not None:
        thread.join()
