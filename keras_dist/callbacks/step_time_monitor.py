"""`StepTimeMonitor`: each worker's step time and own time, gathered; the straggler named.

In synchronous data parallelism every worker's step ends at the same all-reduce, so a slow
worker does not show a longer step: the *others* do, waiting for it inside the step. What
tells the straggler is the time each worker spends *not* waiting for the others: its
period (batch start to batch start) minus its wait, where a worker's wait in a step is how
much longer its step took than the shortest step of that step on any worker. The monitor
measures, per worker and step, on the host:

* `step`: `on_train_batch_begin` -> `on_train_batch_end` (the train function: input taken
  from a tf.data pipeline inside it, compute, all-reduce, waiting for peers);
* `host`: the previous batch's end -> this batch's begin (Python-side input, callbacks);
* `own`: period minus wait, as above.

Every `every_n_steps` steps (and at an epoch's end) the rows are all-gathered (every
worker calls the collective at the same step), and the chief prints p50/p95 per worker and
names a worker whose p50 own time exceeds the median over workers by `straggler_ratio`.
Slowness inside the train function of one worker (a slow device, a slow tf.data map)
cannot be told apart from waiting by host timers; `keras_dist.callbacks.Profiler` shows it.
"""

from __future__ import annotations

import time

import numpy as np

from keras_dist import _validation
from keras_dist.callbacks.base import Callback

__all__ = ["StepTimeMonitor"]


class StepTimeMonitor(Callback):
    """Logs each worker's step time percentiles and names a straggler (from the chief).

    Put it in the same place of the callbacks list on every worker (it runs a
    collective), after callbacks that do work in `on_train_batch_begin`, and before
    `TensorBoard`, which then writes its epoch scalars (`step_time_p50_ms_worker_<i>`,
    `own_time_p50_ms_worker_<i>`, `straggler_worker`: -1 when none).

    Args:
        every_n_steps: Gather and report every this many steps (>= 1).
        straggler_ratio: A worker whose median own time exceeds the median over all
            workers by this factor (> 1) is named a straggler.
        print_fn: Where the chief's report lines go (default `print`).

    Attributes:
        last_report: The last report, a dict with per-worker `step_p50_ms`,
            `step_p95_ms`, `host_p50_ms`, `own_p50_ms` lists and `straggler` (or None).

    Example:
        >>> model.fit(data, epochs=3, callbacks=[
        ...     keras_dist.callbacks.StepTimeMonitor(every_n_steps=50)])
        StepTimeMonitor steps 1-50: worker 0 step p50 12.1 ms p95 14.0 ms own 11.8 ms ...
    """

    def __init__(self, every_n_steps: int = 50, straggler_ratio: float = 1.2,
                 print_fn=print):
        super().__init__()
        self.every_n_steps = _validation.check_int("every_n_steps", every_n_steps, 1)
        self.straggler_ratio = _validation.check_number("straggler_ratio", straggler_ratio,
                                                        minimum=1)
        self.print_fn = print_fn
        self.last_report: dict | None = None
        self._rows: list[tuple[int, int, int]] = []
        self._begin = self._previous_begin = self._previous_end = None
        self._first_step = 1
        self._steps = 0

    def on_train_begin(self, logs=None):
        self._rows, self._steps, self._first_step = [], 0, 1
        self._previous_begin = self._previous_end = None

    def on_train_batch_begin(self, batch, logs=None):
        self._begin = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        end = time.perf_counter()
        step = end - self._begin
        period = step if self._previous_begin is None else self._begin - self._previous_begin
        host = 0.0 if self._previous_end is None else self._begin - self._previous_end
        self._previous_begin, self._previous_end = self._begin, end
        self._rows.append(tuple(int(v * 1e6) for v in (step, period, host)))
        self._steps += 1
        if len(self._rows) >= self.every_n_steps:
            self._report()

    def on_epoch_end(self, epoch, logs=None):
        if self._rows:
            self._report()
        if logs is not None and self.last_report is not None:
            report = self.last_report
            for index, (step, own) in enumerate(zip(report["step_p50_ms"],
                                                    report["own_p50_ms"])):
                logs[f"step_time_p50_ms_worker_{index}"] = step
                logs[f"own_time_p50_ms_worker_{index}"] = own
            straggler = report["straggler"]
            logs["straggler_worker"] = -1 if straggler is None else straggler

    def _report(self) -> None:
        rows, self._rows = np.asarray(self._rows, dtype=np.int64), []
        per_worker = self._gather(rows)  # (workers, steps, 3) in microseconds
        report = summarise(per_worker / 1e3, self.straggler_ratio)
        self.last_report = report
        first, self._first_step = self._first_step, self._steps + 1
        from keras_dist import cluster

        if cluster.is_chief():
            self.print_fn(format_report(report, first, self._steps, self.straggler_ratio))

    def _gather(self, rows: np.ndarray) -> np.ndarray:
        from keras_dist.checkpointing import preemption
        from keras_dist.strategies import resolve_strategy

        strategy = resolve_strategy()
        if not preemption.is_multi_worker(strategy):
            return rows[None]
        gathered = preemption.gather_rows(strategy, rows.reshape(-1))
        return gathered.reshape(gathered.shape[0], -1, 3)


def summarise(per_worker_ms: np.ndarray, straggler_ratio: float) -> dict:
    """Percentiles per worker and the straggler, from `(workers, steps, 3)` milliseconds."""
    step, period, host = (per_worker_ms[..., i] for i in range(3))
    wait = step - step.min(axis=0, keepdims=True)  # how long each waited for the slowest
    own = period - wait
    own_p50 = np.percentile(own, 50, axis=1)
    median = float(np.median(own_p50))
    candidates = [i for i, value in enumerate(own_p50)
                  if len(own_p50) > 1 and value > median * straggler_ratio]
    straggler = max(candidates, key=lambda i: own_p50[i]) if candidates else None
    return {
        "step_p50_ms": [float(v) for v in np.percentile(step, 50, axis=1)],
        "step_p95_ms": [float(v) for v in np.percentile(step, 95, axis=1)],
        "host_p50_ms": [float(v) for v in np.percentile(host, 50, axis=1)],
        "own_p50_ms": [float(v) for v in own_p50],
        "median_own_ms": median,
        "straggler": straggler,
    }


def format_report(report: dict, first: int, last: int, ratio: float) -> str:
    workers = " | ".join(
        f"worker {i} step p50 {p50:.1f} ms p95 {p95:.1f} ms own {own:.1f} ms host "
        f"{host:.1f} ms"
        for i, (p50, p95, own, host) in enumerate(zip(
            report["step_p50_ms"], report["step_p95_ms"], report["own_p50_ms"],
            report["host_p50_ms"])))
    straggler = report["straggler"]
    if straggler is None:
        verdict = "no straggler"
    else:
        own = report["own_p50_ms"][straggler]
        verdict = (f"straggler: worker {straggler} (own time {own:.1f} ms = "
                   f"{own / max(report['median_own_ms'], 1e-9):.2f}x the median "
                   f"{report['median_own_ms']:.1f} ms, threshold {ratio:g}x)")
    return f"StepTimeMonitor steps {first}-{last}: {workers}; {verdict}"
