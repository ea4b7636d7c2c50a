"""`keras-dist doctor`: is this installation able to train on several workers?

One line per check, `[ ok ]` or `[FAIL]`, exit code 1 when any check failed (like
`accelerate test`): versions; the cluster this environment describes (TF_CONFIG, Slurm
or none) and whether it is valid; then, in a 2-worker loopback self-test started through
`keras_dist.testing.run_on_workers`: the devices, which compat fixes apply and why, the
strategy, an all-reduce (value and bus bandwidth) and a 3-step `fit`. The self-test runs
in fresh workers with their own TF_CONFIG, so it never joins the user's cluster, and this
process never starts a TensorFlow runtime (under a multi-worker TF_CONFIG its first op
would wait for the peers).
"""

from __future__ import annotations

import importlib.metadata
import platform
from typing import Callable

__all__ = ["main", "self_test"]

_ALLREDUCE_BYTES = 4 << 20
_ALLREDUCE_REPEATS = 5
_SELF_TEST_TIMEOUT = 240


def main(self_test_workers: int = 2, run_self_test: bool = True,
         write: Callable[[str], None] = print) -> int:
    """Runs every check, writes one line each; returns 0 when all passed, else 1."""
    failures = 0

    def report(ok: bool, what: str) -> None:
        nonlocal failures
        failures += not ok
        write(f"[{' ok ' if ok else 'FAIL'}] {what}")

    for line in _versions():
        report(*line)
    report(*_cluster())
    if run_self_test:
        for line in _self_test_lines(self_test_workers):
            report(*line)
    write("keras-dist doctor: " + ("all checks passed" if not failures
                                   else f"{failures} check(s) failed"))
    return 1 if failures else 0


def _versions():
    yield True, f"python {platform.python_version()} ({platform.platform()})"
    for package in ("tensorflow", "keras", "keras-dist"):
        try:
            yield True, f"{package} {importlib.metadata.version(package)}"
        except importlib.metadata.PackageNotFoundError:
            yield False, f"{package}: not installed (pip install {package})"


def _cluster():
    from keras_dist.cluster import ClusterConfig, ClusterConfigError

    try:
        cluster = ClusterConfig.from_env()
    except ClusterConfigError as error:
        return False, f"cluster: invalid: {error}"
    if cluster.source == "none":
        return True, "cluster: none configured (one process; TF_CONFIG and Slurm unset)"
    return True, (f"cluster: {cluster.source}, {cluster.num_workers} worker(s), this is "
                  f"{cluster.task_type}:{cluster.task_index} (chief={cluster.is_chief})")


def _self_test_lines(num_workers: int):
    from keras_dist.testing import WorkerError, run_on_workers

    try:
        results = run_on_workers(self_test, num_workers, timeout=_SELF_TEST_TIMEOUT)
    except (WorkerError, TimeoutError) as error:
        yield False, f"self-test ({num_workers} workers on 127.0.0.1): {error}"
        return
    chief = results[0]
    yield True, f"devices: {chief['devices']}"
    for name, (verdict, upstream) in chief["fixes"].items():
        why = {"present": "applies: the bug is present", "fixed": "not needed: fixed "
               "upstream", "unknown": "applies: cannot tell, harmless if fixed"}[verdict]
        yield True, f"compat fix {name}: {why} ({upstream})"
    replicas = [r["replicas"] for r in results]
    yield (replicas == [num_workers] * num_workers,
           f"self-test strategy: {chief['strategy']}, {replicas[0]} replica(s) in sync "
           f"on {num_workers} workers")
    sums = [r["all_reduce_sum"] for r in results]
    expected = float(sum(range(1, num_workers + 1)))
    yield (all(s == expected for s in sums),
           f"self-test all-reduce: sum {sums[0]:g} (expected {expected:g}), "
           f"{_ALLREDUCE_BYTES >> 20} MiB in {min(r['seconds'] for r in results) * 1e3:.1f} ms"
           f", bus bandwidth {min(r['bus_gbps'] for r in results):.2f} GB/s")
    losses = [r["fit_loss"] for r in results]
    yield (all(loss == loss and loss < 1e6 for loss in losses),
           f"self-test fit: 3 steps, loss {losses[0]:.4f}")


def self_test() -> dict:
    """One worker's part of the self-test (runs under run_on_workers)."""
    import time

    import keras
    import numpy as np
    import tensorflow as tf

    import keras_dist
    from keras_dist import compat

    strategy = keras_dist.strategy()
    contribution = float(keras_dist.worker_index() + 1)

    @tf.function
    def all_reduce():
        value = tf.fill([_ALLREDUCE_BYTES // 4], contribution)
        return tf.distribute.get_replica_context().all_reduce("sum", value)

    def timed_all_reduce():
        result = strategy.experimental_local_results(strategy.run(all_reduce))
        return float(result[0][0].numpy())

    total = timed_all_reduce()  # traces and warms up the collective
    started = time.perf_counter()
    for _ in range(_ALLREDUCE_REPEATS):
        timed_all_reduce()
    seconds = (time.perf_counter() - started) / _ALLREDUCE_REPEATS
    workers = keras_dist.num_workers()
    # Bus bandwidth, as nccl-tests reports it: a ring moves 2 (n-1)/n of the data.
    bus_gbps = _ALLREDUCE_BYTES * 2 * (workers - 1) / max(workers, 1) / seconds / 1e9

    x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
    data = keras_dist.distribute_dataset((x, x.sum(axis=1)), per_replica_batch_size=8,
                                         repeat=True)
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
    history = model.fit(data, epochs=1, steps_per_epoch=3, verbose=0)
    fixes = {fix.name: (verdict, fix.upstream)
             for fix, verdict in zip(compat.FIXES, compat.probe_report().values())}
    return {
        "devices": ", ".join(f"{len(tf.config.list_physical_devices(kind))} {kind}(s)"
                             for kind in ("GPU", "CPU")) + " per worker",
        "fixes": fixes,
        "strategy": ("MultiWorkerMirroredStrategy"
                     if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
                     else type(strategy).__name__),
        "replicas": strategy.num_replicas_in_sync,
        "all_reduce_sum": total,
        "seconds": seconds,
        "bus_gbps": bus_gbps,
        "fit_loss": float(history.history["loss"][-1]),
    }
