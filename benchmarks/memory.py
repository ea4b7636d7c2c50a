"""memory: peak RSS of gradient accumulation (k=4 at batch b) vs plain training at 4b.

Both train the same activation-heavy MLP (narrow, deep: activations grow with the batch,
parameters do not) from the same `from_tensor_slices().batch().repeat()` pipeline, each
in its own fresh process on TensorFlow's default strategy; the only differences are the
batch (4b vs b) and `GradientAggregation(accumulation_steps=4)`, so both take the same
number of updates on the same effective batch. A thread samples the process's RSS
(psutil) every millisecond; `getrusage` maxrss is recorded as a cross-check.

    ratio = accumulation peak RSS / plain peak RSS  (< 1: accumulation needs less)

`*_increase_mb` is the peak minus the RSS just before the first `fit` (model, data and
TensorFlow already loaded), the part that depends on the batch.
"""

from __future__ import annotations

import concurrent.futures

from benchmarks import common

NAME = "memory"
VARIANTS = ("plain", "accumulation")


def settings(mode: str) -> dict:
    return dict(
        batch=common.pick(mode, smoke=32, quick=2048, full=2048),
        accumulation_steps=4,
        features=common.pick(mode, smoke=16, quick=256, full=256),
        hidden=common.pick(mode, smoke=[32, 32], quick=[256] * 12, full=[256] * 12),
        updates=common.pick(mode, smoke=2, quick=3, full=6),
    )


def measure(config: dict, variant: str) -> dict:
    """One process: RSS before fit, then peak RSS over `updates` updates."""
    import resource
    import threading

    import psutil

    process = psutil.Process()
    import tensorflow as tf

    import keras_dist

    keras_dist.strategy()
    k = config["accumulation_steps"]
    batch = config["batch"] * (k if variant == "plain" else 1)
    steps = config["updates"] * (1 if variant == "plain" else k)
    x, y = common.synthetic_classification(config["batch"] * k * 2, config["features"])
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch, drop_remainder=True).repeat()
    model = common.mlp(config["features"], config["hidden"], seed=0)
    callbacks = []
    how = None
    if variant == "accumulation":
        aggregation, how = common.gradient_aggregation(accumulation_steps=k)
        callbacks.append(aggregation)

    baseline = process.memory_info().rss
    peak = [baseline]
    done = threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], process.memory_info().rss)
            done.wait(0.001)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        model.fit(data, epochs=1, steps_per_epoch=steps, verbose=0, shuffle=False,
                  callbacks=callbacks)
    finally:
        done.set()
        sampler.join()
    peak[0] = max(peak[0], process.memory_info().rss)
    mb = 1 << 20
    return {
        "variant": variant,
        "batch": batch,
        "steps": steps,
        "updates": int(model.optimizer.iterations.numpy()),
        "baseline_rss_mb": baseline / mb,
        "peak_rss_mb": peak[0] / mb,
        "increase_mb": (peak[0] - baseline) / mb,
        "ru_maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / mb,
        "aggregation": how,
    }


def run(mode: str) -> dict:
    config = settings(mode)
    # RSS is per process, so the two can run at the same time without disturbing it.
    with concurrent.futures.ThreadPoolExecutor(len(VARIANTS)) as pool:
        futures = {name: pool.submit(common.run_isolated, measure,
                                     kwargs={"config": config, "variant": name})
                   for name in VARIANTS}
        results = {name: future.result() for name, future in futures.items()}
    plain, accumulation = results["plain"], results["accumulation"]
    return {
        "plain_peak_rss_mb": plain["peak_rss_mb"],
        "accumulation_peak_rss_mb": accumulation["peak_rss_mb"],
        "ratio": common.ratio(accumulation["peak_rss_mb"], plain["peak_rss_mb"]),
        "plain_increase_mb": plain["increase_mb"],
        "accumulation_increase_mb": accumulation["increase_mb"],
        "increase_ratio": common.ratio(accumulation["increase_mb"], plain["increase_mb"]),
        "variants": results,
        "config": config,
    }


def report(result: dict) -> None:
    config = result["config"]
    rows = [(name, v["batch"], v["steps"], v["updates"], v["baseline_rss_mb"],
             v["peak_rss_mb"], v["increase_mb"], v["ru_maxrss_mb"])
            for name, v in result["variants"].items()]
    common.print_table(
        f"memory: MLP {config['features']}->{len(config['hidden'])}x{config['hidden'][0]}->10, "
        f"effective batch {config['batch'] * config['accumulation_steps']} (MB)",
        ["variant", "batch", "steps", "updates", "before fit", "peak RSS", "increase",
         "maxrss"], rows,
    )
    print(f"ratio accumulation/plain: peak RSS {result['ratio']:.3f}, increase "
          f"{result['increase_ratio']:.3f}", flush=True)
