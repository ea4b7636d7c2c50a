"""Start N local training workers with TF_CONFIG on loopback ports, and fail fast.

`launch()` is the library form of `keras-dist launch`: it starts `num_workers` copies of a
command, each with its own `TF_CONFIG` (a worker-only cluster on free `127.0.0.1` ports),
streams their merged stdout/stderr prefixed `[worker i] ` (live progress bars from the
chief on a terminal, no '\\r' garbage elsewhere, TensorFlow's start-up noise dropped),
and stops every worker as soon as one fails, so a dead peer never leaves the others
blocked in a collective. When workers fail, its last lines name the first one and end
with its traceback. `notebook_launcher` and `keras_dist.testing` run functions through
the same machinery (`keras_dist.launching._core`).

Local mode is for development and tests. On a real cluster the scheduler (Kubeflow TFJob,
Slurm, ...) starts the processes and sets TF_CONFIG; keras_dist only reads it. POSIX only:
workers are managed as sessions and process groups.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import socket
import sys
import tempfile
import time
from typing import IO, Mapping, Sequence

from keras_dist import _validation
from keras_dist.cluster import make_tf_config
from keras_dist.launching import output as _output
from keras_dist.launching.options import Options, checked_command, checked_options, worker_env
from keras_dist.launching.stall_monitor import StallMonitor
from keras_dist.launching.shrink import Group, check_min_workers
from keras_dist.stall.watchdog import STALL_EXIT_CODE
from keras_dist.startup.group_up import UP_FILE_ENV
from keras_dist.launching.processes import (
    POLL_INTERVAL,
    Worker,
    describe_exit,
    log_path,
    stop_workers,
)

__all__ = ["LaunchResult", "free_ports", "launch", "launch_script", "STALL_RETURNCODE",
           "TIMEOUT_RETURNCODE"]

TIMEOUT_RETURNCODE = 124  # What GNU `timeout` returns, so shell scripts can tell.
STALL_RETURNCODE = STALL_EXIT_CODE  # 75, EX_TEMPFAIL: stuck, worth running again
TAG = "keras-dist launch"


@dataclasses.dataclass(frozen=True)
class LaunchResult:
    """What happened to a launched worker group.

    Attributes:
        returncode: 0 when every worker succeeded; else the first failing worker's exit
            code (`128 + signum` when it was killed by a signal), 124 on timeout, or 75
            (`STALL_RETURNCODE`) when the last attempt stalled.
        worker_returncodes: Each worker's exit status in the last attempt, as `subprocess`
            reports it (`-N` for signal N), by worker index.
        failed_worker: Index of the worker whose failure stopped the group, else `None`.
        restarts: How many times the group was restarted (`<= max_restarts`).
        message: One line saying what happened, e.g.
            `"keras-dist launch: worker 1 exited with code 3"`.
        timed_out: True when the group was stopped because `timeout` elapsed.
        dropped_slots: The worker slots (indices of the first attempt) dropped to shrink
            the group (`min_workers`), in the order they were dropped.
        stalled: True when the last attempt was stopped for a stall (no worker made
            progress for the stall timeout, `keras_dist.stall.policy`).
        stalled_workers: The workers the others waited for in the last stall of the
            launch (restarted or not), by index; `()` when none stalled.
        stall_stacks: Their Python stacks (all threads) as they printed them, aligned
            with `stalled_workers` (`""` where one did not answer).
    """

    returncode: int
    worker_returncodes: tuple[int | None, ...]
    failed_worker: int | None
    restarts: int
    message: str
    timed_out: bool = False
    dropped_slots: tuple[int, ...] = ()
    stalled: bool = False
    stalled_workers: tuple[int, ...] = ()
    stall_stacks: tuple[str, ...] = ()

    @property
    def num_workers(self) -> int:
        """How many workers the last attempt ran (fewer than asked after shrinking)."""
        return len(self.worker_returncodes)


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
    _validation.check_int("n", n, minimum=0)
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
    log_dir: str | os.PathLike | None = None,
    tee: bool = False,
    verbose: bool | None = None,
    min_workers: int | None = None,
    preload: bool = False,
    stall_timeout: float | None = None,
) -> LaunchResult:
    """Runs `num_workers` copies of `command` as one local multi-worker cluster.

    Each worker gets `os.environ` updated with `env`, plus `TF_CONFIG` for its index in a
    worker-only cluster on free loopback ports (TensorFlow's runtime has no
    authentication, so only 127.0.0.1 is used), `KERAS_DIST_LAUNCHED=1`,
    `KERAS_DIST_RESTART=<attempt, from 0>`, `PYTHONUNBUFFERED=1` and
    `TF_CPP_MIN_LOG_LEVEL=2` unless set. Workers run in their own sessions; their output
    goes to `stdout` as it comes. When a worker exits non-zero or is killed, the others
    are stopped at once (SIGTERM, then SIGKILL after `grace_period`), including any
    processes they started, and the last lines name it and end with its traceback.

    Args:
        command: The argv of one worker, e.g. `[sys.executable, "train.py", "--epochs", "3"]`.
        num_workers: Number of workers (>= 1).
        max_restarts: After a failure, restart the whole group (fresh ports) up to this
            many times (`KERAS_DIST_RESTART` tells scripts the attempt).
        min_workers: Shrink instead of stopping, down to this many workers (`None`:
            never; `keras_dist/launching/shrink.py` has the rule). With a fixed global
            batch and `keras_dist.callbacks.BackupAndRestore`, the run resumes exactly.
        env: Extra environment variables; a value of `None` removes the variable.
        timeout: Seconds for the whole launch, restarts included (then all workers are
            stopped, return code 124); `None` waits forever.
        stdout: Text stream for worker output and launcher messages. `None` writes to
            whatever `sys.stdout` is at write time (Jupyter, pytest capture, a terminal
            with the chief's live progress bar).
        prefix: Prefix each worker line with `[worker i] `.
        grace_period: Seconds from SIGTERM to SIGKILL when stopping workers.
        log_dir: Also write each worker's output to `log_dir/worker-<i>.log` (everything,
            start-up logs included) and the launcher's messages to
            `log_dir/launcher.log`; worker output then leaves `stdout` unless `tee`.
        tee: With `log_dir`, also write worker output to `stdout`.
        verbose: Keep TensorFlow's start-up logs and Keras' shuffle warning (`None`:
            `KERAS_DIST_TF_LOGS=1`).
        preload: Fork each worker (and restart) of `python script` / `python -m module`
            from a process that already imported TensorFlow and Keras (`launching/
            zygote.py`): it starts in about a second, not a TensorFlow import's seconds.
            What TensorFlow reads at import must then come from the environment.
        stall_timeout: Seconds in which no worker made progress in a Keras loop that make
            a stall (`None`: `KERAS_DIST_STALL_TIMEOUT`, else max(300 s, 20 x the slowest
            step); 0: off; start-up, tracing and backups get the start-up timeout). On a
            stall the launcher names the workers behind, prints their Python stacks,
            stops the group and restarts it (one of `max_restarts`).

    Returns:
        A `LaunchResult`; `result.returncode` is 0 when all workers succeeded.

    Raises:
        ValueError: An argument is invalid.
        OSError: A worker could not be started (the others are stopped first).
        KeyboardInterrupt: Interrupted (all workers are stopped first).

    Example:
        >>> result = launch([sys.executable, "-c", "print('hi')"], num_workers=2)
        [worker 0] hi
        [worker 1] hi
        >>> result.returncode
        0
    """
    options = checked_options(max_restarts, env, timeout, stdout, prefix, grace_period,
                              log_dir, tee, verbose, min_workers, preload, stall_timeout)
    return run_group(command, num_workers, options)


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
    return launch([sys.executable, path, *script_args], num_workers, **kwargs)


def run_group(command: Sequence[str], num_workers: int, options: Options) -> LaunchResult:
    """The core of every launcher: start, watch, restart (shrinking), summarise."""
    argv = checked_command(command)
    _validation.check_int("num_workers", num_workers, minimum=1)
    _validation.check_optional_number("timeout", options.timeout, minimum=0, unit="seconds")
    check_min_workers(options.min_workers, num_workers)
    base_env = worker_env(options)
    if options.log_dir is not None:
        os.makedirs(options.log_dir, exist_ok=True)
    output = _output.Output(options.stdout, log_path(options, "launcher"))
    deadline = None if options.timeout is None else time.monotonic() + options.timeout
    group = Group(list(range(num_workers)), options.min_workers or num_workers)
    stall_timeout = options.resolved_stall_timeout(base_env)
    last_stall: dict = {}
    try:
        restarts = 0
        while True:
            outcome, failed, workers, came_up, stall = _run_attempt(
                argv, group.slots, base_env, restarts, output, options, deadline,
                stall_timeout)
            codes = tuple(worker.process.returncode for worker in workers)
            dropped = tuple(group.dropped)
            if stall is not None:
                last_stall = _stall_fields(*stall)
            if outcome == "ok":
                return LaunchResult(0, codes, None, restarts,
                                    f"{TAG}: all {len(codes)} worker(s) succeeded",
                                    dropped_slots=dropped, **last_stall)
            if outcome == "timeout":
                message = f"{TAG}: timed out after {options.timeout:g} s; stopped all workers"
                output.message(message)
                return LaunchResult(TIMEOUT_RETURNCODE, codes, None, restarts, message, True,
                                    dropped, **last_stall)
            reason = (f"stall: {stall[0].message}" if outcome == "stalled"
                      else describe_exit(failed, codes[failed]))
            out_of_time = deadline is not None and time.monotonic() >= deadline
            if restarts < options.max_restarts and not out_of_time:
                restarts += 1
                output.message(f"{TAG}: " + group.after_failure(
                    failed, came_up, restarts, options.max_restarts, reason))
                continue
            message = f"{TAG}: {reason}" + (f" (after {restarts} restart(s))" if restarts
                                            else "")
            if outcome == "stalled":
                output.message(message)
                return LaunchResult(STALL_RETURNCODE, codes, failed, restarts, message,
                                    dropped_slots=dropped, stalled=True, **last_stall)
            _summarise(output, workers[failed], reason, message)
            return LaunchResult(_shell_code(codes[failed]), codes, failed, restarts, message,
                                dropped_slots=dropped, **last_stall)
    finally:
        output.close()


def _stall_fields(stall, stacks) -> dict:
    return {"stalled_workers": stall.behind,
            "stall_stacks": tuple(stacks.get(index, "") for index in stall.behind)}


def _summarise(output, worker, reason, message) -> None:
    # The root cause last: other workers print a cascade of "Collective ops is aborted"
    # after the first failure; what the user needs is the first failure's own words.
    excerpt = _output.failure_excerpt(worker.stream.tail)
    if excerpt:
        output.message(f"{TAG}: root cause: {reason} (the first worker to fail); the end "
                       f"of its output:")
        for line in excerpt:
            output.message(f"    {line}")
    output.message(message)


def _run_attempt(argv, slots, base_env, attempt, output, options, deadline, stall_timeout):
    """Starts one worker group on `slots` and waits.

    Returns:
        (outcome, failed index, workers, whether the group came up: a worker met all
        its peers, `keras_dist.startup.rendezvous`; (Stall, stacks) when it stalled).
    """
    addresses = [f"127.0.0.1:{port}" for port in free_ports(len(slots))]
    workers: list[Worker] = []
    up_dir = tempfile.mkdtemp(prefix="keras_dist_up_")
    monitor = StallMonitor(len(slots), stall_timeout, TAG)
    try:
        for index, slot in enumerate(slots):
            env = dict(base_env, KERAS_DIST_RESTART=str(attempt), KERAS_DIST_SLOT=str(slot))
            env[UP_FILE_ENV] = os.path.join(up_dir, f"worker-{index}")
            env.update(monitor.env(index))
            if options.set_tf_config:
                env["TF_CONFIG"] = make_tf_config(addresses, index)
            workers.append(Worker.start(index, argv, env, output, options, attempt))
        outcome = _watch(workers, output, deadline, monitor)
    except KeyboardInterrupt:
        output.message(f"{TAG}: interrupted; stopping all workers")
        raise
    finally:
        # Runs on success too: it also removes processes the workers left behind.
        stop_workers(workers, options.grace_period)
        for worker in workers:
            worker.finish()
        came_up = bool(os.path.isdir(up_dir) and os.listdir(up_dir))
        shutil.rmtree(up_dir, ignore_errors=True)
        monitor.close()
    return outcome[0], outcome[1], workers, came_up, outcome[2]


def _watch(workers, output, deadline, monitor):
    while True:
        codes = [worker.process.poll() for worker in workers]
        failed = [i for i, code in enumerate(codes) if code not in (None, 0)]
        if failed:
            output.message(f"{TAG}: {describe_exit(failed[0], codes[failed[0]])}; "
                           "stopping all workers")
            return "failed", failed[0], None
        if all(code == 0 for code in codes):
            return "ok", None, None
        if deadline is not None and time.monotonic() >= deadline:
            return "timeout", None, None
        stall = monitor.poll()
        if stall is not None:
            stacks = monitor.show(stall, workers, output)
            output.message(f"{TAG}: stopping all workers")
            return "stalled", stall.behind[0], (stall, stacks)
        time.sleep(POLL_INTERVAL)


def _shell_code(returncode: int) -> int:
    # The shell's convention, so `keras-dist launch`'s exit code says which failure.
    return 128 - returncode if returncode < 0 else returncode
