"""Start N local training workers with TF_CONFIG on loopback ports, and fail fast.

`launch()` is the library form of `keras-dist launch`: it starts `num_workers` copies of a
command, each with its own `TF_CONFIG` (a worker-only cluster on free `127.0.0.1` ports),
streams their merged stdout/stderr line by line prefixed `[worker i] `, and stops every
worker as soon as one fails, so a dead peer never leaves the others blocked in a
collective. `notebook_launcher` and `keras_dist.testing` run functions through the same
machinery.

Local mode is for development and tests. On a real cluster the scheduler (Kubeflow TFJob,
Slurm, ...) starts the processes and sets TF_CONFIG; keras_dist only reads it. POSIX only:
workers are managed as sessions and process groups.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import IO, Mapping, Sequence

from keras_dist._processes import POLL_INTERVAL as _POLL_INTERVAL
from keras_dist._processes import stop_workers as _stop_workers
from keras_dist.cluster import make_tf_config

__all__ = ["LaunchResult", "free_ports", "launch", "launch_script", "TIMEOUT_RETURNCODE"]

TIMEOUT_RETURNCODE = 124  # What GNU `timeout` returns, so shell scripts can tell.
_TAG = "keras-dist launch"
_READER_JOIN = 5.0


@dataclasses.dataclass(frozen=True)
class LaunchResult:
    """What happened to a launched worker group.

    Attributes:
        returncode: 0 when every worker succeeded; else the first failing worker's exit
            code (`128 + signum` when it was killed by a signal), or 124 on timeout.
        worker_returncodes: Each worker's exit status in the last attempt, as `subprocess`
            reports it (`-N` for signal N), by worker index.
        failed_worker: Index of the worker whose failure stopped the group, else `None`.
        restarts: How many times the group was restarted (`<= max_restarts`).
        message: One line saying what happened, e.g.
            `"keras-dist launch: worker 1 exited with code 3"`.
        timed_out: True when the group was stopped because `timeout` elapsed.
    """

    returncode: int
    worker_returncodes: tuple[int | None, ...]
    failed_worker: int | None
    restarts: int
    message: str
    timed_out: bool = False


def free_ports(n: int) -> list[int]:
    """Returns `n` distinct TCP ports that were free on 127.0.0.1 a moment ago.

    All sockets are bound at once so the kernel cannot hand out the same port twice.
    (Another process can still take a port before the worker binds it; `max_restarts`
    covers that rare case, with fresh ports for each restart.)

    Args:
        n: How many ports.

    Returns:
        A list of `n` port numbers.

    Example:
        >>> len(set(free_ports(3)))
        3
    """
    _check_int("n", n, minimum=0)
    sockets: list[socket.socket] = []
    try:
        for _ in range(n):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def launch(
    command: Sequence[str],
    num_workers: int = 2,
    *,
    max_restarts: int = 0,
    env: Mapping[str, str | None] | None = None,
    timeout: float | None = None,
    stdout: IO[str] | None = None,
    prefix: bool = True,
    grace_period: float = 10.0,
) -> LaunchResult:
    """Runs `num_workers` copies of `command` as one local multi-worker cluster.

    Each worker gets `os.environ` updated with `env`, plus `TF_CONFIG` for its index in a
    worker-only cluster on free loopback ports (TensorFlow's runtime has no
    authentication, so only 127.0.0.1 is used), `KERAS_DIST_LAUNCHED=1`,
    `KERAS_DIST_RESTART=<attempt, from 0>`, `PYTHONUNBUFFERED=1` and
    `TF_CPP_MIN_LOG_LEVEL=2` unless set. Workers run in their own sessions; their output
    goes to `stdout` line by line. When a worker exits non-zero or is killed, the others
    are stopped at once (SIGTERM, then SIGKILL after `grace_period`), including any
    processes they started.

    Args:
        command: The argv of one worker, e.g. `[sys.executable, "train.py", "--epochs", "3"]`.
        num_workers: Number of workers (>= 1).
        max_restarts: After a failure, restart the whole group (fresh ports) up to this
            many times. Scripts resume from their backup checkpoint; `KERAS_DIST_RESTART`
            tells them which attempt they are.
        env: Extra environment variables; a value of `None` removes the variable.
        timeout: Seconds for the whole launch, restarts included; then every worker is
            stopped and the return code is 124. `None` waits forever.
        stdout: Text stream for worker output and launcher messages. `None` writes to
            whatever `sys.stdout` is at write time (so Jupyter and pytest capture work).
        prefix: Prefix each worker line with `[worker i] `.
        grace_period: Seconds between SIGTERM and SIGKILL when stopping workers.

    Returns:
        A `LaunchResult`; `result.returncode` is 0 when all workers succeeded.

    Raises:
        ValueError: An argument is invalid.
        OSError: A worker could not be started (e.g. the executable does not exist);
            workers already started are stopped first.
        KeyboardInterrupt: The launcher was interrupted; all workers are stopped first.

    Example:
        >>> result = launch([sys.executable, "-c", "print('hi')"], num_workers=2)
        [worker 0] hi
        [worker 1] hi
        >>> result.returncode
        0
    """
    return _launch(**locals())


def launch_script(
    script: str | os.PathLike,
    script_args: Sequence[str] = (),
    num_workers: int = 2,
    **kwargs,
) -> LaunchResult:
    """Runs a Python script on `num_workers` local workers with this interpreter.

    Same as `launch([sys.executable, script, *script_args], num_workers, **kwargs)`,
    after checking that the script exists.

    Args:
        script: Path of the Python file (or of a directory with `__main__.py`).
        script_args: Arguments for the script, e.g. `["--epochs", "3"]`.
        num_workers: Number of workers (>= 1).
        **kwargs: Keyword arguments of `launch()` (`max_restarts`, `timeout`, `env`, ...).

    Returns:
        The `LaunchResult`.

    Raises:
        FileNotFoundError: `script` does not exist.
        ValueError: `script` is not runnable or another argument is invalid.

    Example:
        >>> result = launch_script("train.py", ["--epochs", "3"], num_workers=2)
    """
    path = os.fspath(script)
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"Script {path!r} does not exist (looked in {os.getcwd()!r}). "
            "Pass the path of a Python file, e.g. launch_script('train.py')."
        )
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "__main__.py")):
        raise ValueError(f"Script {path!r} is a directory without a __main__.py.")
    if isinstance(script_args, (str, bytes)):
        raise ValueError(
            "Argument `script_args` must be a sequence of strings, not one string. "
            f"Received: script_args={script_args!r}. Use e.g. ['--epochs', '3']."
        )
    return _launch([sys.executable, path, *script_args], num_workers, **kwargs)


def _launch(
    command: Sequence[str],
    num_workers: int,
    *,
    max_restarts: int = 0,
    env: Mapping[str, str | None] | None = None,
    timeout: float | None = None,
    stdout: IO[str] | None = None,
    prefix: bool = True,
    grace_period: float = 10.0,
    set_tf_config: bool = True,
) -> LaunchResult:
    # `set_tf_config=False` runs lone processes (keras_dist.testing.run_in_subprocess).
    argv = _check_command(command)
    _check_int("num_workers", num_workers, minimum=1)
    _check_int("max_restarts", max_restarts, minimum=0)
    if timeout is not None:
        _check_number("timeout", timeout, "a number > 0 (seconds) or None", lambda t: t > 0)
    _check_number("grace_period", grace_period, "a number >= 0 (seconds)", lambda t: t >= 0)
    base_env = _base_env(env, set_tf_config)
    output = _Output(stdout)
    deadline = None if timeout is None else time.monotonic() + timeout

    restarts = 0
    while True:
        outcome, failed, codes = _run_attempt(
            argv, num_workers, base_env, restarts, output, prefix, deadline,
            grace_period, set_tf_config,
        )
        if outcome == "ok":
            return LaunchResult(0, codes, None, restarts,
                                f"{_TAG}: all {num_workers} worker(s) succeeded")
        if outcome == "timeout":
            message = f"{_TAG}: timed out after {timeout:g} s; stopped all workers"
            output.write(message + "\n")
            return LaunchResult(TIMEOUT_RETURNCODE, codes, None, restarts, message, True)
        reason = _describe_exit(failed, codes[failed])
        out_of_time = deadline is not None and time.monotonic() >= deadline
        if restarts < max_restarts and not out_of_time:
            restarts += 1
            output.write(f"{_TAG}: restarting worker group (restart {restarts} of "
                         f"{max_restarts}) after {reason}\n")
            continue
        message = f"{_TAG}: {reason}"
        if restarts:
            message += f" (after {restarts} restart(s))"
        output.write(message + "\n")
        return LaunchResult(_shell_code(codes[failed]), codes, failed, restarts, message)


def _run_attempt(argv, num_workers, base_env, attempt, output, prefix, deadline,
                 grace_period, set_tf_config):
    """Starts one worker group and waits; returns (outcome, failed index, exit codes)."""
    addresses = [f"127.0.0.1:{port}" for port in free_ports(num_workers)]
    workers: list[_Worker] = []
    try:
        for index in range(num_workers):
            env = dict(base_env, KERAS_DIST_RESTART=str(attempt))
            if set_tf_config:
                env["TF_CONFIG"] = make_tf_config(addresses, index)
            workers.append(_Worker.start(index, argv, env, output, prefix))
        while True:
            codes = [worker.process.poll() for worker in workers]
            failed = [i for i, code in enumerate(codes) if code not in (None, 0)]
            if failed:
                output.write(f"{_TAG}: {_describe_exit(failed[0], codes[failed[0]])}; "
                             "stopping all workers\n")
                outcome = ("failed", failed[0])
                break
            if all(code == 0 for code in codes):
                outcome = ("ok", None)
                break
            if deadline is not None and time.monotonic() >= deadline:
                outcome = ("timeout", None)
                break
            time.sleep(_POLL_INTERVAL)
    except KeyboardInterrupt:
        output.write(f"{_TAG}: interrupted; stopping all workers\n")
        raise
    finally:
        # Runs on success too: it also removes processes the workers left behind.
        _stop_workers(workers, grace_period)
        for worker in workers:
            worker.reader.join(_READER_JOIN)
    return outcome[0], outcome[1], tuple(worker.process.returncode for worker in workers)


class _Output:
    """Thread-safe line writer; resolves `sys.stdout` at write time when no stream is given."""

    def __init__(self, stream: IO[str] | None):
        self._stream = stream
        self._lock = threading.Lock()

    def write(self, text: str) -> None:
        with self._lock:
            stream = self._stream if self._stream is not None else sys.stdout
            if stream is None:  # pythonw and some embedded interpreters
                return
            try:
                stream.write(text)
                stream.flush()
            except (OSError, ValueError):
                # A closed or broken stream must not kill the reader thread: it has to
                # keep draining the pipe or the worker blocks on a full pipe buffer.
                pass


@dataclasses.dataclass
class _Worker:
    index: int
    process: subprocess.Popen
    reader: threading.Thread

    @classmethod
    def start(cls, index, argv, env, output, prefix) -> "_Worker":
        process = subprocess.Popen(
            argv,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            # Own session and process group: a terminal's Ctrl+C reaches only the
            # launcher, which stops the workers in order, and a whole worker (with any
            # children) can be signalled at once.
            start_new_session=True,
        )
        label = f"[worker {index}] " if prefix else ""
        reader = threading.Thread(
            target=_pump, args=(process.stdout, label, output),
            name=f"keras-dist-worker-{index}-output", daemon=True,
        )
        reader.start()
        return cls(index, process, reader)


def _pump(pipe, label: str, output: _Output) -> None:
    with pipe:
        for raw in iter(pipe.readline, b""):
            line = raw.decode("utf-8", errors="replace")
            output.write(label + (line if line.endswith("\n") else line + "\n"))


def _describe_exit(index: int, returncode: int) -> str:
    if returncode < 0:
        return f"worker {index} was killed by signal {_signal_name(-returncode)}"
    return f"worker {index} exited with code {returncode}"


def _signal_name(signum: int) -> str:
    names = {int(s): s.name for s in signal.Signals}
    return f"{names[signum]} ({signum})" if signum in names else str(signum)


def _shell_code(returncode: int) -> int:
    # The shell's convention, so `keras-dist launch`'s exit code says which failure.
    return 128 - returncode if returncode < 0 else returncode


def _base_env(env: Mapping[str, str | None] | None, set_tf_config: bool) -> dict[str, str]:
    merged = dict(os.environ)
    items = env.items() if isinstance(env, Mapping) else [(None, env)] if env else []
    for key, value in items:
        if not isinstance(key, str) or not (value is None or isinstance(value, str)):
            raise ValueError("Argument `env` must map strings to strings (or None to "
                             f"unset). Received: env={env!r}")
        if value is None:
            merged.pop(key, None)
        else:
            merged[key] = value
    merged.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    merged["KERAS_DIST_LAUNCHED"] = "1"
    merged["PYTHONUNBUFFERED"] = "1"  # so lines arrive while the worker runs
    if not set_tf_config:
        merged.pop("TF_CONFIG", None)
    return merged


def _check_command(command) -> list[str]:
    if (isinstance(command, (str, bytes)) or not isinstance(command, Sequence) or not command
            or not all(isinstance(part, (str, os.PathLike)) for part in command)):
        raise ValueError(
            "Argument `command` must be a non-empty list of strings (an argv such as "
            f"[sys.executable, 'train.py']). Received: command={command!r}"
        )
    return [os.fspath(part) for part in command]


def _check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(
            f"Argument `{name}` must be an integer >= {minimum}. Received: {name}={value!r}"
        )


def _check_number(name: str, value, expected: str, ok) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
        raise ValueError(f"Argument `{name}` must be {expected}. Received: {name}={value!r}")
