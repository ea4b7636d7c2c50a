"""A launched worker's process: starting it with its output reader, describing how it
ended, and stopping a group with every process it started, never hanging.

Used by `keras_dist.launching.local`. A "worker" for `stop_workers` is anything with a
`.process` attribute holding a `subprocess.Popen` (or a `zygote.ForkedProcess`, which
behaves like one) started in its own session (so its pid is also its process group).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import threading
import time

import psutil

from keras_dist.launching import output as _output
from keras_dist.launching import zygote

__all__ = ["POLL_INTERVAL", "Worker", "describe_exit", "log_path", "signal_name",
           "stop_workers"]

POLL_INTERVAL = 0.05
_READER_JOIN = 5.0
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


@dataclasses.dataclass
class Worker:
    """One started worker process: its output reader and, with `log_dir`, its log file."""

    index: int
    process: subprocess.Popen  # or zygote.ForkedProcess
    reader: threading.Thread
    stream: _output.WorkerStream
    log_file: object = None

    @classmethod
    def start(cls, index, argv, env, output, options, attempt) -> "Worker":
        log_file = None
        if options.log_dir is not None:
            log_file = open(log_path(options, f"worker-{index}"), "a", encoding="utf-8")
            log_file.write(f"=== keras-dist launch: worker {index}, attempt {attempt} ===\n")
        if options.preload and zygote.supports(argv):
            # Forked from a process that already imported TensorFlow, with the same
            # session, output pipe and environment as the Popen below.
            process = zygote.spawn(argv, env)
        else:
            process = subprocess.Popen(
                argv,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                # Own session and process group: a terminal's Ctrl+C reaches only the
                # launcher, which stops the workers in order, and a whole worker (with
                # any children) can be signalled at once.
                start_new_session=True,
            )
        to_terminal = options.log_dir is None or options.tee
        stream = _output.WorkerStream(
            f"[worker {index}] " if options.prefix else "",
            output if to_terminal else None,
            # One live progress bar: the chief's. The others' bars end as lines.
            live=index == 0 and output.live,
            quiet=_output.is_quiet(options.verbose, env),
            log_file=log_file,
        )
        reader = threading.Thread(target=_output.pump, args=(process.stdout, stream),
                                  name=f"keras-dist-worker-{index}-output", daemon=True)
        reader.start()
        return cls(index, process, reader, stream, log_file)

    def finish(self) -> None:
        self.reader.join(_READER_JOIN)
        if self.log_file is not None:
            self.log_file.close()


def log_path(options, name):
    return None if options.log_dir is None else os.path.join(options.log_dir, f"{name}.log")


def describe_exit(index: int, returncode: int) -> str:
    if returncode < 0:
        return f"worker {index} was killed by signal {signal_name(-returncode)}"
    return f"worker {index} exited with code {returncode}"


def signal_name(signum: int) -> str:
    names = {int(s): s.name for s in signal.Signals}
    return f"{names[signum]} ({signum})" if signum in names else str(signum)
