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

__all__ = ["PROGRESS_FILE_ENV", "STACK_SIGNAL", "ensure_started", "stack_path"]

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
    global _stack_file
    try:
        _stack_file = open(stack_path(path), "w")
        faulthandler.register(STACK_SIGNAL, file=_stack_file, all_threads=True)
        signalled = int(STACK_SIGNAL)
    except (OSError, ValueError, RuntimeError):  # no such directory, no signals here
        signalled = None
    threading.Thread(target=_publish_to_file, args=(path, signalled), daemon=True,
                     name="keras-dist-progress").start()


def _publish_to_file(path: str, signalled: int | None) -> None:
    last, written = None, 0.0
    temporary = f"{path}.{os.getpid()}.tmp"
    while True:
        record = dict(_progress.current().record(), stack_signal=signalled)
        now = time.monotonic()
        if record != last or now - written >= REFRESH:
            try:
                with open(temporary, "w") as file:
                    json.dump(record, file)
                os.replace(temporary, path)
            except OSError:
                return  # the launcher removed the directory: the attempt is over
            last, written = record, now
        time.sleep(INTERVAL)
