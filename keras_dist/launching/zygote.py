"""Starting workers by forking a process that already imported TensorFlow (`preload`).

A fresh worker spends seconds of CPU importing TensorFlow and Keras before it does
anything; a test suite that starts hundreds of workers spends most of its time there.
`keras_dist.testing` (`run_in_subprocess`, `run_on_workers`, `start_on_workers`,
`WorkerPool`) therefore starts its workers from a *zygote*: one server process per
parent that imports numpy, TensorFlow and Keras once and then forks a worker per
request, as Android and Chromium start their processes. keras_dist itself is not
preloaded (it costs ~0.04 s): `import keras_dist` reads the cluster (`TF_CONFIG`) to
prepare TensorFlow's collectives, so each worker imports it with its own environment, and
the zygote runs as a script (not `-m`) so that not even the package is imported there.

It is safe because of what the zygote does not do: it never initialises TensorFlow's
runtime (no op, no device list, no eager context), starts no Python thread, and opens no
connection, so a fork copies a process that is still in the state "TensorFlow imported,
nothing started" -- the state every fresh worker reaches first. Each worker is then what
a `subprocess.Popen` of the same argv would have made: its own session and process
group, stdin from /dev/null, stdout and stderr into the launcher's pipe, the requested
environment and working directory, `sys.path` as `PYTHONPATH` sets it, Ctrl+C handled as
in the parent, new random seeds, the same interpreter exit (atexit, thread joins).

What it cannot give is an environment variable read *at import*: the zygote imported
TensorFlow with its own. A zygote is therefore keyed by every variable that a library
may read at import (`TF_*` but `TF_CONFIG`, `KERAS*` but keras_dist's own `KERAS_DIST_*`,
`XLA_*`, `CUDA*`, thread and allocator settings, `PYTHON*`, ...): a request whose values
differ goes to another zygote, started for them (at most `_MAX_ZYGOTES` live, least
recently used stopped).
Code that must run before TensorFlow is imported passes `preload=False` instead.

Each worker slot of a group has a zygote of its own, so the workers of one group differ
where fresh interpreters would: Python's string hash seed above all, which orders sets
of names -- a collective launched in set order must not agree by accident in tests.

Protocol (a Unix SEQPACKET socket, one connection per worker): the request is one
message, `pickle({"argv", "env", "cwd", "sigint_ignored"})` with the worker's stdin and
output descriptors attached (SCM_RIGHTS); the zygote answers `pid N`, and `exit R` once
it reaped the worker (R as `Popen.returncode`: -N for signal N).

    python .../keras_dist/launching/zygote.py SOCKET_PATH PARENT_PID
"""

from __future__ import annotations

import atexit
import os
import pickle
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

__all__ = ["ForkedProcess", "running", "server_pids", "spawn", "stop_all"]

# Prefixes of environment variables that a library may read when it is imported.
_IMPORT_TIME_PREFIXES = ("TF_", "KERAS", "XLA_", "CUDA", "NVIDIA", "OMP_", "MKL", "KMP_",
                         "OPENBLAS", "PYTHON", "LD_", "JAX_", "TPU_", "GRPC_", "MALLOC_",
                         "JEMALLOC", "HOME", "TZ", "LANG", "LC_")
# Read later, when the worker runs: set per worker by the launcher, or read by keras_dist,
# which no zygote imports (a zygote per value of KERAS_DIST_DISABLE_COMPAT, say, would
# cost a TensorFlow import each).
_READ_LATE = frozenset({"TF_CONFIG", "PYTHONPATH"})
_READ_LATE_PREFIXES = ("KERAS_DIST_",)
# Third-party modules only: nothing of keras_dist (see above).
_PRELOAD = ("numpy", "cloudpickle", "psutil", "tensorflow", "keras")
_MAX_ZYGOTES = 4  # ~0.7 GB resident each (shared with the workers forked from it)
_READY_SECONDS = 180.0  # a zygote's imports on a loaded 2-core machine
_POLL_SECONDS = 0.05
_MESSAGE_BYTES = 1 << 20


def import_key(env) -> tuple:
    """The part of `env` that a zygote must have been started with to serve it."""
    return tuple(sorted((key, value) for key, value in env.items()
                        if _read_at_import(key)))


def _read_at_import(key) -> bool:
    return (key.startswith(_IMPORT_TIME_PREFIXES) and key not in _READ_LATE
            and not key.startswith(_READ_LATE_PREFIXES))


def _zygote_key(env) -> tuple:
    return env.get("KERAS_DIST_SLOT", "0"), import_key(env)


