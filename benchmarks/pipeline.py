"""Pipeline parallelism: throughput vs micro-batches against GPipe's bubble, memory per device.

    python benchmarks/pipeline.py [--smoke|--quick] [--output PATH]

Two stages on two logical devices (`keras_dist.virtual_devices(2)`; on one GPU,
`benchmarks/gpu.sh` runs it on logical GPUs). For M micro-batches and K stages GPipe's
idle fraction is (K-1)/(M+K-1), so the ideal step time relative to M=1 is
K/(M+K-1) when stages overlap; on CPU logical devices sharing the same cores there is no
spare hardware to overlap into, so the measured ratio shows the schedule's overhead. Also:
parameter + optimizer bytes per device (1/K of the whole) and peak RSS per training step
with and without remat (each in its own process).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from benchmarks import common  # noqa: E402

NUM_STAGES = 2


def settings(mode: str) -> dict:
    return dict(
        width=common.pick(mode, smoke=16, quick=256, full=512),
        layers=common.pick(mode, smoke=2, quick=8, full=8),
        batch=common.pick(mode, smoke=16, quick=256, full=512),
        steps=common.pick(mode, smoke=2, quick=10, full=30),
        microbatches=common.pick(mode, smoke=(1, 2), quick=(1, 2, 4, 8), full=(1, 2, 4, 8)),
        memory_batch=common.pick(mode, smoke=16, quick=2048, full=8192),
    )


def _model(width: int, layers: int):
    import keras

    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((width,))] + [
        keras.layers.Dense(width, activation="relu") for _ in range(layers)])


def measure_throughput(config: dict, microbatches: int) -> dict:
    import numpy as np
    import tensorflow as tf

    from keras_dist.parallel import PipelineModel, split_sequential

    pipe = PipelineModel(split_sequential(_model(config["width"], config["layers"]),
                                          NUM_STAGES), num_microbatches=microbatches)
    pipe.compile(optimizer="adam", loss="mse")
    x = np.random.RandomState(0).randn(config["batch"], config["width"]).astype("float32")
    data = tf.data.Dataset.from_tensors((x, x)).repeat()
    timing = common.timed_fit(pipe, data, config["steps"] + 1)
    by_device = {}
    for variable in list(pipe.variables) + list(pipe.optimizer.variables):
        device = variable.value.device.split("device:")[-1]
        size = int(np.prod(variable.shape)) * variable.value.dtype.size
        by_device[device] = by_device.get(device, 0) + size
    return {"step_s": timing["step_s"], "bytes_by_device": by_device,
            "gpu_peak_bytes": _gpu_peaks(pipe.devices)}


def _gpu_peaks(devices) -> dict:
    """Peak bytes per logical GPU (get_memory_info); empty on CPU devices."""
    import tensorflow as tf

    return {device: tf.config.experimental.get_memory_info(device.replace("/device:", ""))
            ["peak"] for device in devices if "GPU" in device}


def measure_memory(config: dict, remat: bool) -> dict:
    import resource

    import numpy as np
    import tensorflow as tf

    from keras_dist.parallel import PipelineModel, split_sequential

    pipe = PipelineModel(split_sequential(_model(config["width"], config["layers"]),
                                          NUM_STAGES), remat=remat)
    pipe.compile(optimizer="sgd", loss="mse")
    x = np.random.RandomState(0).randn(config["memory_batch"], config["width"])
    x = tf.constant(x.astype("float32"))
    pipe.fit(x[:NUM_STAGES], x[:NUM_STAGES], batch_size=NUM_STAGES, verbose=0)  # trace
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    pipe.fit(x, x, batch_size=config["memory_batch"], verbose=0)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"peak_rss_growth_bytes": (after - before) * 1024}


def measure_all_throughput(config: dict) -> list:
    return [{"microbatches": m, **measure_throughput(config, m)}
            for m in config["microbatches"]]


def measure_smoke(config: dict) -> dict:
    return {"throughput": measure_all_throughput(config),
            "memory": {str(remat): measure_memory(config, remat) for remat in (False, True)}}


def run(mode: str) -> dict:
    config = settings(mode)
    if mode == "smoke":  # one process: the figures mean nothing, the code paths run
        result = common.run_isolated(measure_smoke, kwargs={"config": config},
                                     virtual_devices=NUM_STAGES)
        rows, memory = result["throughput"], result["memory"]
    else:
        rows = common.run_isolated(measure_all_throughput, kwargs={"config": config},
                                   virtual_devices=NUM_STAGES)
        # Peak RSS only grows: each variant needs its own process.
        memory = {str(remat): common.run_isolated(measure_memory, kwargs={
            "config": config, "remat": remat}, virtual_devices=NUM_STAGES)
            for remat in (False, True)}
    base = rows[0]["step_s"]
    for row in rows:
        bubble = (NUM_STAGES - 1) / (row["microbatches"] + NUM_STAGES - 1)
        row.update(bubble=bubble, measured_vs_m1=common.ratio(row["step_s"], base),
                   ideal_vs_m1=NUM_STAGES / (row["microbatches"] + NUM_STAGES - 1))
    return {"config": config, "throughput": rows, "memory": memory}


def report(result: dict) -> None:
    common.print_table(
        f"Pipeline, {NUM_STAGES} stages: step time vs micro-batches (GPipe bubble model)",
        ["M", "step s", "bubble (K-1)/(M+K-1)", "measured / M=1", "ideal / M=1"],
        [[r["microbatches"], r["step_s"], r["bubble"], r["measured_vs_m1"],
          r["ideal_vs_m1"]] for r in result["throughput"]])
    common.print_table("Parameter + optimizer bytes per device", ["device", "bytes"],
                       sorted(result["throughput"][0]["bytes_by_device"].items()))
    common.print_table("Peak RSS growth over one training step", ["remat", "bytes"],
                       [[remat, common.format_bytes(m["peak_rss_growth_bytes"])]
                        for remat, m in result["memory"].items()])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/pipeline.py", description=__doc__)
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="< 2 minutes on 2 CPU cores")
    size.add_argument("--smoke", action="store_true", help="minimal sizes (for tests)")
    parser.add_argument("--output", default=None, metavar="PATH", help="results JSON")
    args = parser.parse_args(argv)
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    result = {"meta": {**common.machine_info(), "mode": mode}, "pipeline": run(mode)}
    report(result["pipeline"])
    if args.output:
        with open(args.output, "w", encoding="utf-8") as file:
            json.dump(result, file, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
