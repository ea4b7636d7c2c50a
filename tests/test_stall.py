"""Stuck workers (issue 39): a worker that is alive but makes no progress is found, named,
its Python stacks shown, and the job restarts and resumes exactly.

The rule and its budgets are checked on records (fast); the heartbeat on a real `fit`
in this process (fast); the rest on real worker groups running tests/workers/ft_train.py
(2 workers, 4 epochs of 8 batches, SGD with momentum, `BackupAndRestore` every epoch),
where one worker gets stuck for good at the end of step 30 (epoch 3, batch 5), sleeping
or in a Python busy loop: under `keras-dist launch`, under no launcher at all (2
processes given their TF_CONFIG by hand, as a scheduler would), and under
`notebook_launcher`; and a slow but progressing run that must not be called a stall.
"""

import io
import math
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from helpers import max_diff
from keras_dist.cluster import make_tf_config
from keras_dist.launching.local import STALL_RETURNCODE, free_ports, launch
from keras_dist.stall.policy import Detector, StallTimeout, stall_timeout

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FT_TRAIN = os.path.join(REPO_ROOT, "tests", "workers", "ft_train.py")
STUCK_AT_STEP_30 = "3:5"  # epoch 3, batch 5 (both 0-based): the end of step 30


def _record(step, events, phase, detail=None, loop="fit", slow=False, slowest=0.01,
            since=0):
    return {"pid": 1, "step": step, "events": events, "events_since_step": since,
            "phase": phase, "detail": detail, "loop": loop, "slow": slow,
            "slowest_step": slowest}


# ---------------------------------------------------------------------------------------
# The rule (no processes)


def test_the_default_is_300_s_for_short_steps_and_grows_with_the_slowest_step():
    default = stall_timeout(environ={})
    assert default.budget(slowest_step=0.05) == 300
    assert default.budget(slowest_step=30) == 600  # 20 x the slowest step
    assert stall_timeout(environ={"KERAS_DIST_STALL_TIMEOUT": "30"}).budget(30) == 30
    assert stall_timeout(12.5, environ={"KERAS_DIST_STALL_TIMEOUT": "30"}).budget() == 12.5
    assert stall_timeout(environ={"KERAS_DIST_STALL_TIMEOUT": "0"}).budget() == math.inf
    # Start-up, tracing, backups: the start-up timeout (KERAS_DIST_STARTUP_TIMEOUT).
    assert default.budget(slow_phase=True) == 600
    assert stall_timeout(30, environ={"KERAS_DIST_STARTUP_TIMEOUT": "90"}).budget(
        slow_phase=True) == 90


def test_a_worker_stuck_in_a_callback_is_named_and_the_one_waiting_for_it_is_not():
    detector = Detector(StallTimeout(30), 2, now=0)
    healthy = _record(30, 200, "collective", "keras_dist's all-gather of worker states",
                      since=2)
    stuck = _record(30, 199, "callbacks", "on_train_batch_end", since=1)
    assert detector.observe({0: healthy, 1: stuck}, now=1) is None
    assert detector.observe({0: healthy, 1: stuck}, now=30.5) is None
    stall = detector.observe({0: healthy, 1: stuck}, now=31.5)
    assert stall.behind == (1,)
    assert stall.message == (
        "worker 1 made no progress for 30 s after step 30 (in callbacks, "
        "on_train_batch_end); worker 0 waits in collective (keras_dist's all-gather of "
        "worker states) after step 30")
    # A worker waiting inside the next step is ahead of one still in the last one's hooks.
    detector = Detector(StallTimeout(30), 2, now=0)
    stall = detector.observe({0: _record(30, 9, "callbacks", "on_epoch_end", since=3),
                              1: _record(30, 12, "train step", since=0)}, now=40)
    assert stall is None  # the first look: that was progress
    stall = detector.observe({0: _record(30, 9, "callbacks", "on_epoch_end", since=3),
                              1: _record(31, 12, "train step", since=0)}, now=80)
    assert stall.behind == (0,) and "worker 1 waits in step 32" in stall.message


