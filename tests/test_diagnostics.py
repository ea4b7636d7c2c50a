"""StepTimeMonitor and Profiler on two real workers (one run serves both tests)."""

import os

import numpy as np
import pytest

from keras_dist.callbacks.step_time_monitor import summarise
from keras_dist.testing import run_on_workers


def _train_with_diagnostics(log_dir):
    import time

    import keras

    import keras_dist

    strategy = keras_dist.strategy()
    x = np.random.default_rng(0).normal(size=(256, 8)).astype("float32")
    data = keras_dist.distribute_dataset((x, x.sum(axis=1)), per_replica_batch_size=8,
                                         repeat=True)
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")

    class SlowHost(keras.callbacks.Callback):
        # Worker 1 spends 50 ms of host time before every step: the straggler.
        def on_train_batch_begin(self, batch, logs=None):
            if keras_dist.worker_index() == 1:
                time.sleep(0.05)

    lines = []
    monitor = keras_dist.callbacks.StepTimeMonitor(every_n_steps=10, print_fn=lines.append)
    profiler = keras_dist.callbacks.Profiler(log_dir, steps=(3, 4))
    history = model.fit(data, epochs=1, steps_per_epoch=20, verbose=0,
                        callbacks=[SlowHost(), monitor, profiler])
    files = sorted(os.path.relpath(os.path.join(root, name), log_dir)
                   for root, _, names in os.walk(log_dir) for name in names)
    return {"lines": lines, "report": monitor.last_report, "files": files,
            "history": {k: v for k, v in history.history.items() if "worker" in k}}


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    log_dir = str(tmp_path_factory.mktemp("profile"))
    return run_on_workers(_train_with_diagnostics, 2, args=(log_dir,), timeout=240)


@pytest.mark.multiworker
@pytest.mark.timeout(300)
@pytest.mark.slow
def test_step_time_monitor_names_the_worker_that_sleeps_50_ms_per_step(workers):
    chief, other = workers
    assert len(chief["lines"]) == 2 and other["lines"] == []  # the chief reports
    for line in chief["lines"]:
        assert line.startswith("StepTimeMonitor steps ")
        assert "straggler: worker 1 (own time" in line, line
    assert chief["report"]["straggler"] == 1 == other["report"]["straggler"]
    own = chief["report"]["own_p50_ms"]
    assert own[1] > 45 and own[1] > own[0] * 1.2
    assert chief["history"]["straggler_worker"] == [1]
    assert set(chief["history"]) >= {"step_time_p50_ms_worker_0", "own_time_p50_ms_worker_1"}


@pytest.mark.multiworker
@pytest.mark.timeout(300)
@pytest.mark.slow
def test_profiler_writes_a_trace_for_each_worker(workers):
    files = workers[0]["files"]
    for index in (0, 1):
        traces = [f for f in files if f.startswith(f"worker_{index}{os.sep}plugins{os.sep}"
                                                   "profile") and f.endswith(".xplane.pb")]
        assert traces, files


def test_summarise_flags_only_a_worker_slower_than_the_median_by_the_ratio():
    steps = 5
    step = np.array([[60.0] * steps, [10.0] * steps])  # worker 0 waits 50 ms for worker 1
    period = np.full((2, steps), 60.0)
    host = np.array([[0.0] * steps, [50.0] * steps])
    report = summarise(np.stack([step, period, host], axis=-1), 1.2)
    assert report["straggler"] == 1
    assert report["own_p50_ms"] == [10.0, 60.0]
    even = summarise(np.stack([np.full((3, steps), 10.0)] * 3, axis=-1), 1.2)
    assert even["straggler"] is None


@pytest.mark.parametrize("kwargs, fragment", [
    ({"every_n_steps": 0}, "Argument `every_n_steps` must be an integer >= 1"),
    ({"straggler_ratio": 1}, "Argument `straggler_ratio` must be a number > 1"),
])
def test_step_time_monitor_refuses_bad_arguments(kwargs, fragment):
    from keras_dist.callbacks import StepTimeMonitor

    with pytest.raises(ValueError, match=fragment.replace("`", ".")):
        StepTimeMonitor(**kwargs)


@pytest.mark.parametrize("steps", [(0, 2), (3, 2), (1,), "1-2"])
def test_profiler_refuses_bad_steps(steps):
    from keras_dist.callbacks import Profiler

    with pytest.raises(ValueError, match="Argument `steps` must be a pair"):
        Profiler("logs", steps=steps)
