"""Publishes this process's progress to whoever watches for stalls.

Started by the first Keras loop of a process (`keras_dist.stall.keras_loops`), it picks
one of:

* **the launcher** (`keras-dist launch`, `notebook_launcher`, `keras_dist.testing`): it
  sets `KERAS_DIST_PROGRESS_FILE`; a daemon thread rewrites that file (atomically) every
  half second while the record changes, and `SIGUSR1` makes the process write the Python
  stacks of all its threads next to it (`faulthandler`, which runs even while the main
  thread spins or is blocked in C), so the launcher can show where a stuck worker is;
* **the in-worker watchdog** (`keras_dist.stall.watchdog`) in a multi-worker job started
  without the launcher (Kubernetes, Slurm, Ray Train): the workers share their records
  through TensorFlow's coordination service and each watches all;
* nothing, in a lone process.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import threading
import time

from keras_dist.stall import progress as _progress

__all__ = ["PROGRESS_FILE_ENV", "STACK_SIGNAL", "ensure_started", "publish_now", "stack_path"]

PROGRESS_FILE_ENV = "KERAS_DIST_PROGRESS_FILE"
STACK_SIGNAL = signal.SIGUSR1
INTERVAL = 0.5  # seconds between looks at the record
REFRESH = 5.0  # rewrite an unchanged record this often (the file shows the thread lives)

_lock = threading.Lock()
_started_pid: int | None = None
_stack_file = None  # kept open: faulthandler writes to its descriptor from a signal


def stack_path(progress_file: str) -> str:
    """Where a worker writes its stacks on `STACK_SIGNAL`."""
    return progress_file + ".stack"


def ensure_started() -> None:
    """Starts publishing for this process, once (again in a forked child)."""
    global _started_pid
    if _started_pid == os.getpid():
        return
    with _lock:
        if _started_pid == os.getpid():
            return
        _started_pid = os.getpid()
        path = os.environ.get(PROGRESS_FILE_ENV)
        if path:
            _start_file_reporter(path)
        else:
            from keras_dist.stall import watchdog

            watchdog.start_if_wanted()


def _start_file_reporter(path: str) -> None:
    global _stack_file, _file
    try:
        _stack_file = open(stack_path(path), "w")
        faulthandler.register(STACK_SIGNAL, file=_stack_file, all_threads=True)
        signalled = int(STACK_SIGNAL)
    except (OSError, ValueError, RuntimeError):  # no such directory, no signals here
        signalled = None
    _file = _RecordFile(path, signalled)
    threading.Thread(target=_publish_to_file, args=(_file,), daemon=True,
                     name="keras-dist-progress").start()


class _RecordFile:
    """The progress file: the record written whole (temporary file + rename), by the
    publishing thread or by `publish_now`, one at a time (never an older record last)."""

    def __init__(self, path: str, signalled: int | None):
        self.path, self.signalled = path, signalled
        self.temporary = f"{path}.{os.getpid()}.tmp"
        self.last, self.written = None, 0.0
        self.lock = threading.Lock()

    def write(self) -> bool:
        """Writes the record if it changed (or is due); False once the launcher removed
        the directory."""
        with self.lock:
            record = dict(_progress.current().record(), stack_signal=self.signalled)
            now = time.monotonic()
            if record != self.last or now - self.written >= REFRESH:
                try:
                    with open(self.temporary, "w") as file:
                        json.dump(record, file)
                    os.replace(self.temporary, self.path)
                except OSError:
                    return False  # the launcher removed the directory: the attempt is over
                self.last, self.written = record, now
            return True


_file: _RecordFile | None = None


def publish_now() -> None:
    """Writes this process's record at once (a Keras loop returned): a process that ends
    right after `fit` must not leave the watcher its record of half a second before."""
    record_file = _file
    if record_file is not None and _started_pid == os.getpid():
        record_file.write()


def _publish_to_file(record_file: _RecordFile) -> None:
    while record_file.write():
        time.sleep(INTERVAL)