def supports(argv) -> bool:
    """Whether `argv` is `python -m module ...` or `python script ...` of this Python
    (this venv's: not resolved through links, which lead every venv to one binary)."""
    return (len(argv) >= 2 and os.path.abspath(argv[0]) == os.path.abspath(sys.executable)
            and (argv[1] == "-m" and len(argv) >= 3 or not argv[1].startswith("-")))


def spawn(argv, env) -> "ForkedProcess":
    """Starts `argv` (see `supports`) with `env`, forked from a zygote for `env`."""
    return _zygote_for(env).spawn(argv, env)


def server_pids() -> set:
    """Pids of this process's live zygotes (children that are not workers)."""
    with _LOCK:
        return {zygote.process.pid for zygote in _ZYGOTES.values() if zygote.alive()}


def stop_all() -> None:
    """Stops every zygote of this process (workers they started keep running)."""
    with _LOCK:
        while _ZYGOTES:
            _ZYGOTES.popitem()[1].stop()


_LOCK = threading.Lock()
_ZYGOTES: dict = {}  # import key -> _Zygote, least recently used first
atexit.register(stop_all)


def _zygote_for(env) -> "_Zygote":
    key = _zygote_key(env)
    with _LOCK:
        zygote = _ZYGOTES.pop(key, None)
        if zygote is None or not zygote.alive():
            if zygote is not None:
                zygote.stop()
            while len(_ZYGOTES) >= _MAX_ZYGOTES:
                _ZYGOTES.pop(next(iter(_ZYGOTES))).stop()
            zygote = _Zygote(dict(key[1]))
        _ZYGOTES[key] = zygote
        return zygote


class _Zygote:
    """The parent's end: the server process and its socket."""

    def __init__(self, import_env):
        self.directory = tempfile.mkdtemp(prefix="keras_dist_zygote_")
        self.path = os.path.join(self.directory, "socket")
        env = {key: value for key, value in os.environ.items() if not _read_at_import(key)}
        env.update(import_env)
        env.pop("TF_CONFIG", None)
        self.process = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), self.path, str(os.getpid())],
            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, start_new_session=True)
        # Its own output: TensorFlow's import chatter (absl's ignores TF_CPP_MIN_LOG_LEVEL).
        from keras_dist.launching.output import pass_on
        threading.Thread(target=pass_on, daemon=True, name="keras-dist-zygote-output",
                         args=(self.process.stdout, env.get("KERAS_DIST_TF_LOGS") == "1")
                         ).start()
        self._ready = False

    def alive(self) -> bool:
        return self.process.poll() is None

    def spawn(self, argv, env) -> "ForkedProcess":
        connection = self._connect()
        read_end, write_end = os.pipe()
        try:
            with open(os.devnull, "rb") as devnull:
                request = pickle.dumps({
                    "argv": list(map(str, argv)), "env": dict(env), "cwd": os.getcwd(),
                    "sigint_ignored": signal.getsignal(signal.SIGINT) is signal.SIG_IGN})
                socket.send_fds(connection, [request], [devnull.fileno(), write_end])
        except BaseException:
            os.close(read_end)
            connection.close()
            raise
        finally:
            os.close(write_end)
        reply = _receive(connection, deadline=time.monotonic() + 60)
        if not reply.startswith(b"pid "):
            os.close(read_end)
            connection.close()
            raise RuntimeError(f"keras_dist zygote did not start the worker: {reply!r}")
        return ForkedProcess(argv, int(reply[4:]), connection, os.fdopen(read_end, "rb"))

    def _connect(self) -> socket.socket:
        deadline = time.monotonic() + (5.0 if self._ready else _READY_SECONDS)
        while True:
            connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                connection.connect(self.path)
                self._ready = True
                return connection
            except OSError:
                connection.close()
                if not self.alive() or time.monotonic() > deadline:
                    raise RuntimeError(
                        "keras_dist could not start its preloaded worker server (exit "
                        f"status {self.process.poll()}); pass preload=False to start "
                        "fresh processes, and report the error above") from None
                time.sleep(_POLL_SECONDS)

    def stop(self) -> None:
        if self.alive():
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.directory, ignore_errors=True)


def _receive(connection, deadline) -> bytes:
    while True:
        ready, _, _ = select.select([connection], [], [],
                                    max(0.0, deadline - time.monotonic()))
        if ready:
            return connection.recv(_MESSAGE_BYTES)
        if time.monotonic() >= deadline:
            return b"timeout"


