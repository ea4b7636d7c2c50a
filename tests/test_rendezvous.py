"""Start-up that never hangs: missing peers, duplicate task index, port in use, SIGTERM.

Real processes, each given its TF_CONFIG by hand as a scheduler would (the launcher never
produces these mistakes), each calling `keras_dist.strategy()`.
"""

import os
import re
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest

from keras_dist.cluster import make_tf_config
from keras_dist.launching.local import free_ports

pytestmark = pytest.mark.multiworker

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
START = os.path.join(REPO_ROOT, "tests", "workers", "start_strategy.py")


@pytest.fixture
def start():
    processes = []

    def start_worker(addresses, index, *flags):
        env = dict(os.environ, PYTHONPATH=REPO_ROOT, TF_CPP_MIN_LOG_LEVEL="2",
                   TF_CONFIG=make_tf_config(addresses, index))
        process = subprocess.Popen([sys.executable, START, *flags], env=env, text=True,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        processes.append(process)
        return process

    yield start_worker
    for process in processes:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def _wait_listening(process, port, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, process.stdout.read()
        try:
            if any(c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN
                   for c in psutil.Process(process.pid).net_connections("tcp")):
                return
        except psutil.Error:
            pass
        time.sleep(0.1)
    raise AssertionError(f"worker never listened on {port}")


def _finish(process, timeout=100):
    output, _ = process.communicate(timeout=timeout)
    seconds = re.search(r"(\w+) after ([\d.]+) s", output)
    return process.returncode, output, seconds and float(seconds.group(2))


# "--op-first": a TensorFlow op before keras_dist.strategy() (data before strategy) starts
# the server, so the wait for peers happens at that op; it must keep the same guarantees.
@pytest.mark.multiworker
@pytest.mark.timeout(150)
@pytest.mark.parametrize("order", ["strategy", pytest.param("--op-first", marks=pytest.mark.slow)])
def test_a_missing_peer_is_named_when_the_startup_timeout_ends(start, monkeypatch, order):
    addresses = [f"127.0.0.1:{port}" for port in free_ports(2)]
    if order == "strategy":
        worker = start(addresses, 0, "--startup-timeout", "3")
    else:  # no strategy() argument reaches the first op: the environment variable does
        monkeypatch.setenv("KERAS_DIST_STARTUP_TIMEOUT", "3")
        worker = start(addresses, 0, order)
    code, output, seconds = _finish(worker)
    assert code == 1, output
    assert "StartupError" in output
    assert f"these never joined: worker 1 at {addresses[1]} (never answered: connection " \
           "refused" in output
    assert "KERAS_DIST_STARTUP_TIMEOUT" in output
    assert 3 <= seconds < 6
    if order == "--op-first":
        assert "TensorFlow's first op" in output and "calling keras_dist.strategy()" \
            not in output
    print(f"missing peer ({order}): StartupError {seconds} s after start (timeout 3 s)")


@pytest.mark.multiworker
@pytest.mark.timeout(150)
@pytest.mark.slow
def test_a_duplicate_task_index_fails_fast_on_both_processes(start):
    addresses = [f"127.0.0.1:{port}" for port in free_ports(2)]
    first = start(addresses, 0)
    _wait_listening(first, int(addresses[0].rsplit(":", 1)[1]))
    second = start(addresses, 0)
    for process in (second, first):
        code, output, seconds = _finish(process)
        assert code == 1, output
        assert "Two processes were started as worker 0 (the same TF_CONFIG task index)" \
            in output
        assert f"pid {first.pid}" in output and f"pid {second.pid}" in output
        # The first waited for the second to start (an import of TensorFlow: slow when busy).
        assert seconds is not None and seconds < 90
        print(f"duplicate index: pid {process.pid} failed {seconds} s after strategy()")


@pytest.mark.multiworker
@pytest.mark.timeout(150)
@pytest.mark.slow
def test_a_port_in_use_fails_fast_and_stops_the_peers(start):
    addresses = [f"127.0.0.1:{port}" for port in free_ports(2)]
    port = int(addresses[0].rsplit(":", 1)[1])
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", port))
        squatter.listen()
        peer = start(addresses, 1)
        _wait_listening(peer, int(addresses[1].rsplit(":", 1)[1]))
        code, output, seconds = _finish(start(addresses, 0))
        assert code == 1, output
        assert f"port {port} of {addresses[0]}, this task's (worker 0) address in " \
               "TF_CONFIG, is already in use" in output
        assert seconds < 5
        print(f"port in use: StartupError {seconds} s after strategy()")
        code, output, _ = _finish(peer, timeout=20)
    assert code == 1, output
    assert "worker 0 (pid" in output and "could not start, so worker 1 stops too" in output


@pytest.mark.multiworker
@pytest.mark.timeout(150)
@pytest.mark.parametrize("order", ["strategy", "--op-first"])
@pytest.mark.slow
def test_sigterm_while_waiting_for_peers_ends_the_process(start, order):
    addresses = [f"127.0.0.1:{port}" for port in free_ports(2)]
    # A SIGTERM handler that only records the signal, as TensorFlow's preemption one.
    flags = ("--record-sigterm",) + ((order,) if order != "strategy" else ())
    waiting = start(addresses, 0, *flags)
    _wait_listening(waiting, int(addresses[0].rsplit(":", 1)[1]))
    signalled = time.monotonic()
    waiting.send_signal(signal.SIGTERM)
    code, output, _ = _finish(waiting, timeout=10)
    assert time.monotonic() - signalled < 10
    print(f"SIGTERM while waiting ({order}): exited {time.monotonic() - signalled:.2f} s "
          "after it")
    assert code == 128 + signal.SIGTERM, output
    assert f"SIGTERM while worker 0 waited for worker 1 at {addresses[1]}; exiting" in output
    assert not _left_behind(waiting)


@pytest.mark.multiworker
@pytest.mark.timeout(150)
@pytest.mark.slow
def test_sigterm_ends_a_worker_blocked_in_a_collective_whose_peer_is_gone(start):
    # Worker 0 records SIGTERM (as TensorFlow's preemption handler does) and sits in an
    # all-reduce that worker 1 never joins: the handler cannot run, the worker still ends.
    addresses = [f"127.0.0.1:{port}" for port in free_ports(2)]
    blocked = start(addresses, 0, "--record-sigterm", "--collective")
    gone = start(addresses, 1, "--collective")
    assert gone.wait(timeout=100) == 1, gone.stdout.read()
    for line in blocked.stdout:
        if "worker 0 enters the all-reduce" in line:
            break
    time.sleep(1)  # inside the collective
    signalled = time.monotonic()
    blocked.send_signal(signal.SIGTERM)
    code, output, _ = _finish(blocked, timeout=20)
    seconds = time.monotonic() - signalled
    print(f"SIGTERM in a collective: exited {seconds:.2f} s after it")
    assert code == 128 + signal.SIGTERM, output
    assert "SIGTERM while worker 0 was blocked in TensorFlow (a collective op waiting for " \
           f"{addresses[1]}" in output
    assert seconds < 5
    assert not _left_behind(blocked)


def _left_behind(process):
    return [p for p in psutil.process_iter() if _group(p) == process.pid]


def _group(process):
    try:
        return os.getpgid(process.pid)
    except OSError:
        return None
