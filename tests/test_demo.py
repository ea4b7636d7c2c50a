"""`keras-dist demo`: real training on 2 launched workers with the embedded digits data."""

import re
import subprocess
import sys

import pytest


@pytest.mark.multiworker
@pytest.mark.timeout(300)
@pytest.mark.slow
def test_demo_trains_on_two_workers_and_reports_from_the_chief_only():
    completed = subprocess.run(
        [sys.executable, "-m", "keras_dist", "demo", "--workers", "2", "--epochs", "4"],
        capture_output=True, text=True, timeout=280,
    )
    output = completed.stdout + completed.stderr
    assert completed.returncode == 0, output[-3000:]
    epochs = re.findall(r"\[worker (\d)\] epoch (\d)/4: loss=([\d.]+) accuracy=([\d.]+)", output)
    assert [int(e[1]) for e in epochs] == [1, 2, 3, 4]
    assert {e[0] for e in epochs} == {"0"}, "per-epoch lines come from the chief only"
    losses = [float(e[2]) for e in epochs]
    assert losses[-1] < losses[0]
    final = re.search(r"demo: test accuracy ([\d.]+).*\| 2 worker\(s\), 2 replica\(s\)", output)
    assert final, output[-3000:]
    assert float(final.group(1)) > 0.85
    # Quiet by default: no TensorFlow start-up chatter, no Keras shuffle warning.
    for noise in NOISE:
        assert noise not in output, output[-3000:]


NOISE = ("absl::InitializeLog()", "cudart_stub", "cuInit", "oneDNN",
         "`shuffle=True` was passed")


@pytest.mark.timeout(300)
@pytest.mark.multiworker
@pytest.mark.slow
def test_demo_verbose_brings_tensorflows_start_up_logs_back():
    completed = subprocess.run(
        [sys.executable, "-m", "keras_dist", "demo", "--workers", "1", "--epochs", "1",
         "--verbose"],
        capture_output=True, text=True, timeout=280,
    )
    output = completed.stdout + completed.stderr
    assert completed.returncode == 0, output[-3000:]
    assert "[worker 0] WARNING: All log messages before absl::InitializeLog()" in output
    assert "`shuffle=True` was passed" in output


@pytest.mark.multiworker
def test_demo_rejects_bad_arguments():
    completed = subprocess.run(
        [sys.executable, "-m", "keras_dist", "demo", "--workers", "0"],
        capture_output=True, text=True, timeout=60,
    )
    assert completed.returncode == 2
    assert "--workers" in completed.stderr and ">= 1" in completed.stderr
