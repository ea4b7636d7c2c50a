"""A group of local workers started once that runs many functions: `keras_dist.testing.WorkerPool`.

Starting a worker costs a Python process and a TensorFlow import (seconds each on a small
machine), so a test suite that starts two workers per test spends most of its time
starting them. A pool starts N workers once, through the same `run_group` as
`keras-dist launch` (the same TF_CONFIG on loopback ports, the same prefixed output), and
then runs one function after another on all of them, as TensorFlow's own
`MultiProcessPoolRunner` does for its tests.

Both ends of the protocol live here. The parent writes `DIR/call-<k>.pkl` (the payload
of `keras_dist.launching.worker`, written atomically); every worker runs

    python -m keras_dist.launching.pool DIR

which serves calls in order: it waits for `call-<k>.pkl`, runs it like a one-off worker
(same result record, same phases), writes `DIR/result-<k>-<index>.pkl` atomically and
goes on with k+1. Between calls each worker restores its environment variables (and
`tempfile`'s cached directory) and working directory and clears Keras' global state (`keras.backend.clear_session`), so a
call sees what a fresh worker would, except that TensorFlow's runtime, the strategy that
`keras_dist.strategy()` created, and anything else made once per process are shared.
It stops on `DIR/stop`, or when its parent process is gone, at once (`os._exit`: it is
idle, and TensorFlow's exit handlers would wait on the peers).

A call that raised on every worker leaves the pool as it was. One that a worker did not
finish (it died, or it still runs `_ERROR_GRACE_SECONDS` after a peer raised: left
waiting in a collective, say) or that timed out stops the pool (its processes are
killed), and the next call starts a fresh one.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Mapping, Sequence

from keras_dist.launching import _core
from keras_dist.launching import worker as _worker
from keras_dist.launching.local import run_group
from keras_dist.launching.options import Options

__all__ = ["WorkerPool"]

_POLL_SECONDS = 0.01
# After one worker reported an error, how long the others get to report theirs before
# the pool is taken for stuck (a peer left waiting in a collective).
_ERROR_GRACE_SECONDS = 5.0
# How long idle workers get to exit on their own before a kill (they exit at once).
_STOP_SECONDS = 15.0


class WorkerPool:
    """N local workers, started once, that run one function after another.

    Use it where many tests (or notebook cells, or benchmarks) each need the same
    worker group: the processes, TensorFlow's runtime and the strategy that
    `keras_dist.strategy()` creates are made once instead of once per call. A function
    that needs a group of its own (other strategy arguments, other virtual devices,
    killing a worker) belongs in `run_on_workers` instead.

    Args:
        num_workers: Number of worker processes (>= 1).
        virtual_devices: Give each worker this many logical devices before any call.
        env: Extra environment variables for the workers (`None` values unset).
        preload: Fork the workers from a process that has already imported TensorFlow
            (`keras_dist.testing.run_on_workers`); `False` starts fresh interpreters.

    Example:
        >>> def replicas():
        ...     import keras_dist
        ...     return keras_dist.strategy().num_replicas_in_sync
        >>> with WorkerPool(num_workers=2) as pool:  # doctest: +SKIP
        ...     pool.run(replicas), pool.run(replicas)
        ([2, 2], [2, 2])
    """

    def __init__(self, num_workers: int = 2, *, virtual_devices: int | None = None,
                 env: Mapping[str, str | None] | None = None, preload: bool = True):
        from keras_dist import _validation

        _validation.check_int("num_workers", num_workers, minimum=1)
        if virtual_devices is not None:
            _validation.check_int("virtual_devices", virtual_devices, minimum=1,
                                  hint="Pass None to use the devices as they are.")
        self.num_workers = num_workers
        self.virtual_devices = virtual_devices
        self.env = dict(env or {})
        self.preload = preload
        self.starts = 0  # how many times the group was started (a restart after a failure)
        self._group: _Group | None = None
        self._lock = threading.Lock()

    def __enter__(self) -> "WorkerPool":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def run(self, fn: Callable[..., Any], *, args: Sequence[Any] = (),
            kwargs: Mapping[str, Any] | None = None, timeout: float | None = 300) -> list:
        """Calls `fn(*args, **kwargs)` on every worker; the return values by worker index.

        Same contract as `keras_dist.testing.run_on_workers` (picklable `fn` and
        arguments; `WorkerError` naming the worker that raised or died; `TimeoutError`
        after `timeout` seconds). When a worker died or did not finish, the pool's
        processes are stopped and the next call starts new ones.
        """
        _core.check_call("WorkerPool.run", fn, args, kwargs, None)
        with self._lock:
            if self._group is None or not self._group.alive():
                self._stop_group()
                self._group = _Group.start(self.num_workers, self.virtual_devices, self.env,
                                           self.preload)
                self.starts += 1
            try:
                return self._group.call(fn, args, kwargs, timeout)
            finally:
                if self._group.broken:
                    self._stop_group()

    def close(self) -> None:
        """Stops the workers (they finish the call they are in, if any, first)."""
        with self._lock:
            self._stop_group()

    def _stop_group(self) -> None:
        if self._group is not None:
            self._group.stop()
            self._group = None


@dataclasses.dataclass
class _Group:
    directory: str
    num_workers: int
    thread: threading.Thread
    outcome: list  # [LaunchResult] once run_group returned
    calls: int = 0
    broken: bool = False  # a call was left unfinished: the processes must go

    @classmethod
    def start(cls, num_workers, virtual_devices, env, preload) -> "_Group":
        directory = tempfile.mkdtemp(prefix="keras_dist_pool_")
        with open(os.path.join(directory, "setup.pkl"), "wb") as file:
            pickle.dump({"version": _worker.PAYLOAD_VERSION, "parent": os.getpid(),
                         "virtual_devices": virtual_devices}, file)
        env = dict(env)
        env["PYTHONPATH"] = _core.pythonpath(env.get("PYTHONPATH",
                                                     os.environ.get("PYTHONPATH")))
        command = [sys.executable, "-m", "keras_dist.launching.pool", directory]
        outcome: list = []
        thread = threading.Thread(
            target=lambda: outcome.append(run_group(command, num_workers,
                                                    Options(env=env, timeout=None,
                                                            preload=preload))),
            name="keras_dist-worker-pool", daemon=True)
        thread.start()
        return cls(directory, num_workers, thread, outcome)

    def alive(self) -> bool:
        return self.thread.is_alive()

    def call(self, fn, args, kwargs, timeout) -> list:
        staging = os.path.join(self.directory, "staging")
        os.makedirs(staging, exist_ok=True)
        payload = _core.payload("WorkerPool.run", staging, fn, args, kwargs, None)
        # Numbered only once it exists: the workers wait for call-<k> in order, so an
        # unpicklable call must not use up a number.
        self.calls += 1
        number = self.calls
        os.replace(payload, os.path.join(self.directory, f"call-{number}.pkl"))
        self.broken = True  # until every worker has answered
        records = self._wait(number, timeout)
        self.broken = not all(records)
        values = []
        for index, record in enumerate(records):
            if record is None or record["status"] != "ok":
                continue
            values.append(_worker.load_value(record))
        failed = next((i for i, r in enumerate(records) if not r or r["status"] != "ok"),
                      None)
        if failed is not None:
            _core.raise_for(failed, records[failed], self._returncodes(), self.num_workers,
                            "WorkerPool.run")
        return values

    def _wait(self, number, timeout) -> list:
        deadline = None if timeout is None else time.monotonic() + timeout
        first_error = None
        while True:
            records = [_worker.read_result(self.directory, index, prefix=f"result-{number}-")
                       for index in range(self.num_workers)]
            if all(records):
                return records
            now = time.monotonic()
            if any(r and r["status"] != "ok" for r in records):
                first_error = first_error or now
                if now - first_error > _ERROR_GRACE_SECONDS:
                    return records
            if not self.alive():
                return [_worker.read_result(self.directory, index, prefix=f"result-{number}-")
                        for index in range(self.num_workers)]
            if deadline is not None and now > deadline:
                raise TimeoutError(
                    f"WorkerPool.run: the workers did not finish within timeout={timeout:g} "
                    "s and were stopped. Their output above (prefixed [worker i]) shows "
                    "where they were; raise `timeout` if the work is just slow.")
            time.sleep(_POLL_SECONDS)

    def _returncodes(self) -> tuple:
        if self.outcome:
            return self.outcome[0].worker_returncodes
        return (None,) * self.num_workers

    def stop(self) -> None:
        open(os.path.join(self.directory, "stop"), "w").close()
        if not self.broken:
            self.thread.join(timeout=_STOP_SECONDS)
        if self.thread.is_alive():  # stuck in a call: kill every worker's process group
            for index in range(self.num_workers):
                _kill(os.path.join(self.directory, f"pid-{index}"))
            self.thread.join(timeout=30.0)
        shutil.rmtree(self.directory, ignore_errors=True)


def _kill(pid_file: str) -> None:
    try:
        with open(pid_file) as file:
            pid = int(file.read())
        os.kill(pid, signal.SIGKILL)
    except (OSError, ValueError):
        pass  # already gone, or never started


# -- the worker's end -----------------------------------------------------------------
def serve(directory: str) -> int:
    """Runs calls from `directory` in order until told to stop, then ends the process."""
    index = _worker.task_index()
    with open(os.path.join(directory, f"pid-{index}"), "w") as file:
        file.write(str(os.getpid()))
    with open(os.path.join(directory, "setup.pkl"), "rb") as file:
        setup = pickle.load(file)
    if setup["virtual_devices"]:
        _worker.setup_virtual_devices(setup["virtual_devices"])
    number = 0
    while True:
        number += 1
        call = os.path.join(directory, f"call-{number}.pkl")
        while not os.path.exists(call):
            if os.path.exists(os.path.join(directory, "stop")) or not _alive(setup["parent"]):
                # Idle, every call answered: skip the interpreter's and TensorFlow's exit
                # handlers (a multi-worker runtime waits on its peers there for seconds),
                # but not the removal of the worker's private directories.
                writers = sys.modules.get("keras_dist.checkpointing.stock_writers")
                if writers is not None:
                    writers.remove_private_dirs()
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(0)
            time.sleep(_POLL_SECONDS)
        environ, cwd = dict(os.environ), os.getcwd()
        try:
            record = _worker.run_payload(call)
        finally:
            _restore(environ, cwd)
        _worker.write_atomically(
            os.path.join(directory, f"result-{number}-{index}.pkl"), record)
        if record["status"] == "error":
            sys.stderr.write(record["traceback"])
            sys.stderr.flush()
        sys.stdout.flush()


def _restore(environ: dict, cwd: str) -> None:
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    tempfile.tempdir = None  # tempfile caches the directory TMPDIR named
    keras = sys.modules.get("keras")
    if keras is not None:
        keras.backend.clear_session(free_memory=False)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


if __name__ == "__main__":
    sys.exit(serve(sys.argv[1]))
