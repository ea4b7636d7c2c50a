"""Stopping a launched worker group, with every process it started, and never hanging.

Used by `keras_dist.launching.local`. A "worker" here is anything with a `.process`
attribute holding a `subprocess.Popen` started in its own session (so its pid is also its
process group).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import psutil

__all__ = ["stop_workers", "POLL_INTERVAL"]

POLL_INTERVAL = 0.05
# After SIGKILL a process dies at once; this only bounds waiting on an unkillable
# (uninterruptible-sleep) process so the launcher itself never hangs.
_KILL_WAIT = 5.0


def stop_workers(workers, grace_period: float) -> None:
    """SIGTERM every worker and its descendants, SIGKILL survivors after `grace_period`."""
    if not workers:
        return
    procs = _worker_processes(workers)
    if procs:
        _signal_all(workers, procs, signal.SIGTERM)
    try:
        _wait_gone(workers, procs, time.monotonic() + grace_period)
    finally:
        # Also reached on a second Ctrl+C during the grace period: never leave survivors.
        survivors = _worker_processes(workers) + [p for p in procs if _alive(p)]
        if survivors:
            _signal_all(workers, survivors, signal.SIGKILL)
            _wait_gone(workers, survivors, time.monotonic() + _KILL_WAIT)
        for worker in workers:
            try:
                worker.process.wait(timeout=_KILL_WAIT)
            except subprocess.TimeoutExpired:
                pass


def _worker_processes(workers) -> list[psutil.Process]:
    """Live workers, their descendants, and members of their process groups."""
    found: dict[int, psutil.Process] = {}
    for worker in workers:
        if worker.process.poll() is not None:
            continue
        try:
            parent = psutil.Process(worker.process.pid)
            found[parent.pid] = parent
            # Descendants that left the group (setsid) are only reachable this way.
            for child in parent.children(recursive=True):
                found[child.pid] = child
        except psutil.Error:
            pass
    # Children of a worker that already exited were re-parented; its group finds them.
    groups = {worker.process.pid for worker in workers}
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) in groups:
                found[proc.pid] = proc
        except (OSError, psutil.Error):
            pass
    found.pop(os.getpid(), None)
    return [proc for proc in found.values() if _alive(proc)]


def _signal_all(workers, procs, signum) -> None:
    for worker in workers:
        if worker.process.poll() is None:
            try:
                os.killpg(worker.process.pid, signum)
            except OSError:
                pass
    for proc in procs:
        try:
            proc.send_signal(signum)  # psutil checks the pid was not reused
        except psutil.Error:
            pass


def _wait_gone(workers, procs, deadline: float) -> None:
    while True:
        for worker in workers:
            worker.process.poll()  # reap our own children so they stop being zombies
        if not any(_alive(proc) for proc in procs) or time.monotonic() >= deadline:
            return
        time.sleep(POLL_INTERVAL)


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
