"""Meet every peer before TensorFlow starts its server: a deadline, and errors that say why.

`MultiWorkerMirroredStrategy` starts this task's gRPC server and then waits, inside
TensorFlow's C++ runtime, for every peer: with no deadline, no word about who is missing,
deaf to SIGTERM (Python handlers never run), and a duplicate task index leaves one
process with a bare "Could not start gRPC server" and the other waiting forever. So before
TensorFlow binds the port, `meet_peers()` holds it with a plain socket and runs a tiny
handshake (one JSON line each way) with every chief/worker task of the cluster:

* each task listens on its own TF_CONFIG port, connects to every peer, says who it is
  (job, index, pid, host, a digest of its cluster) and hears who answers; it is done when
  it has reached every peer and heard from every peer, then it closes the socket and
  TensorFlow binds the port as usual (everyone is there, so TensorFlow's own wait is short);
* a port already in use is reported at once, naming the port and its holder: another
  keras_dist process with the same task index (which fails too, on hearing a hello with
  its own identity), a worker of an earlier run, or another program. The failing task
  tells every reachable peer (an "abort" line), so none is left waiting;
* after `startup_timeout_seconds` (`KERAS_DIST_STARTUP_TIMEOUT`, default 600 s) the missing
  tasks are named, with their addresses and what to check;
* SIGTERM/SIGINT end the wait at once, whatever handler was installed (TensorFlow's
  preemption handler only records the signal): the wait is Python, with short timeouts;
  SIGTERM exits with 128 + 15 without the interpreter's slow shutdown, SIGINT raises
  KeyboardInterrupt;
* before any wait, TensorFlow's certain "configured at program startup" error (an op ran
  before `import keras_dist`, or the cluster changed after it) is raised, explained: both
  callers pass `keras_dist.startup.early_init.check_startup` as `before_wait`, which runs
  once this task is known to take part (the start-up module owns that check; this one
  only knows when to run it).

Two callers: `keras_dist.strategy()`, and, when the script runs a TensorFlow op first (a
dataset built before the strategy, as TensorFlow's tutorials do), that first op
(`keras_dist.startup.early_init` wraps the runtime's start once), with the same guarantees and
the deadline from `KERAS_DIST_STARTUP_TIMEOUT`. The peers are met once per process.

Once the server runs, `after_server_start()` (`keras_dist.startup.signal_watcher`) keeps SIGTERM
able to end a worker that is blocked in a collective whose peer is gone.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import socket
import sys
import threading
import time
from typing import Callable, Mapping

from keras_dist import _validation
from keras_dist.startup.group_up import report_up
from keras_dist.startup.signal_watcher import _connect

__all__ = ["StartupError", "meet_peers", "startup_timeout", "DEFAULT_STARTUP_TIMEOUT"]

DEFAULT_STARTUP_TIMEOUT = 600.0
ENV_NAME = "KERAS_DIST_STARTUP_TIMEOUT"
_PROTOCOL = "keras_dist-rendezvous-1"
_CONNECT_TIMEOUT = 0.5
_REPLY_TIMEOUT = 5.0
_RETRY_INTERVAL = 0.25
_WAIT_MESSAGE_AFTER = 10.0
_JOBS = ("chief", "worker")


class StartupError(RuntimeError):
    """A multi-worker job could not start: a missing peer, a port in use, a duplicate task."""


def check_argument(value) -> None:
    """Validates `startup_timeout_seconds` (a number > 0 or None) without reading the env."""
    if value is not None:
        startup_timeout(value)


def startup_timeout(value, environ: Mapping[str, str] | None = None) -> float:
    """`startup_timeout_seconds`, else `KERAS_DIST_STARTUP_TIMEOUT`, else 600 s."""
    if value is not None:
        return _validation.check_number("startup_timeout_seconds", value, minimum=0,
                                        unit="seconds", or_none=True)
    raw = (os.environ if environ is None else environ).get(ENV_NAME, "").strip()
    if not raw:
        return DEFAULT_STARTUP_TIMEOUT
    try:
        seconds = float(raw)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0:
        raise ValueError(f"Environment variable {ENV_NAME} must be a number of seconds > 0. "
                         f"Received: {ENV_NAME}={raw!r}. Unset it for the default "
                         f"({DEFAULT_STARTUP_TIMEOUT:g} s).")
    return seconds


def meet_peers(cluster, timeout_seconds: float | None = None,
               environ: Mapping[str, str] | None = None,
               during: str = "keras_dist.strategy()",
               before_wait: Callable[[object], None] | None = None) -> None:
    """Waits until every chief/worker task of `cluster` is up, or raises `StartupError`.

    `during` names what is starting, for the messages. `before_wait(cluster)`, when
    given, runs once this task is known to take part, before any wait (the callers pass
    `early_init.check_startup`, so its certain error is raised at once).
    """
    deadline = time.monotonic() + startup_timeout(timeout_seconds, environ)
    tasks = {(job, index): address for job in _JOBS
             for index, address in enumerate(cluster.cluster.get(job, ()))}
    me = (cluster.task_type, cluster.task_index)
    if me not in tasks:
        return  # an evaluator or ps task: not part of the collective group
    # TensorFlow's "configured at program startup" error is certain before any wait.
    if before_wait is not None:
        before_wait(cluster)
    address = tasks.pop(me)
    port = int(address.rsplit(":", 1)[1])
    digest = hashlib.sha256(json.dumps({job: list(cluster.cluster.get(job, ()))
                                        for job in _JOBS}, sort_keys=True).encode()).hexdigest()
    if (me, digest) in _met or _listening_here(port):
        return
    meeting = _Meeting(me, address, port, tasks, digest[:16], deadline, during)
    with _signals_end_the_wait(meeting):
        meeting.run()
    _met.add((me, digest))
    report_up(environ)


# (task, cluster digest) of every meeting this process completed: the first op and
# keras_dist.strategy() both ask, the peers are met once.
_met: set = set()


def _name(task) -> str:
    return f"{task[0]} {task[1]}"


class _Meeting:
    def __init__(self, me, address, port, peers, digest, deadline, during):
        self.me, self.address, self.port, self.peers = me, address, port, peers
        self.during = during
        self.digest, self.deadline = digest, deadline
        self.reached: set = set()
        self.heard: set = set()
        self.last_error: dict = {}
        self.started = time.monotonic()

    def hello(self, kind="hello", **extra) -> dict:
        return dict(protocol=_PROTOCOL, kind=kind, job=self.me[0], index=self.me[1],
                    pid=os.getpid(), host=socket.gethostname(), cluster=self.digest, **extra)

    def missing(self) -> list:
        return [task for task in self.peers if task not in self.reached or task not in self.heard]

    def run(self) -> None:
        listener = self._listen()
        try:
            told = False
            while self.missing():
                self._accept(listener)
                self._reach_peers()
                now = time.monotonic()
                if now >= self.deadline:
                    raise StartupError(self._timeout_message())
                # Checked again: the peers may all have answered in the steps above.
                if not told and now - self.started > _WAIT_MESSAGE_AFTER and self.missing():
                    told = True
                    sys.stderr.write(f"keras_dist: {_name(self.me)} is waiting for "
                                     f"{self._describe_missing()} (startup timeout "
                                     f"{self.deadline - self.started:g} s, {ENV_NAME})\n")
                time.sleep(_RETRY_INTERVAL)
            # Late duplicates and peers still reading our reply: answer for a moment more.
            self._accept(listener)
        finally:
            listener.close()

    def _listen(self) -> socket.socket:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind(("", self.port))  # where TensorFlow's gRPC server will bind
        except OSError as error:
            listener.close()
            self.fail(self._port_in_use_message(error))
        listener.listen(64)
        listener.settimeout(0)
        return listener

    def fail(self, message: str) -> None:
        """Tells every reachable peer, so none is left waiting, then raises."""
        for address in self.peers.values():
            with contextlib.suppress(OSError):
                with _connect(address, _CONNECT_TIMEOUT) as connection:
                    connection.sendall(_line(self.hello("abort", reason=message)))
        raise StartupError(message)

    def _accept(self, listener) -> None:
        while True:
            try:
                connection, _ = listener.accept()
            except (BlockingIOError, socket.timeout):
                return
            with connection:
                connection.settimeout(_REPLY_TIMEOUT)
                try:
                    message = _read_line(connection)
                except (OSError, ValueError):
                    continue  # not a keras_dist peer (a port scan, a health check)
                if message.get("protocol") != _PROTOCOL:
                    continue
                with contextlib.suppress(OSError):
                    connection.sendall(_line(self.hello()))
                self._heard_from(message)
                with contextlib.suppress(OSError, ValueError):
                    _read_line(connection)  # the peer closes first: no TIME_WAIT here

    def _heard_from(self, message) -> None:
        task = (message.get("job"), message.get("index"))
        who = f"{_name(task)} (pid {message.get('pid')} on {message.get('host')})"
        if message.get("kind") == "abort":
            raise StartupError(f"{who} could not start, so {_name(self.me)} stops too: "
                               f"{message.get('reason')}")
        if task == self.me:
            raise StartupError(self._duplicate_message(message))
        self._check_same_cluster(message, who)
        if task in self.peers:
            self.heard.add(task)

    def _reach_peers(self) -> None:
        for task, address in self.peers.items():
            if task in self.reached:
                continue
            try:
                with _connect(address, _CONNECT_TIMEOUT) as connection:
                    connection.settimeout(_REPLY_TIMEOUT)
                    connection.sendall(_line(self.hello()))
                    reply = _read_line(connection)
            except (OSError, ValueError) as error:
                self.last_error[task] = _reason(error)
                continue
            if reply.get("protocol") != _PROTOCOL:
                self.last_error[task] = "something answers there, but not keras_dist"
                continue
            answered = (reply.get("job"), reply.get("index"))
            if answered != task:
                self.fail(f"{address}, the address of {_name(task)} in TF_CONFIG, answers "
                          f"as {_name(answered)} (pid {reply.get('pid')}): the workers were "
                          "given different cluster lists. Give every worker the same "
                          "TF_CONFIG 'cluster' (only 'task' differs).")
            self._check_same_cluster(reply, _name(task))
            self.reached.add(task)

    def _check_same_cluster(self, message, who) -> None:
        if message.get("cluster") != self.digest:
            self.fail(f"{who} was given a different cluster in its TF_CONFIG than "
                      f"{_name(self.me)}. Give every worker the same 'cluster' (only "
                      "'task' differs).")

    def _describe_missing(self) -> str:
        return ", ".join(f"{_name(task)} at {self.peers[task]}" for task in self.missing())

    def _timeout_message(self) -> str:
        details = "; ".join(
            f"{_name(task)} at {self.peers[task]} ("
            + (f"never answered: {self.last_error[task]}" if task not in self.reached
               else "answered, but never connected back")
            + ")" for task in self.missing())
        waited = time.monotonic() - self.started
        return (f"{self.during}: {_name(self.me)} waited {waited:.0f} s for its peers "
                f"and these never joined: {details}. Check that each was started (pod "
                "scheduled, process running) with the same TF_CONFIG 'cluster', that the "
                "addresses are right and reachable from here (firewalls, DNS), then start "
                f"the job again. Raise the deadline with startup_timeout_seconds= or "
                f"{ENV_NAME} if peers are just slow to start.")

    def _duplicate_message(self, holder) -> str:
        return (f"Two processes were started as {_name(self.me)} (the same TF_CONFIG task "
                f"index): this one (pid {os.getpid()} on {socket.gethostname()}) and pid "
                f"{holder.get('pid')} on {holder.get('host')}, both for {self.address}. "
                "Give each worker its own 'task': {'index': ...} (0 .. n-1).")

    def _port_in_use_message(self, error) -> str:
        holder = _probe(self.address, self.port, self.hello())
        if holder is not None and (holder.get("job"), holder.get("index")) == self.me:
            return self._duplicate_message(holder)
        owner = _port_owner(self.port)
        return (f"{self.during}: port {self.port} of {self.address}, this task's "
                f"({_name(self.me)}) address in TF_CONFIG, is already in use"
                f"{f' by {owner}' if owner else ''} ({_reason(error)}). Likely a worker of "
                "an earlier run still running, a second process started with the same task "
                "index, or another program on that port: stop it, or give this task another "
                "port in TF_CONFIG.")


def _probe(address, port, hello) -> dict | None:
    """The keras_dist hello of whoever holds our port, if it is a keras_dist meeting."""
    host = address.rsplit(":", 1)[0].strip("[]")
    for target in dict.fromkeys((host, "127.0.0.1")):
        try:
            with _connect(f"{target}:{port}", _CONNECT_TIMEOUT) as connection:
                connection.settimeout(1.5)  # a keras_dist meeting answers at once
                connection.sendall(_line(hello))
                reply = _read_line(connection)
            if reply.get("protocol") == _PROTOCOL:
                return reply
        except (OSError, ValueError):
            continue
    return None


def _port_owner(port: int) -> str | None:
    try:
        import psutil

        for connection in psutil.net_connections("tcp"):
            if connection.laddr and connection.laddr.port == port and connection.pid:
                process = psutil.Process(connection.pid)
                return f"pid {connection.pid} ({' '.join(process.cmdline()[:3])})"
    except Exception:  # noqa: BLE001 - other users' processes are not ours to see
        return None
    return None


def _listening_here(port: int) -> bool:
    try:
        import psutil

        return any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
                   for c in psutil.Process().net_connections("tcp"))
    except Exception:  # noqa: BLE001 - when unsure, meet the peers
        return False


def _line(message: dict) -> bytes:
    return (json.dumps(message) + "\n").encode()


def _read_line(connection) -> dict:
    data = b""
    while not data.endswith(b"\n"):
        chunk = connection.recv(4096)
        if not chunk or len(data) > 65536:
            raise ValueError("no keras_dist hello")
        data += chunk
    message = json.loads(data)
    if not isinstance(message, dict):
        raise ValueError("no keras_dist hello")
    return message


def _reason(error: Exception) -> str:
    if isinstance(error, ConnectionRefusedError):
        return "connection refused: nothing listens on that port yet"
    if isinstance(error, (socket.timeout, TimeoutError)):
        return "timed out: the host does not answer"
    if isinstance(error, socket.gaierror):
        return f"the host name does not resolve ({error})"
    return f"{type(error).__name__}: {error}"


class _Interrupted(BaseException):
    def __init__(self, signum):
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def _signals_end_the_wait(meeting):
    """SIGTERM/SIGINT end the wait, whatever handler (TF's preemption one) is installed."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise _Interrupted(signum)

    previous = {signum: signal.signal(signum, interrupt)
                for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    except _Interrupted as interrupted:
        name = signal.Signals(interrupted.signum).name
        sys.stderr.write(f"keras_dist: {name} while {_name(meeting.me)} waited for "
                         f"{meeting._describe_missing() or 'its peers'}; exiting\n")
        if interrupted.signum == signal.SIGINT:
            raise KeyboardInterrupt from None
        # As SIGTERM's default action: no interpreter shutdown, which takes seconds with
        # TensorFlow loaded (more on a busy machine) and may run ops that wait again.
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(128 + interrupted.signum)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
