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

A zygote serves the process that started it (its parent), or, shared (`share`), every
process of a session: a test session's parallel test processes and the launchers they
start in subprocesses would otherwise each import TensorFlow once more per zygote
(measured: 20 zygote imports in one run of the slow lane, ~7 CPU-seconds each, where the
session needs a few). `share()` names a folder in `KERAS_DIST_ZYGOTE_SHARE`, inherited by
child processes; a process that needs a zygote for a key takes the key's lock there,
uses the zygote another process started or starts it (at most `_MAX_SHARED`; beyond, a
private one). A shared zygote lives until `unshare()` removes the folder or the process
that called `share()` ends; nobody else stops it (another process may be using it).

Protocol (a Unix SEQPACKET socket, one connection per worker): the request is one
message, `pickle({"argv", "env", "cwd", "sigint_ignored"})` with the worker's stdin and
output descriptors attached (SCM_RIGHTS); the zygote answers `pid N`, and `exit R` once
it reaped the worker (R as `Popen.returncode`: -N for signal N). The server is
`launching/zygote_server.py`, run as a script.
"""

from __future__ import annotations

import atexit
import fcntl
import glob
import hashlib
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

from keras_dist.launching import zygote_server

__all__ = ["ForkedProcess", "SHARE_ENV", "running", "server_pids", "share", "spawn",
           "stop_all", "unshare"]

# Prefixes of environment variables that a library may read when it is imported.
_IMPORT_TIME_PREFIXES = ("TF_", "KERAS", "XLA_", "CUDA", "NVIDIA", "OMP_", "MKL", "KMP_",
                         "OPENBLAS", "PYTHON", "LD_", "JAX_", "TPU_", "GRPC_", "MALLOC_",
                         "JEMALLOC", "HOME", "TZ", "LANG", "LC_")
# Read later, when the worker runs: set per worker by the launcher, or read by keras_dist,
# which no zygote imports (a zygote per value of KERAS_DIST_DISABLE_COMPAT, say, would
# cost a TensorFlow import each).
_READ_LATE = frozenset({"TF_CONFIG", "PYTHONPATH"})
_READ_LATE_PREFIXES = ("KERAS_DIST_",)
_MAX_ZYGOTES = 4  # ~0.7 GB resident each (shared with the workers forked from it)
_MAX_SHARED = 8  # per shared folder (.ci/run: every lane), never stopped before its end
_READY_SECONDS = 180.0  # a zygote's imports on a loaded 2-core machine
_POLL_SECONDS = zygote_server.POLL_SECONDS
_MESSAGE_BYTES = zygote_server.MESSAGE_BYTES
SHARE_ENV = "KERAS_DIST_ZYGOTE_SHARE"


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
    key = _zygote_key(env)
    return (_shared_zygote(key) or _zygote_for(key)).spawn(argv, env)


def share() -> str:
    """Shares the zygotes this process and its child processes start from now on, until
    `unshare()` or this process's end; returns the session's folder."""
    folder = tempfile.mkdtemp(prefix="keras_dist_zygotes_")
    with open(os.path.join(folder, "owner"), "w") as file:
        file.write(str(os.getpid()))
    os.environ[SHARE_ENV] = folder
    return folder


def unshare(folder) -> None:
    """Ends `share()`'s session: its zygotes exit (their workers keep running)."""
    if os.environ.get(SHARE_ENV) == folder:
        del os.environ[SHARE_ENV]
    shutil.rmtree(folder, ignore_errors=True)


def server_pids() -> set:
    """Pids of the live zygotes this process started (children that are not workers)."""
    with _LOCK:
        return {zygote.pid for zygote in [*_ZYGOTES.values(), *_SHARED.values()]
                if zygote.process is not None and zygote.alive()}


def stop_all() -> None:
    """Stops every zygote of this process (workers they started keep running)."""
    with _LOCK:
        while _ZYGOTES:
            _ZYGOTES.popitem()[1].stop()


_LOCK = threading.Lock()
_ZYGOTES: dict = {}  # import key -> _Zygote, least recently used first
_SHARED: dict = {}  # a shared zygote's path in the session's folder -> _Zygote
atexit.register(stop_all)


def _shared_zygote(key):
    """The session's zygote for `key` (see `share`), started if need be; None when this
    process is in no session or the session has `_MAX_SHARED` zygotes."""
    folder = os.environ.get(SHARE_ENV)
    if not folder:
        return None
    # This interpreter too: a session's processes may run in different venvs.
    digest = hashlib.sha1(repr((sys.executable, key)).encode()).hexdigest()[:16]
    name = os.path.join(folder, digest)
    with _LOCK:
        zygote = _SHARED.get(name)
        if zygote is not None and zygote.alive():
            return zygote
        try:
            with open(os.path.join(folder, "owner")) as file:
                owner = int(file.read())
        except (OSError, ValueError):  # the session ended (unshare)
            return None
        with open(name + ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one start per key across the session
            try:
                with open(name + ".pid") as file:
                    zygote = _Zygote.attach(name + ".socket", int(file.read()))
            except (OSError, ValueError):
                zygote = None
            if zygote is None or not zygote.alive():
                if len(glob.glob(os.path.join(folder, "*.pid"))) >= _MAX_SHARED:
                    return None
                zygote = _Zygote(dict(key[1]), path=name + ".socket", owner=owner)
                with open(name + ".pid", "w") as file:
                    file.write(str(zygote.pid))
        _SHARED[name] = zygote
        return zygote


def _zygote_for(key) -> "_Zygote":
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
    """The client's end: the server process (or, shared, its pid) and its socket."""

    def __init__(self, import_env, path=None, owner=None):
        self.directory = None if path else tempfile.mkdtemp(prefix="keras_dist_zygote_")
        self.path = path or os.path.join(self.directory, "socket")
        env = {key: value for key, value in os.environ.items() if not _read_at_import(key)}
        env.update(import_env)
        env.pop("TF_CONFIG", None)
        shared = [] if owner is None else ["shared"]
        self.process = subprocess.Popen(
            [sys.executable, os.path.abspath(zygote_server.__file__), self.path,
             str(os.getpid() if owner is None else owner), *shared],
            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, start_new_session=True)
        self.pid = self.process.pid
        # Its own output: TensorFlow's import chatter (absl's ignores TF_CPP_MIN_LOG_LEVEL).
        from keras_dist.launching.output import pass_on
        threading.Thread(target=pass_on, daemon=True, name="keras-dist-zygote-output",
                         args=(self.process.stdout, env.get("KERAS_DIST_TF_LOGS") == "1")
                         ).start()
        self._ready = False

    @classmethod
    def attach(cls, path, pid) -> "_Zygote":
        """A shared zygote another process started (maybe still importing)."""
        zygote = cls.__new__(cls)
        zygote.directory, zygote.path, zygote.process, zygote.pid = None, path, None, pid
        zygote._ready = False
        return zygote

    def alive(self) -> bool:
        if self.process is None:
            return running(self.pid)
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
                    status = self.process.poll() if self.process is not None else "unknown"
                    raise RuntimeError(
                        "keras_dist could not start its preloaded worker server (exit "
                        f"status {status}); pass preload=False to start fresh processes, "
                        "and report the error above") from None
                time.sleep(_POLL_SECONDS)

    def stop(self) -> None:
        if self.process is not None and self.alive():
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.directory is not None:
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