def test_progress_evaluation_and_slow_phases_are_not_stalls_and_no_loop_is_never_one():
    detector = Detector(StallTimeout(10), 2, now=0)
    for second in range(1, 100):  # a slow step every 5 s, evaluation included
        step = second // 5
        phase = "evaluation" if step % 4 == 3 else "train step"
        records = {0: _record(step, step * 3, phase), 1: _record(step, step * 3, phase)}
        assert detector.observe(records, now=second) is None
    # A backup save (a slow phase) gets the start-up budget, not 10 s.
    saving = {0: _record(20, 70, "backup save", slow=True),
              1: _record(20, 70, "backup save", slow=True)}
    assert detector.observe(saving, now=200) is None
    assert detector.observe(saving, now=700) is None
    assert detector.observe(saving, now=801).behind == (0, 1)  # both, at one position
    # Outside Keras's loops (a custom training loop, an idle worker) nothing is timed.
    detector = Detector(StallTimeout(10), 2, now=0)
    idle = {0: _record(0, 4, "outside Keras loops", loop=None), 1: None}
    assert detector.observe(idle, now=10_000) is None
    # A worker that never reported while its peer waits in fit: named, in start-up.
    waiting = {0: _record(0, 2, "start-up", "before the first train step", slow=True),
               1: None}
    assert detector.observe(waiting, now=10_001) is None
    stall = detector.observe(waiting, now=10_700)
    assert stall.behind == (1,)
    assert "worker 1 made no progress for 10700 s (in start-up: it has not begun" in (
        stall.message)


