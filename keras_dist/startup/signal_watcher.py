"""After TensorFlow started this task's server: SIGTERM/SIGINT still end a blocked worker.

Split from `keras_dist.startup.rendezvous` (the meeting before the server starts); this is what
keeps the "never hang" promise once it runs.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time

_JOBS = ("chief", "worker")
_CONNECT_TIMEOUT = 0.5


def after_server_start(cluster) -> None:
    """Once TensorFlow started this task's server: SIGTERM/SIGINT end a blocked worker.

    TensorFlow's server installs a C++ SIGTERM handler that only records the signal
    (its preemption notifier), so a worker that never asked for SIGTERM handling no
    longer stops on SIGTERM and waits for its launcher's SIGKILL. Python's own handler
    for SIGTERM (the default, or one installed before) is put back here. A Python
    handler (TensorFlow's `PreemptionCheckpointHandler`, keras_dist's backup on SIGTERM,
    the default SIGINT one) only runs when the main thread comes back to Python, never
    while it is blocked in a collective whose peer is gone; a watcher thread, woken by
    the signal (`signal.set_wakeup_fd`), ends the process with exit code 128 + signal
    when the main thread has not moved and a peer of the cluster no longer answers.
    """
    if threading.current_thread() is not threading.main_thread():
        return
    handler = signal.getsignal(signal.SIGTERM)
    if handler is not None:  # None: installed outside Python, not ours to replace
        signal.signal(signal.SIGTERM, handler)
    peers = [address for job in _JOBS
             for index, address in enumerate(cluster.cluster.get(job, ()))
             if (job, index) != (cluster.task_type, cluster.task_index)]
    _start_signal_watcher(f"{cluster.task_type} {cluster.task_index}", peers)


_watcher_started = False
_wakeup_sockets: list = []
_BLOCKED_FOR = 0.5


def _start_signal_watcher(me: str, peers: list) -> None:
    global _watcher_started
    if _watcher_started or not peers:
        return
    reader, writer = socket.socketpair()
    writer.setblocking(False)
    try:
        previous = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    except (ValueError, OSError):
        reader.close()
        writer.close()
        return
    if previous != -1:  # an event loop owns the wake-up fd: leave it
        signal.set_wakeup_fd(previous)
        reader.close()
        writer.close()
        return
    _watcher_started = True
    _wakeup_sockets.extend((reader, writer))  # the wake-up fd must stay open
    main = threading.main_thread().ident
    thread = threading.Thread(target=_watch_signals, args=(reader, main, me, peers),
                              name="keras_dist-signal-watcher", daemon=True)
    thread.start()


def _main_position(main_ident):
    frame = sys._current_frames().get(main_ident)
    return None if frame is None else (id(frame), frame.f_lasti)


def _watch_signals(reader, main_ident, me, peers) -> None:
    while True:
        try:
            data = reader.recv(64)
        except OSError:
            return
        if not data:
            return
        for signum in set(data) & {signal.SIGTERM, signal.SIGINT}:
            _end_if_blocked(signal.Signals(signum), main_ident, me, peers)


def _end_if_blocked(signum, main_ident, me, peers) -> None:
    """Ends the process when the main thread sits still and a peer is gone."""
    position = _main_position(main_ident)
    still_since = time.monotonic()
    while position is not None:
        time.sleep(0.1)
        now = _main_position(main_ident)
        if now != position:
            return  # the main thread runs Python: the signal's handler ran
        if time.monotonic() - still_since < _BLOCKED_FOR:
            continue
        gone = [address for address in peers if not _answers(address)]
        if gone:
            os.write(2, (f"keras_dist: {signum.name} while {me} was blocked in "
                         f"TensorFlow (a collective op waiting for {', '.join(gone)}, "
                         "which no longer answers), where the signal's Python handler "
                         "cannot run; exiting now with code "
                         f"{128 + signum}\n").encode())
            os._exit(128 + signum)
        still_since = time.monotonic()


def _answers(address: str) -> bool:
    try:
        with _connect(address, _CONNECT_TIMEOUT):
            return True
    except OSError:
        return False


def _connect(address: str, timeout: float) -> socket.socket:
    host, port = address.rsplit(":", 1)
    return socket.create_connection((host.strip("[]"), int(port)), timeout=timeout)
