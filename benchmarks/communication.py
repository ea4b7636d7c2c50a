"""communication: all-reduce bandwidth, bytes_per_pack, and what GradientAggregation saves.

On 2 launched workers (CPU: one replica each, RING collectives over loopback gRPC):

1. **all-reduce sweep**, 1 KB .. 64 MB (quick: 16 MB; `keras_dist.planning.bench`, also `keras-dist bench
   allreduce`): nccl-tests' algbw and busbw for plain fp32, keras_dist's fp32 path and
   its bf16 compression path (casts included);
2. **bytes_per_pack**: the gradient list of the model below, all-reduced in one call
   with `CommunicationOptions(bytes_per_pack=...)`, against TensorFlow's default (0:
   one pack); the all-reduce alone, nothing to overlap with (that is `buckets`);
3. **end to end**: step time of a communication-heavy model (many parameters, tiny
   batches, so the all-reduce dominates) trained with stock Keras aggregation ("plain")
   vs `GradientAggregation(accumulation_steps=4)` and `GradientAggregation(
   compression="bf16")`, alternating timed chunks; the ratios are plain time / variant
   time (> 1: faster). With accumulation a step is one micro-batch, and one in four
   steps all-reduces.

With `local_replicas=n` (benchmarks/gpu.sh) everything runs in one process on n virtual
devices under `MirroredStrategy` instead.
"""

from __future__ import annotations

from benchmarks import common
from keras_dist.planning import bench as _bench
from keras_dist.strategies import communication as _communication

NAME = "communication"
ONE_PACK = _communication.ONE_PACK  # one pack, given per call
E2E_VARIANTS = ("plain", "accumulation_4", "bf16")


