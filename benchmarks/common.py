"""What the benchmarks share: modes, the seed model, synthetic data, timing, tables, processes.

The orchestrating process (`run.py`) never imports TensorFlow: every measurement runs in
fresh processes (`keras_dist.testing.run_in_subprocess` / `run_on_workers`), because
virtual devices, thread pools and the multi-worker cluster are fixed when TensorFlow
starts. Helpers that need TensorFlow or Keras import them inside, so they are usable in
those workers.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import math
import os
import platform
import statistics
import time
from typing import Any, Callable, Mapping, Sequence

MODES = ("smoke", "quick", "full")

# A collective that has not finished after this long is a hang, not a slow machine.
WORKER_TIMEOUT = 900


def pick(mode: str, *, smoke, quick, full):
    """The setting for `mode` ("smoke": seconds, for tests; "quick": < 5 min in all)."""
    if mode not in MODES:
        raise ValueError(f"Argument `mode` must be one of {list(MODES)}. Received: {mode!r}")
    return {"smoke": smoke, "quick": quick, "full": full}[mode]


# -- the machine --------------------------------------------------------------------------
def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as file:
            for line in file:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_info() -> dict:
    """Date, CPU, core count, load and library versions, for the results' `meta`."""
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "nproc": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
        else os.cpu_count(),
        "cpu_model": cpu_model(),
        "loadavg_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "python": platform.python_version(),
        "tensorflow": _version("tensorflow") or _version("tensorflow-cpu"),
        "keras": _version("keras"),
    }


# -- running measurements in fresh processes ------------------------------------------------
def run_isolated(fn: Callable, *, kwargs: Mapping[str, Any] | None = None,
                 virtual_devices: int | None = None, timeout: float = WORKER_TIMEOUT):
    """`fn(**kwargs)` in one fresh process (no TF_CONFIG); returns its value."""
    from keras_dist.testing import run_in_subprocess

    return run_in_subprocess(fn, kwargs=kwargs, virtual_devices=virtual_devices,
                             timeout=timeout)


def run_workers(fn: Callable, num_workers: int, *, kwargs: Mapping[str, Any] | None = None,
                timeout: float = WORKER_TIMEOUT, virtual_devices: int | None = None) -> list:
    """`fn(**kwargs)` on `num_workers` launched local workers; returns their values."""
    from keras_dist.testing import run_on_workers

    return run_on_workers(fn, num_workers, kwargs=kwargs, timeout=timeout,
                          virtual_devices=virtual_devices)


def pin_threads(intra_op: int | None, inter_op: int | None) -> None:
    """Sizes TensorFlow's thread pools; must run before the runtime starts."""
    import tensorflow as tf

    if intra_op:
        tf.config.threading.set_intra_op_parallelism_threads(intra_op)
    if inter_op:
        tf.config.threading.set_inter_op_parallelism_threads(inter_op)


# -- models and data -----------------------------------------------------------------------
def synthetic_classification(examples: int, features: int, classes: int = 10, seed: int = 0):
    """Random float32 features and int32 labels (the benchmarks measure speed, not accuracy)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    x = rng.random((examples, features), dtype=np.float32)
    y = rng.integers(0, classes, size=(examples,), dtype=np.int32)
    return x, y


def mlp(features: int, hidden: Sequence[int], classes: int = 10, seed: int = 0,
        optimizer: str = "sgd", learning_rate: float = 0.01):
    """A compiled ReLU MLP; build it inside `strategy.scope()`.

    `mlp(784, [100])` is the seed model: the classic tf.distribute MNIST MLP.
    """
    import keras

    keras.utils.set_random_seed(seed)
    layers = [keras.Input((features,))]
    layers += [keras.layers.Dense(width, activation="relu") for width in hidden]
    layers.append(keras.layers.Dense(classes))
    model = keras.Sequential(layers)
    opt = (keras.optimizers.SGD(learning_rate) if optimizer == "sgd"
           else keras.optimizers.get(optimizer))
    model.compile(optimizer=opt,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def seed_pipeline(x, y, global_batch: int, shuffle_buffer: int | None = None):
    """The seed's input: `from_tensor_slices().shuffle().batch().repeat()`."""
    import tensorflow as tf

    dataset = tf.data.Dataset.from_tensor_slices((x, y))
    if shuffle_buffer:
        dataset = dataset.shuffle(shuffle_buffer, seed=0)
    return dataset.batch(global_batch).repeat()


def gradient_aggregation(**kwargs):
    """`keras_dist.callbacks.GradientAggregation(**kwargs)`; returns (callback, how)."""
    from keras_dist.callbacks import GradientAggregation

    return GradientAggregation(**kwargs), "keras_dist.callbacks.GradientAggregation"


# -- timing ----------------------------------------------------------------------------------
def step_clock():
    """A Keras callback that records the time at the end of every training batch."""
    import keras

    class StepClock(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.times: list[float] = []

        def on_train_begin(self, logs=None):
            self.times = []

        def on_train_batch_end(self, batch, logs=None):
            self.times.append(time.perf_counter())

    return StepClock()


def timed_fit(model, data, steps: int, callbacks: Sequence = ()) -> dict:
    """Runs `fit` for `steps` steps; returns steady-state and wall seconds per step.

    Steady state is timed from the end of the first step to the end of the last, so the
    iterator's start (shuffle buffer fill, prefetch) and the fit set-up are left out; the
    wall figure keeps them.
    """
    clock = step_clock()
    start = time.perf_counter()
    model.fit(data, epochs=1, steps_per_epoch=steps, verbose=0, shuffle=False,
              callbacks=[*callbacks, clock])
    wall = time.perf_counter() - start
    times = clock.times
    steady = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else wall
    return {"step_s": steady, "wall_step_s": wall / steps}


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def ratio(numerator: float, denominator: float) -> float:
    return float(numerator / denominator) if denominator else math.nan


# -- printing ----------------------------------------------------------------------------------
def format_bytes(size: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(size) < 1024 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" or size == int(size) else \
                f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GB"


def _cell(value) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "n/a"
        if value == 0 or 0.01 <= abs(value) < 1e5:
            return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
        return f"{value:.3g}"
    return str(value)


def table(title: str, headers: Sequence[str], rows: Sequence[Sequence]) -> str:
    """A plain-text table with a title line, right-aligned numbers."""
    cells = [[_cell(value) for value in row] for row in rows]
    widths = [max(len(str(h)), *(len(r[i]) for r in cells)) if cells else len(str(h))
              for i, h in enumerate(headers)]
    lines = [title, "  ".join(str(h).rjust(w) for h, w in zip(headers, widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def print_table(title: str, headers: Sequence[str], rows: Sequence[Sequence]) -> None:
    print("\n" + table(title, headers, rows), flush=True)


class RssSampler:
    """The process's peak resident set while a `with` block runs (sampled every 5 ms)."""

    def __init__(self):
        import psutil

        self._process = psutil.Process()
        self.peak = 0

    def __enter__(self):
        import threading

        self.start = self._process.memory_info().rss
        self.peak = self.start
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self._process.memory_info().rss)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._process.memory_info().rss)
