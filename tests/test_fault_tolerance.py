"""Real failures of real worker groups under `keras-dist launch`.

All runs use tests/workers/ft_train.py (2 workers, 4 epochs of 8 deterministic batches,
SGD with momentum): a worker killed with SIGKILL during `fit`, a worker crashing in
epoch 2 with `--max-restarts 1`, and SIGTERM to one worker. The interrupted runs must end
with the weights of the uninterrupted reference run.
"""

import io
import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import psutil
import pytest

from keras_dist.launching.local import launch
from helpers import max_diff

pytestmark = pytest.mark.multiworker

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FT_TRAIN = os.path.join(REPO_ROOT, "tests", "workers", "ft_train.py")
EPOCHS = 4


def _cli(*args):
    """Starts `keras-dist launch ...` as a user would, with its own process group."""
    env = dict(os.environ, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen(
        [sys.executable, "-m", "keras_dist", "launch", *args], stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO_ROOT,
        start_new_session=True,
    )


def _wait_for(path, process=None, timeout=120):
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if process is not None and process.poll() is not None:
            pytest.fail(f"the launcher exited ({process.returncode}) before {path} appeared:"
                        f"\n{process.stdout.read()}")
        assert time.monotonic() < deadline, f"{path} did not appear within {timeout} s"
        time.sleep(0.05)


def _pids(out_dir):
    pids = {}
    for name in os.listdir(out_dir):
        if name.startswith("pid-"):
            with open(os.path.join(out_dir, name)) as file:
                pids[name] = int(file.read())
    return pids


def _assert_gone(pids):
    deadline = time.monotonic() + 5
    def alive(pid):
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False
    while any(alive(pid) for pid in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [name for name, pid in pids.items() if alive(pid)], "workers left behind"


def _weights(out_dir, worker=0):
    with np.load(os.path.join(out_dir, f"weights-{worker}.npz")) as arrays:
        return [arrays[name] for name in arrays.files]


def _epochs_log(out_dir, worker=0):
    with open(os.path.join(out_dir, f"epochs-{worker}.txt")) as file:
        return [tuple(int(word) for word in line.split()[1::2]) for line in file]


def _metadata(backup_dir):
    with open(os.path.join(backup_dir, "backup.json")) as file:
        return json.load(file)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Final weights of the uninterrupted run."""
    out_dir = str(tmp_path_factory.mktemp("reference"))
    result = launch([sys.executable, FT_TRAIN, out_dir, "--epochs", str(EPOCHS)], 2,
                    timeout=240, stdout=io.StringIO(), preload=True)
    assert result.returncode == 0, result.message
    weights = _weights(out_dir)
    assert max_diff(weights, _weights(out_dir, 1)) == 0.0  # workers in sync
    return weights


@pytest.mark.timeout(180)
def test_kill_9_of_one_worker_stops_the_group_fast_and_names_it(tmp_path):
    out_dir = str(tmp_path)
    launcher = _cli("--workers", "2", FT_TRAIN, out_dir, "--backup", str(tmp_path / "backup"),
                    "--pause", "1:1:0")
    try:
        _wait_for(os.path.join(out_dir, "paused-1"), launcher)  # inside fit, epoch 1
        pids = _pids(out_dir)
        os.kill(pids["pid-1-0"], signal.SIGKILL)
        killed_at = time.monotonic()
        output, _ = launcher.communicate(timeout=60)
        detected_after = time.monotonic() - killed_at
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    print(f"launcher exited {detected_after:.2f} s after the kill")
    assert launcher.returncode == 128 + signal.SIGKILL
    assert "keras-dist launch: worker 1 was killed by signal SIGKILL (9)" in output
    assert detected_after < 60
    _assert_gone(pids)


@pytest.mark.timeout(180)
@pytest.mark.slow
def test_a_stuck_peer_is_an_error_with_a_collective_timeout(tmp_path):
    # Worker 1 stays alive but stops taking part (paused in a callback for up to 60 s);
    # heartbeats still arrive, so only the collective timeout can end the wait.
    out_dir = str(tmp_path)
    launcher = _cli("--workers", "2", FT_TRAIN, out_dir, "--collective-timeout", "10",
                    "--pause", "1:1:0")
    try:
        _wait_for(os.path.join(out_dir, "paused-1"), launcher)
        paused_at = time.monotonic()
        output, _ = launcher.communicate(timeout=60)
        stopped_after = time.monotonic() - paused_at
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    print(f"stuck peer: the group stopped {stopped_after:.1f} s after the pause")
    assert launcher.returncode == 1
    assert "keras-dist launch: worker 0 exited with code 1" in output
    assert "Collective has timed out" in output
    assert 10 <= stopped_after < 50
    _assert_gone(_pids(out_dir))


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_crash_with_max_restarts_resumes_from_the_backup(tmp_path, reference):
    out_dir = str(tmp_path)
    launcher = _cli("--preload", "--workers", "2", "--max-restarts", "1", FT_TRAIN, out_dir,
                    "--epochs", str(EPOCHS), "--backup", str(tmp_path / "backup"),
                    "--crash", "1:2:0")
    try:
        output, _ = launcher.communicate(timeout=240)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    assert launcher.returncode == 0, output
    assert "worker 1 crashing at epoch 2 batch 0" in output
    assert "restarting worker group (restart 1 of 1) after worker 1 exited with code 3" in output
    assert "BackupAndRestore: resuming at epoch 2 (0-based), 0 batch(es) into it" in output
    for worker in (0, 1):
        assert _epochs_log(out_dir, worker) == [(0, 0), (0, 1), (0, 2), (1, 2), (1, 3)]
    difference = max_diff(_weights(out_dir), reference)
    print(f"max |weights - uninterrupted| = {difference:g}")
    assert difference < 1e-6
    assert not os.path.exists(tmp_path / "backup")  # deleted after the successful run
    _assert_gone(_pids(out_dir))


def _launch_in_thread(argv, timeout):
    box = {}

    def run():
        box["output"] = io.StringIO()
        # A long grace period: the assertion is about how the workers exit, not about
        # how fast a loaded machine shuts TensorFlow down.
        box["result"] = launch(argv, 2, timeout=timeout, stdout=box["output"],
                               grace_period=60, preload=True)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_sigterm_to_one_worker_saves_on_all_and_a_restart_resumes(tmp_path, reference):
    out_dir, backup_dir = str(tmp_path), str(tmp_path / "backup")
    argv = [sys.executable, FT_TRAIN, out_dir, "--epochs", str(EPOCHS), "--backup", backup_dir]
    thread, box = _launch_in_thread(argv + ["--pause", "1:1:3"], timeout=180)
    _wait_for(os.path.join(out_dir, "paused-1"))
    os.kill(_pids(out_dir)["pid-1-0"], signal.SIGTERM)
    open(os.path.join(out_dir, "go"), "w").close()
    thread.join(200)
    result, output = box["result"], box["output"].getvalue()

    # Both workers stopped after the same step, saved, and exited with 128 + SIGTERM.
    assert result.worker_returncodes == (143, 143), output
    for worker in (0, 1):
        assert (f"[worker {worker}] BackupAndRestore: worker {worker}: SIGTERM on worker(s) "
                "[1]; backup saved at epoch 1 (0-based), 4 batch(es) into it; stopping"
                ) in output
    saved = _metadata(backup_dir)
    assert (saved["epoch"], saved["step"], saved["num_workers"]) == (1, 4, 2)
    assert sorted(os.listdir(backup_dir)) == sorted(saved["files"])
    assert not os.path.exists(os.path.join(out_dir, "weights-0.npz"))  # fit did not finish

    # Started again (as a scheduler would), the group resumes mid-epoch 1.
    result = launch(argv, 2, timeout=180, stdout=io.StringIO(), preload=True)
    assert result.returncode == 0, result.message
    assert _epochs_log(out_dir) == [(0, 0), (0, 1), (0, 1), (0, 2), (0, 3)]
    difference = max_diff(_weights(out_dir), reference)
    print(f"max |weights - uninterrupted| = {difference:g}")
    assert difference < 1e-6
    _assert_gone(_pids(out_dir))