class ForkedProcess:
    """A worker forked by a zygote, used like the `subprocess.Popen` it replaces."""

    def __init__(self, args, pid, connection, stdout):
        self.args, self.pid, self.stdout = args, pid, stdout
        self.returncode = None
        self._connection = connection
        self._lock = threading.Lock()

    def poll(self):
        return self._check(0.0)

    def wait(self, timeout=None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._check(_POLL_SECONDS) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, signum):
        if self.poll() is None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass

    def terminate(self):
        self.send_signal(signal.SIGTERM)

    def kill(self):
        self.send_signal(signal.SIGKILL)

    def _check(self, seconds):
        with self._lock:
            if self.returncode is not None:
                return self.returncode
            if self._connection is not None:
                ready, _, _ = select.select([self._connection], [], [], seconds)
                if not ready:
                    return None
                message = self._connection.recv(_MESSAGE_BYTES)
                self._connection.close()
                self._connection = None
                if message.startswith(b"exit "):
                    self.returncode = int(message[5:])
                    return self.returncode
                seconds = 0.0  # the zygote died without saying: watch the pid itself
            if running(self.pid):
                time.sleep(seconds)
            else:
                self.returncode = 255  # its status went to the zygote's parent: unknown
            return self.returncode


def running(pid) -> bool:
    """Whether process `pid` exists and has not exited (a zombie has exited)."""
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


# ---------------------------------------------------------------------------------------
# The zygote itself (`python .../launching/zygote.py SOCKET_PATH PARENT_PID`). Imports
# nothing of keras_dist: sys.path[0] is this script's folder, dropped for the workers.


def serve(path, parent) -> None:
    """Imports `_PRELOAD`, then forks a worker per request until the parent is gone."""
    import importlib

    for name in _PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    base_path = [entry for entry in sys.path[1:]
                 if entry not in os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    server.bind(path + ".tmp")
    server.listen(64)
    os.replace(path + ".tmp", path)  # connectable only once every import is done
    children: dict = {}  # pid -> connection
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    me = os.getpid()
    try:
        while os.getppid() == parent:
            ready, _, _ = select.select([server], [], [], _POLL_SECONDS)
            if ready:
                connection, _ = server.accept()
                pid = _fork_one(server, connection, children, base_path)
                if pid is not None:
                    children[pid] = connection
            _reap(children)
    finally:
        if os.getpid() == me:  # not in a forked worker, whose exit passes here too
            # The parent may end without its atexit (pytest-xdist's workers do).
            shutil.rmtree(os.path.dirname(path), ignore_errors=True)


def _fork_one(server, connection, children, base_path):
    try:
        message, fds, _, _ = socket.recv_fds(connection, _MESSAGE_BYTES, 2)
        request = pickle.loads(message)
    except Exception as error:  # noqa: BLE001 - a bad request must not stop the server
        connection.send(f"error {type(error).__name__}: {error}".encode())
        connection.close()
        return None
    pid = os.fork()
    if pid == 0:
        server.close()
        for other in children.values():
            other.close()
        connection.close()
        _become_worker(request, fds, base_path)  # raises SystemExit: never returns
    for fd in fds:
        os.close(fd)
    connection.send(f"pid {pid}".encode())
    return pid


def _reap(children) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        connection = children.pop(pid, None)
        if connection is not None:
            try:  # -N for signal N, as Popen.returncode
                connection.send(f"exit {os.waitstatus_to_exitcode(status)}".encode())
            except OSError:
                pass
            connection.close()


def _become_worker(request, fds, base_path):
    """In the forked child: become what `Popen(argv, env=env, cwd=cwd)` would have run."""
    import random
    import runpy

    import numpy as np

    os.setsid()
    stdin_fd, output_fd = fds
    os.dup2(stdin_fd, 0)
    os.dup2(output_fd, 1)
    os.dup2(output_fd, 2)
    os.close(stdin_fd)
    os.close(output_fd)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN if request["sigint_ignored"]
                  else signal.default_int_handler)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    tempfile.tempdir = None
    pythonpath = [entry for entry in request["env"].get("PYTHONPATH", "").split(os.pathsep)
                  if entry]
    random.seed()
    np.random.seed()
    argv = request["argv"]
    if argv[1] == "-m":
        sys.argv = [argv[2], *argv[3:]]
        sys.path[:] = [request["cwd"], *pythonpath, *base_path]
        # A fresh `python -m X` has no module X yet (runpy warns otherwise): X runs as
        # __main__, and importing X by name later gives a second copy, as there.
        sys.modules.pop(argv[2], None)
        runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv[1:]
        sys.path[:] = [os.path.dirname(os.path.abspath(argv[1])), *pythonpath, *base_path]
        runpy.run_path(argv[1], run_name="__main__")
    sys.exit(0)


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]))