def settings(mode: str, *, device_type: str = "CPU", replicas: int = 2,
             implementation: str = "auto", mixed_precision: bool = False,
             local: bool = False) -> dict:
    mb = 1 << 20
    return dict(
        device_type=device_type,
        replicas=replicas,
        local=local,
        implementation=implementation,
        mixed_precision=mixed_precision,
        sizes=common.pick(mode, smoke=[1 << 10],
                          quick=[1 << s for s in range(10, 25, 2)],
                          full=[1 << s for s in range(10, 27, 2)]),
        budget_bytes=common.pick(mode, smoke=mb // 4, quick=32 * mb, full=512 * mb),
        packs=common.pick(mode, smoke=[0, 64 << 10], quick=[0, 256 << 10, 1 * mb, 4 * mb],
                          full=[0, 64 << 10, 256 << 10, 1 * mb, 4 * mb, 16 * mb]),
        features=common.pick(mode, smoke=64, quick=512, full=1024),
        hidden=common.pick(mode, smoke=[128], quick=[1024, 1024], full=[2048, 2048]),
        per_replica_batch=16,
        warmup_steps=common.pick(mode, smoke=2, quick=4, full=16),
        steps=common.pick(mode, smoke=3, quick=12, full=40),
        rounds=common.pick(mode, smoke=1, quick=2, full=7),
    )


def measure(config: dict) -> dict:
    """One worker's part (or the one process with `local`): sweep, packs, end to end."""
    import keras
    import tensorflow as tf

    import keras_dist

    tf.get_logger().setLevel("ERROR")  # each all-reduce measurement traces anew
    if config["local"]:
        devices = keras_dist.virtual_devices(config["replicas"], config["device_type"])
        strategy = keras_dist.strategy(devices=devices, implementation=config["implementation"])
    else:
        strategy = keras_dist.strategy(implementation=config["implementation"])
    if config["mixed_precision"]:
        keras.mixed_precision.set_global_policy("mixed_float16")
    implementation = config["implementation"]
    sweep = _bench.sweep(strategy, config["sizes"], implementation=implementation,
                         budget_bytes=config["budget_bytes"])

    x, y = common.synthetic_classification(
        config["per_replica_batch"] * strategy.num_replicas_in_sync * 8, config["features"])
    data = keras_dist.distribute_dataset((x, y), config["per_replica_batch"], repeat=True)
    models = {}
    callbacks = {}
    for name in E2E_VARIANTS:
        with strategy.scope():
            models[name] = common.mlp(config["features"], config["hidden"], seed=0)
    callbacks["plain"] = []
    callbacks["accumulation_4"] = [common.gradient_aggregation(accumulation_steps=4)[0]]
    aggregation, how = common.gradient_aggregation(compression="bf16")
    callbacks["bf16"] = [aggregation]

    shapes = [int(v.shape.num_elements()) for v in models["plain"].trainable_variables]
    packs = []
    # 0 is one pack (TensorFlow's default), given per call as a size no list reaches:
    # per call, 0 would mean the strategy's setting (keras_dist's default buckets).
    for pack in [0] + [p for p in config["packs"] if p]:
        seconds = _bench.time_all_reduce(strategy, shapes, "keras_dist_fp32",
                                         implementation=implementation,
                                         bytes_per_pack=pack or ONE_PACK,
                                         budget_bytes=config["budget_bytes"])
        packs.append({"path": "keras_dist_fp32", "bytes_per_pack": pack,
                      "time_us": 1e6 * seconds})

    for name in E2E_VARIANTS:
        common.timed_fit(models[name], data, config["warmup_steps"], callbacks[name])
    chunks = {name: [] for name in E2E_VARIANTS}
    for round_index in range(config["rounds"]):
        shift = round_index % len(E2E_VARIANTS)
        for name in E2E_VARIANTS[shift:] + E2E_VARIANTS[:shift]:
            chunks[name].append(common.timed_fit(models[name], data, config["steps"],
                                                 callbacks[name])["step_s"])
    return {"replicas": strategy.num_replicas_in_sync, "sweep": sweep, "packs": packs,
            "gradient_bytes": 4 * sum(shapes), "gradient_tensors": len(shapes),
            "chunks": chunks, "aggregation": how}


def summarize(results: list, config: dict) -> dict:
    replicas = results[0]["replicas"]
    factor = _bench.bus_factor(replicas)
    allreduce = _bench.summarize([{"replicas": replicas, "rows": r["sweep"]} for r in results])
    gradient_bytes = results[0]["gradient_bytes"]
    packs = []
    for index, row in enumerate(results[0]["packs"]):
        seconds = max(r["packs"][index]["time_us"] for r in results) / 1e6
        packs.append(dict(row, time_us=1e6 * seconds,
                          busbw_GBps=gradient_bytes / seconds * factor / 1e9))
    for row in packs:
        row["speedup"] = packs[0]["time_us"] / row["time_us"]
    # A step ends together on every worker; take the slowest worker's median.
    step_ms = {name: 1000 * max(common.median(r["chunks"][name]) for r in results)
               for name in E2E_VARIANTS}
    fp32 = [row for row in allreduce["rows"] if row["path"] == "plain_fp32"]
    bf16 = {row["size_bytes"]: row for row in allreduce["rows"]
            if row["path"] == "keras_dist_bf16"}
    largest = fp32[-1]["size_bytes"]
    return {
        "replicas": replicas,
        "bus_factor": factor,
        "max_busbw_fp32_GBps": max(row["busbw_GBps"] for row in fp32),
        "largest_size_bytes": largest,
        "busbw_fp32_largest_GBps": fp32[-1]["busbw_GBps"],
        "bf16_allreduce_speedup_largest": bf16[largest]["speedup"],
        "allreduce": allreduce["rows"],
        "bytes_per_pack": {"gradient_bytes": gradient_bytes,
                           "gradient_tensors": results[0]["gradient_tensors"], "rows": packs},
        "end_to_end": {
            "step_ms": step_ms,
            "accumulation_speedup": common.ratio(step_ms["plain"], step_ms["accumulation_4"]),
            "bf16_speedup": common.ratio(step_ms["plain"], step_ms["bf16"]),
            "model_params": gradient_bytes // 4,
            "aggregation": results[0]["aggregation"],
        },
        "config": config,
    }


def run(mode: str, **options) -> dict:
    config = settings(mode, **options)
    if config["local"]:
        results = [common.run_isolated(measure, kwargs={"config": config})]
    else:
        results = common.run_workers(measure, config["replicas"], kwargs={"config": config})
    return summarize(results, config)


def report(result: dict) -> None:
    where = (f"{result['replicas']} replicas" if result["config"]["local"]
             else f"{result['replicas']} workers")
    print(f"\ncommunication: all-reduce on {where}; busbw = algbw x "
          f"{result['bus_factor']:.2f} (nccl-tests); 'vs plain' = plain fp32 time / time")
    for line in _bench.table_lines({"rows": result["allreduce"]}):
        print(line)
    packs = result["bytes_per_pack"]
    common.print_table(
        f"bytes_per_pack: {packs['gradient_tensors']} gradient tensors, "
        f"{common.format_bytes(packs['gradient_bytes'])} in one all-reduce call",
        ["path", "bytes_per_pack", "us", "busbw GB/s", "vs plain"],
        [(r["path"], r["bytes_per_pack"] or "0 (one pack)", r["time_us"], r["busbw_GBps"],
          r["speedup"]) for r in packs["rows"]],
    )
    e2e = result["end_to_end"]
    common.print_table(
        f"end to end: MLP with {e2e['model_params']:,} params, per-replica batch "
        f"{result['config']['per_replica_batch']} (ms per step, slowest worker)",
        ["variant", "ms/step", "speedup vs plain"],
        [(name, ms, common.ratio(e2e["step_ms"]["plain"], ms))
         for name, ms in e2e["step_ms"].items()],
    )