def test_fit_reports_its_steps_phases_evaluation_and_backups_in_this_process(tmp_path):
    import keras

    from keras_dist.callbacks import BackupAndRestore
    from keras_dist.stall import progress

    seen = {}

    class Look(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.setdefault("batch_end", progress.current().record())

        def on_test_batch_begin(self, batch, logs=None):
            seen.setdefault("evaluation", progress.current().record())

        def on_epoch_end(self, epoch, logs=None):
            seen["epoch_end"] = progress.current().record()

    class SaveLook(BackupAndRestore):
        def _write(self, epoch, step):
            seen.setdefault("save", progress.current().record())
            super()._write(epoch, step)

    features = np.random.RandomState(0).rand(32, 3).astype("float32")
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    model.fit(features, features[:, :1], batch_size=8, epochs=2, verbose=0,
              validation_data=(features, features[:, :1]),
              callbacks=[Look(), SaveLook(str(tmp_path / "backup"))])
    first = seen["batch_end"]
    assert (first["step"], first["phase"], first["detail"], first["loop"]) == (
        1, "callbacks", "on_train_batch_end", "fit")
    assert first["slow"] is False  # the first batch (tracing) is behind it
    assert (seen["evaluation"]["phase"], seen["evaluation"]["loop"]) == (
        "callbacks", "evaluate")
    assert (seen["save"]["phase"], seen["save"]["slow"]) == ("backup save", True)
    assert seen["epoch_end"]["step"] == 8 and seen["epoch_end"]["slowest_step"] > 0
    after = progress.current().record()
    assert (after["loop"], after["phase"]) == (None, "outside Keras loops")

    # A fit that raises never reaches on_train_end; the process is still outside after it
    # (else an idle worker that caught the error would count as stuck in fit).
    class Raises(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            raise RuntimeError("a callback failed")

    with pytest.raises(RuntimeError, match="a callback failed"):
        model.fit(features, features[:, :1], epochs=1, verbose=0, callbacks=[Raises()])
    after = progress.current().record()
    assert (after["loop"], after["phase"], after["slow"]) == (None, "outside Keras loops",
                                                              False)


# ---------------------------------------------------------------------------------------
# Real worker groups


def _weights(out_dir, worker=0):
    with np.load(os.path.join(out_dir, f"weights-{worker}.npz")) as arrays:
        return [arrays[name] for name in arrays.files]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Final weights of the uninterrupted run."""
    out_dir = str(tmp_path_factory.mktemp("reference"))
    result = launch([sys.executable, FT_TRAIN, out_dir], 2, timeout=240,
                    stdout=io.StringIO(), preload=True)
    assert result.returncode == 0, result.message
    return _weights(out_dir)


class _Timed:
    """A process whose output lines are read as they come, each with its arrival time."""

    def __init__(self, argv, env, timeout):
        self.process = subprocess.Popen(argv, env=env, cwd=REPO_ROOT, text=True,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        start_new_session=True)
        self.lines: list[tuple[float, str]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.timeout = timeout

    def _read(self):
        for line in self.process.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def wait(self):
        try:
            self.process.wait(self.timeout)
        finally:
            if self.process.poll() is None:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
            self._reader.join(10)
        return self.process.returncode

    @property
    def output(self):
        return "\n".join(line for _, line in self.lines)

    def first(self, fragment):
        found = [(at, line) for at, line in self.lines if fragment in line]
        assert found, f"{fragment!r} not in the output:\n{self.output}"
        return found[0]


def _env(**extra):
    return dict(os.environ, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get(
        "PYTHONPATH", ""), TF_CPP_MIN_LOG_LEVEL="2", **extra)


def _launch_stuck(tmp_path, stuck, *flags, env=None):
    out_dir = str(tmp_path)
    run = _Timed([sys.executable, "-m", "keras_dist", "launch", "--preload", "--workers",
                  "2", "--max-restarts", "2", *flags, FT_TRAIN, out_dir, "--backup",
                  str(tmp_path / "backup"), "--stuck", stuck], _env(**(env or {})),
                 timeout=300)
    return run, run.wait(), out_dir


def _check_detected_and_resumed(run, code, out_dir, reference, stuck_worker, how,
                                within):
    stuck_at, _ = run.first(f"worker {stuck_worker} is stuck ({how}) at epoch 3 batch 5")
    found_at, line = run.first("keras-dist launch: stall (no progress for")
    print(f"{line}\ndetected {found_at - stuck_at:.1f} s after the worker got stuck")
    assert code == 0, run.output
    assert found_at - stuck_at < within
    other = 1 - stuck_worker
    assert (f"worker {stuck_worker} made no progress for" in line
            and "after step 30 (in callbacks, on_train_batch_end)" in line
            and f"worker {other} waits in collective" in line), line
    header = (f"keras-dist launch: worker {stuck_worker}'s Python stacks (all threads, "
              "most recent call first):")
    assert header in run.output, run.output
    stacks = run.output.split(header)[1]
    assert "in get_stuck" in stacks and "in on_train_batch_end" in stacks
    assert "keras-dist launch: restarting worker group (restart 1 of 2) after stall:" in (
        run.output)
    assert "BackupAndRestore: resuming at epoch 3 (0-based)" in run.output
    for worker in (0, 1):
        assert max_diff(_weights(out_dir, worker), reference) < 1e-5


@pytest.mark.multiworker
@pytest.mark.slow
@pytest.mark.timeout(360)
def test_launcher_finds_a_sleeping_worker_within_60_s_names_it_and_resumes_exactly(
        tmp_path, reference):
    run, code, out_dir = _launch_stuck(tmp_path, f"1:{STUCK_AT_STEP_30}:sleep",
                                       env={"KERAS_DIST_STALL_TIMEOUT": "30"})
    _check_detected_and_resumed(run, code, out_dir, reference, 1, "sleep", within=60)


@pytest.mark.multiworker
@pytest.mark.slow
@pytest.mark.timeout(360)
def test_launcher_finds_a_spinning_chief_with_the_stall_timeout_flag(tmp_path, reference):
    # 10 s, not 30 (the test above runs the 30): the flag wins over the variable.
    run, code, out_dir = _launch_stuck(tmp_path, f"0:{STUCK_AT_STEP_30}:spin",
                                       "--stall-timeout", "10",
                                       env={"KERAS_DIST_STALL_TIMEOUT": "300"})
    _check_detected_and_resumed(run, code, out_dir, reference, 0, "spin", within=40)


@pytest.mark.multiworker
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_without_the_launcher_both_exit_promptly_and_a_restart_by_hand_resumes(
        tmp_path, reference):
    out_dir, backup = str(tmp_path), str(tmp_path / "backup")

    def start_both(*flags):
        addresses = [f"127.0.0.1:{port}" for port in free_ports(2)]
        return [_Timed([sys.executable, FT_TRAIN, out_dir, "--backup", backup, *flags],
                       _env(TF_CONFIG=make_tf_config(addresses, index),
                            KERAS_DIST_STALL_TIMEOUT="10"), timeout=180)
                for index in range(2)]

    first = start_both("--stuck", f"1:{STUCK_AT_STEP_30}:sleep")
    codes = [run.wait() for run in first]
    stuck_at, _ = first[1].first("worker 1 is stuck (sleep)")
    ended_at = max(run.lines[-1][0] for run in first)
    print(f"both exited {ended_at - stuck_at:.1f} s after worker 1 got stuck; {codes}")
    assert codes == [75, 75], first[0].output + first[1].output
    assert ended_at - stuck_at < 45
    _, named = first[0].first("keras_dist: stall (found by worker")
    assert "worker 1 made no progress for" in named and "worker 0 waits in" in named
    assert "keras_dist: worker 0 stops, as every worker does" in first[0].output
    assert "the stuck one: worker 1" in first[0].output
    own = first[1].output.split("keras_dist: this worker (1) is behind; its Python stacks")[1]
    assert "in get_stuck" in own

    again = start_both()  # restarted by hand, as a scheduler would
    assert [run.wait() for run in again] == [0, 0], again[0].output + again[1].output
    assert "BackupAndRestore: resuming at epoch 3 (0-based)" in again[0].output
    for worker in (0, 1):
        assert max_diff(_weights(out_dir, worker), reference) < 1e-5


def _train_with_a_stuck_worker(stuck_worker):
    import keras

    import keras_dist

    strategy = keras_dist.strategy()

    class Stuck(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 3 and keras_dist.worker_index() == stuck_worker:
                time.sleep(3600)

    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse")
    features = np.ones((64, 4), "float32")
    model.fit(features, features[:, :1], batch_size=8, epochs=1, verbose=0,
              callbacks=[Stuck()])
    return "finished"


@pytest.mark.multiworker
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_notebook_launcher_raises_a_worker_error_naming_the_stuck_worker_with_its_stack():
    import keras_dist

    started = time.monotonic()
    with pytest.raises(keras_dist.WorkerError) as raised:
        keras_dist.notebook_launcher(_train_with_a_stuck_worker, args=(1,), num_workers=2,
                                     stall_timeout=5, preload=True, timeout=150)
    error = raised.value
    print(f"raised after {time.monotonic() - started:.1f} s:\n{error}")
    assert error.worker_index == 1
    assert "notebook_launcher: stall: worker 1 made no progress for" in str(error)
    assert "Python stacks of worker 1 (all threads, most recent call first)" in str(error)
    assert "in on_train_batch_end" in error.traceback_text


@pytest.mark.multiworker
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_slow_but_progressing_run_with_evaluation_and_backups_is_no_stall(tmp_path):
    # Worker 1 takes 1 s more in every step (in a callback); evaluation after every
    # epoch, a backup every 3 steps; a 4-second stall timeout never fires.
    out_dir = str(tmp_path)
    result = launch([sys.executable, FT_TRAIN, out_dir, "--epochs", "2", "--slow", "1:1",
                     "--validate", "--backup", str(tmp_path / "backup"), "--save-freq",
                     "3"], 2, timeout=240, stdout=(output := io.StringIO()), preload=True,
                    stall_timeout=4)
    assert result.returncode == 0 and not result.stalled, output.getvalue()
    assert "stall" not in output.getvalue()
    assert result.stalled_workers == () and STALL_RETURNCODE == 75
