"""sparse_accumulation: accumulating embedding gradients sparsely vs densified.

An embedding lookup's gradient is a `tf.IndexedSlices` holding one row per looked-up
token. `GradientAggregation(accumulation_steps=k)` adds it into a replica-local
accumulator every micro-step, either sparsely (scatter-add of the rows, keras_dist's
choice) or densified first (`tf.convert_to_tensor`, then `assign_add`: a zero-filled
table-sized tensor per replica per micro-step). Each variant runs in its own fresh
process on 2 virtual CPU devices (MirroredStrategy, replica-local ON_READ
accumulators, exactly as in training) and times the micro-step (lookup, backward,
accumulate) with a `vocabulary x dim` table; a thread samples the process's RSS.

    python benchmarks/sparse_accumulation.py [--smoke | --quick] [--output PATH]

    speedup      = dense step time / sparse step time   (> 1: sparse is faster)
    memory_ratio = dense RSS increase / sparse RSS increase
"""

from __future__ import annotations

import argparse
import json
import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common  # noqa: E402

NAME = "sparse_accumulation"
VARIANTS = ("sparse", "dense")


def settings(mode: str) -> dict:
    return dict(
        vocabulary=common.pick(mode, smoke=1000, quick=30_000, full=30_000),
        dim=common.pick(mode, smoke=16, quick=128, full=128),
        tokens_per_replica=common.pick(mode, smoke=64, quick=2048, full=4096),
        steps=common.pick(mode, smoke=3, quick=20, full=50),
        replicas=2,
    )


def measure(config: dict, variant: str) -> dict:
    """One process: RSS before, step time and peak RSS of `steps` micro-steps."""
    import time

    import psutil
    import tensorflow as tf

    import keras_dist
    from keras_dist.aggregation import accumulation as _accumulation

    process = psutil.Process()
    strategy = keras_dist.strategy()
    shape = (config["vocabulary"], config["dim"])
    with strategy.scope():
        table = tf.Variable(tf.random.stateless_normal(shape, seed=(0, 1)), name="table")
        accumulators = [tf.Variable(
            tf.zeros(shape), trainable=False,
            synchronization=tf.VariableSynchronization.ON_READ,
            aggregation=tf.VariableAggregation.SUM,
        )]

    def micro_step(tokens):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(tf.gather(table, tokens)))
        (grad,) = tape.gradient(loss, [table])
        _accumulation.accumulate(accumulators, [grad], sparse=variant)

    @tf.function
    def step(seed):
        tokens = tf.random.stateless_uniform(
            [config["tokens_per_replica"]], seed=tf.stack([seed, 0]),
            maxval=config["vocabulary"], dtype=tf.int32)
        strategy.run(micro_step, args=(tokens,))

    def timed_steps():
        for seed in range(1, config["steps"] + 1):
            step(tf.constant(seed))
        return float(tf.reduce_sum(accumulators[0].read_value()))  # waits for the last

    step(tf.constant(0))  # trace and warm up outside the timed window
    baseline = process.memory_info().rss
    started = time.perf_counter()
    total, peak = _peak_rss_during(process, timed_steps)
    elapsed = time.perf_counter() - started
    mb = 1 << 20
    return {
        "variant": variant,
        "replicas": strategy.num_replicas_in_sync,
        "step_ms": 1000 * elapsed / config["steps"],
        "baseline_rss_mb": baseline / mb,
        "peak_rss_mb": peak / mb,
        "increase_mb": (peak - baseline) / mb,
        "accumulated_sum": total,
    }


def _peak_rss_during(process, fn):
    """`fn()`'s value and the process's peak RSS (bytes) while it ran, sampled every ms."""
    import threading

    peak = [process.memory_info().rss]
    done = threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], process.memory_info().rss)
            done.wait(0.001)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        value = fn()
    finally:
        done.set()
        sampler.join()
    return value, max(peak[0], process.memory_info().rss)


def run(mode: str) -> dict:
    config = settings(mode)
    # One variant at a time: they would compete for the same cores.
    results = {name: common.run_isolated(measure, kwargs={"config": config, "variant": name},
                                         virtual_devices=config["replicas"])
               for name in VARIANTS}
    sparse, dense = results["sparse"], results["dense"]
    table_mb = config["vocabulary"] * config["dim"] * 4 / (1 << 20)
    return {
        "sparse_step_ms": sparse["step_ms"],
        "dense_step_ms": dense["step_ms"],
        "speedup": common.ratio(dense["step_ms"], sparse["step_ms"]),
        "sparse_increase_mb": sparse["increase_mb"],
        "dense_increase_mb": dense["increase_mb"],
        "memory_ratio": common.ratio(max(dense["increase_mb"], 1e-3),
                                     max(sparse["increase_mb"], 1e-3)),
        # Both variants add the same numbers (up to summation order).
        "sums_agree": abs(sparse["accumulated_sum"] - dense["accumulated_sum"])
        <= 1e-4 * max(1.0, abs(dense["accumulated_sum"])),
        "table_mb": table_mb,
        # What each variant materialises per replica per micro-step besides the
        # gradient rows themselves: densifying builds a zero-filled table (RSS shows it
        # only when the allocator cannot reuse the previous step's buffer).
        "dense_transient_mb_per_replica": table_mb,
        "sparse_transient_mb_per_replica": 0.0,
        "gradient_rows_mb_per_replica": config["tokens_per_replica"] * config["dim"] * 4
        / (1 << 20),
        "variants": results,
        "config": config,
    }


def report(result: dict) -> None:
    config = result["config"]
    rows = [(name, v["replicas"], v["step_ms"], v["baseline_rss_mb"], v["peak_rss_mb"],
             v["increase_mb"]) for name, v in result["variants"].items()]
    common.print_table(
        f"sparse_accumulation: {config['vocabulary']} x {config['dim']} table "
        f"({result['table_mb']:.1f} MB), {config['tokens_per_replica']} tokens/replica, "
        f"{config['steps']} micro-steps",
        ["variant", "replicas", "step ms", "RSS before MB", "peak RSS MB", "increase MB"],
        rows,
    )
    print(f"dense/sparse: step time {result['speedup']:.2f}x, RSS increase "
          f"{result['memory_ratio']:.2f}x; sums agree: {result['sums_agree']}; densifying "
          f"materialises {result['dense_transient_mb_per_replica']:.1f} MB per replica "
          f"per micro-step (gradient rows: {result['gradient_rows_mb_per_replica']:.1f} MB)",
          flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/sparse_accumulation.py",
                                     description=__doc__.splitlines()[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="30k x 128, 20 micro-steps")
    size.add_argument("--smoke", action="store_true", help="minimal sizes (for tests)")
    parser.add_argument("--output", default=None, metavar="PATH", help="write JSON here")
    args = parser.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    result = run("quick" if args.quick else "smoke" if args.smoke else "full")
    report(result)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as file:
            json.dump({NAME: result}, file, indent=2, default=float)
    return 0


if __name__ == "__main__":
    sys.exit(main())
