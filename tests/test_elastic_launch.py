"""The launcher's side of elastic training: shrinking instead of stopping, and chaos.

Both run `tests/workers/elastic_train.py` (`tests/elastic_run.train`: shuffled arrays,
global batch 16, Adam on a decaying learning rate, a backup every 5 batches) and compare
with one device, uninterrupted (1e-5). The shrink rule itself is checked without
processes in the fast lane, and through `notebook_launcher` in the slow one.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import keras_dist
from helpers import max_diff

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO_ROOT, "tests", "workers", "elastic_train.py")
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def reference():
    from elastic_run import train

    return train()["weights"]


def _launch(args, timeout=400):
    return subprocess.run(
        [sys.executable, "-m", "keras_dist", "launch", *args], cwd=REPO_ROOT,
        capture_output=True, text=True, timeout=timeout,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(
            [os.path.join(REPO_ROOT, "tests"), os.environ.get("PYTHONPATH", "")])))


def _weights(out_dir):
    with np.load(os.path.join(out_dir, "weights.npz")) as saved:
        return [saved[f"arr_{i}"] for i in range(len(saved.files))]


@pytest.mark.slow
@pytest.mark.multiworker
def test_a_slot_that_cannot_come_back_is_dropped_and_the_run_ends_exactly(tmp_path,
                                                                          reference):
    out, backup = tmp_path / "out", tmp_path / "backup"
    out.mkdir()
    run = _launch(["--preload", "--workers", "2", "--min-workers", "1", "--max-restarts",
                   "3", SCRIPT, str(out), str(backup), "--gone-slot", "1"])
    lines = [line for line in run.stdout.splitlines() if "dropped slot" in line]
    print("launcher:", *lines, sep="\n  ")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert lines == ["keras-dist launch: worker slot 1 failed again before the group came "
                     "up (worker 1 exited with code 1); dropped slot 1, 1 worker(s) continue "
                     "(restart 2 of 3)"]
    assert (out / "workers").read_text() == "1"
    assert "resuming at epoch 1 (0-based), 7 batch(es)" in run.stdout
    diff = max_diff(_weights(out), reference)
    print(f"shrink 2 -> 1 worker, resumed mid-epoch: max |w - w_one_device| = {diff:.2e}")
    assert diff < TOLERANCE


class _BackupWatcher(threading.Thread):
    """Polls the backup folder: whenever it names a backup, that backup is complete."""

    def __init__(self, directory):
        super().__init__(daemon=True)
        self.directory, self.stop, self.checks, self.broken = directory, False, 0, []

    def run(self):
        from keras_dist.checkpointing.files import BackupError, read_backup

        metadata = os.path.join(self.directory, "backup.json")
        while not self.stop:
            before = _read(metadata)
            if before is not None:
                try:
                    read_backup(self.directory)
                    self.checks += 1
                except BackupError as error:
                    # A save that replaced the backup while it was read is no fault.
                    if _read(metadata) == before:
                        self.broken.append(str(error))
            time.sleep(0.02)


# Batches of the run still to train when the chaos monkey strikes, at least (150 ms each).
MARGIN = 3


def _progress(path, process):
    """(batches trained in this attempt, batches of the run left) once the chief wrote
    them (tests/workers/elastic_train.py); None when the launch ended first."""
    while process.poll() is None:
        try:
            trained, left = path.read_text().split()
            return int(trained), int(left)
        except (OSError, ValueError):
            time.sleep(0.02)
    return None


def _read(path):
    try:
        with open(path) as file:
            return json.load(file)
    except (OSError, ValueError):
        return None


@pytest.mark.slow
@pytest.mark.multiworker
def test_chaos_random_kills_end_with_the_uninterrupted_result(tmp_path, reference):
    out, backup = tmp_path / "out", tmp_path / "backup"
    out.mkdir()
    watcher = _BackupWatcher(str(backup))
    watcher.start()
    kills, chaos = [], random.Random(int(os.environ.get("KERAS_DIST_CHAOS_SEED", "5")))

    def monkey():
        # Each attempt: a random worker, at a random batch that leaves at least MARGIN
        # batches of the run to train, so that every kill lands in training (a kill
        # timed by the clock could hit a worker that had already finished).
        while len(kills) < 3 and process.poll() is None:
            attempt = len(kills)  # every kill costs one restart
            progress = _progress(out / f"progress-{attempt}", process)
            if progress is None:
                return  # the run ended
            target = progress[0] + chaos.randint(0, max(0, progress[1] - MARGIN))
            while progress is not None and progress[0] < target:
                time.sleep(0.02)
                progress = _progress(out / f"progress-{attempt}", process)
            victim = out / f"pid-{chaos.randrange(2)}-{attempt}"
            if progress is None or process.poll() is not None:
                return
            os.kill(int(victim.read_text()), signal.SIGKILL)
            kills.append((victim.name, progress[1]))

    process = subprocess.Popen(
        [sys.executable, "-m", "keras_dist", "launch", "--preload", "--workers", "2",
         "--max-restarts", "10", SCRIPT, str(out), str(backup), "--sleep-ms", "150"],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(
            [os.path.join(REPO_ROOT, "tests"), os.environ.get("PYTHONPATH", "")])))
    thread = threading.Thread(target=monkey, daemon=True)
    thread.start()
    output, _ = process.communicate(timeout=600)
    thread.join(timeout=30)
    watcher.stop = True
    watcher.join(timeout=5)
    restarts = output.count("restarting worker group")
    print(f"chaos: {len(kills)} SIGKILLs ({kills}), {restarts} restarts, "
          f"{watcher.checks} backup checks")
    assert process.returncode == 0, output[-4000:]
    assert len(kills) == 3 and restarts == 3, output[-4000:]
    assert all(left >= MARGIN - 1 for _, left in kills), kills
    assert watcher.broken == [] and watcher.checks > 0
    diff = max_diff(_weights(out), reference)
    print(f"chaos: max |w - w_one_device| = {diff:.2e}")
    assert diff < TOLERANCE


# -- the shrink rule through notebook_launcher (no TensorFlow in the workers) --------------
def _slot_one_is_gone():
    import os
    import sys

    if os.environ["KERAS_DIST_SLOT"] == "1":
        sys.exit(1)
    return os.environ["KERAS_DIST_SLOT"], os.environ["KERAS_DIST_RESTART"]


@pytest.mark.slow
@pytest.mark.multiworker
def test_notebook_launcher_shrinks_to_min_workers(capsys):
    values = keras_dist.notebook_launcher(_slot_one_is_gone, num_workers=2, min_workers=1,
                                          max_restarts=3, timeout=120)
    assert values == [("0", "2")]
    assert "dropped slot 1, 1 worker(s) continue (restart 2 of 3)" in capsys.readouterr().out


def test_the_shrink_rule():
    from keras_dist.launching.shrink import Group

    group = Group([0, 1, 2], min_workers=2)
    # A failure during training restarts at full size; the same slot failing again
    # before the group came up is dropped; a slot failing once is retried.
    assert group.after_failure(1, True, 1, 9, "x").startswith("restarting")
    assert "dropped slot 1, 2 worker(s)" in group.after_failure(1, False, 2, 9, "x")
    assert group.slots == [0, 2] and group.dropped == [1]
    assert group.after_failure(1, False, 3, 9, "x").startswith("restarting")  # slot 2
    # At min_workers it never shrinks again.
    assert group.after_failure(1, False, 4, 9, "x").startswith("restarting")
    assert group.slots == [0, 2]
    # Another slot failing before the group came up is not the one that failed before.
    fresh = Group([0, 1], min_workers=1)
    fresh.after_failure(0, True, 1, 9, "x")
    assert fresh.after_failure(1, False, 2, 9, "x").startswith("restarting")
    assert Group([0, 1], min_workers=2).after_failure(1, False, 1, 9, "x").startswith(
        "restarting")
