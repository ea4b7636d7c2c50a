"""The zygote server: imports TensorFlow once, then forks a worker per request.

Run as a script by `keras_dist.launching.zygote` (the client side: keys, sharing, the
`subprocess.Popen`-like `ForkedProcess`; its docstring has the design and the protocol):

    python .../keras_dist/launching/zygote_server.py SOCKET_PATH OWNER_PID [shared]

It imports nothing of keras_dist (`sys.path[0]` is this script's folder, dropped for the
workers), so each worker imports keras_dist with its own environment. It serves until
its owner is gone: its parent (a private zygote: the parent's `getppid()` changes when it
exits), or for a zygote shared by a test session (`zygote.share`) the owning process or
the session's folder, whichever goes first.
"""

from __future__ import annotations

import gc
import os
import pickle
import select
import shutil
import signal
import socket
import sys
import tempfile

# Third-party modules only: nothing of keras_dist (see above).
PRELOAD = ("numpy", "cloudpickle", "psutil", "tensorflow", "keras")
POLL_SECONDS = 0.05
MESSAGE_BYTES = 1 << 20



def serve(path, owner, shared=False) -> None:
    """Imports `PRELOAD`, then forks a worker per request until the owner is gone."""
    import importlib

    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    # The imports' ~0.4 M objects live as long as the process: out of the collector's
    # reach, its full collections in every worker skip them (and leave their pages
    # shared with this process, not copied on write): gc.freeze()'s documented use.
    gc.freeze()
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
        while _owner_alive(owner, os.path.dirname(path) if shared else None):
            ready, _, _ = select.select([server], [], [], POLL_SECONDS)
            if ready:
                connection, _ = server.accept()
                pid = _fork_one(server, connection, children, base_path)
                if pid is not None:
                    children[pid] = connection
            _reap(children)
    finally:
        if os.getpid() == me:  # not in a forked worker, whose exit passes here too
            # The parent may end without its atexit (pytest-xdist's workers do).
            if shared:  # the folder is the session's: only this zygote's socket
                _unlink(path)
            else:
                shutil.rmtree(os.path.dirname(path), ignore_errors=True)


def _owner_alive(owner, shared_folder) -> bool:
    if shared_folder is None:
        return os.getppid() == owner
    if not os.path.isdir(shared_folder):
        return False
    try:
        os.kill(owner, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _unlink(path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _fork_one(server, connection, children, base_path):
    try:
        message, fds, _, _ = socket.recv_fds(connection, MESSAGE_BYTES, 2)
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
    serve(sys.argv[1], int(sys.argv[2]), shared=sys.argv[3:] == ["shared"])
