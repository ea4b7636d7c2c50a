"""scaling: the same per-worker work on 1 worker and on 2 launched workers.

Each worker is pinned to 1 intra-op thread and 1 or 2 inter-op threads (set before
TensorFlow starts; every figure is taken both ways), so two workers on a 2-core machine
have about a core each, and trains a compute-bound model:
wide Dense layers on large per-worker batches, so FLOPs per step (6 x params x batch) far
outweigh the bytes all-reduced (4 x params). The single worker runs TensorFlow's default
strategy (no collective); the pair runs `MultiWorkerMirroredStrategy` via
`keras_dist.strategy()`, both fed by `distribute_dataset`.

    efficiency = eps_2 / (2 * eps_1)

where eps is examples/s of the whole job (global batch / step time, median over chunks,
slowest worker). Launch groups alternate (1, 2, 1, 2, ...) in full mode.

**Overlap.** The 2-worker run is made twice: with `keras_dist.strategy()`'s default
(bucketed all-reduce, issued in reverse layer order while the backward pass still runs)
and with `bytes_per_pack=0` (TensorFlow's default before keras_dist chose one: one pack
that waits for the last gradient). For each,

    overlap efficiency = local step under the same load / 2-worker step

(1.0: the all-reduce is completely hidden). On a machine whose cores are all busy with
the workers' computation, the all-reduce's own CPU time cannot hide (it takes cores from
the computation), so the figure is set against the bound

    bound = local / (local + all-reduce CPU time per step)

with the all-reduce's CPU time (all threads of the process: executor, collective, gRPC)
measured alone.
"""

from __future__ import annotations

import concurrent.futures

from benchmarks import common
from keras_dist.strategies import communication as _communication

NAME = "scaling"


def settings(mode: str) -> dict:
    return dict(
        features=common.pick(mode, smoke=32, quick=256, full=256),
        hidden=common.pick(mode, smoke=[64], quick=[1024, 1024, 1024],
                           full=[1024, 1024, 1024]),
        per_worker_batch=common.pick(mode, smoke=32, quick=512, full=4096),
        warmup_steps=common.pick(mode, smoke=2, quick=2, full=2),
        steps=common.pick(mode, smoke=3, quick=4, full=5),
        rounds=common.pick(mode, smoke=1, quick=2, full=3),
        launches=common.pick(mode, smoke=1, quick=1, full=1),
        # Smoke only: start the 1- and 2-worker runs together (timings mean nothing).
        concurrent=common.pick(mode, smoke=True, quick=False, full=False),
        intra_op_threads=1,
        # Each figure is taken with each of these inter-op pool sizes; the headline keys
        # are the first one's (1, as this benchmark always had: one core per worker;
        # 2 is TensorFlow's default on a 2-core machine). With 1, a
        # profile showed TensorFlow's executor deferring a cheap gradient op (the output
        # layer's bias gradient) to the end of the backward pass, which holds back the
        # first bucket; a second thread runs it at once.
        inter_op_threads_options=common.pick(mode, smoke=[2], quick=[1, 2], full=[1, 2]),
    )


# One pack (TensorFlow's `bytes_per_pack=0`), given per call.
ONE_PACK = _communication.ONE_PACK
# The 2-worker variants, trained in the same processes in alternating timed chunks (so
# they share the machine's state; launches differ by +-15% on a shared machine):
#   keras_dist:    stock Keras `fit` under `keras_dist.strategy()` (its default buckets);
#   one_pack:      GradientAggregation(bytes_per_pack=ONE_PACK): one pack after the last
#                  gradient, as before keras_dist chose a bucket size;
#   buckets_hook:  GradientAggregation() with the default buckets: the same hook as
#                  one_pack, so one_pack vs buckets_hook differs only in the packing.
VARIANTS = {"keras_dist": None, "one_pack": ONE_PACK, "buckets_hook": 0}


def measure(config: dict, breakdown: bool = True) -> dict:
    """One worker: pin threads, build, warm up, time `rounds` chunks of each variant."""
    common.pin_threads(config["intra_op_threads"], config["inter_op_threads"])
    import keras_dist
    from keras_dist.strategies.communication import resolve_bytes_per_pack

    import tensorflow as tf

    tf.get_logger().setLevel("ERROR")  # one traced step per variant is expected
    strategy = keras_dist.strategy()
    workers = keras_dist.num_workers()
    batch = config["per_worker_batch"]
    # Every worker's shard holds the same 4 batches, whatever the worker count.
    x, y = common.synthetic_classification(4 * batch * workers, config["features"])
    data = keras_dist.distribute_dataset((x, y), batch // (strategy.num_replicas_in_sync
                                                           // workers),
                                         shuffle=False, repeat=True)
    variants = VARIANTS if workers > 1 else {"keras_dist": None}
    models, callbacks = {}, {}
    for name, pack in variants.items():
        with strategy.scope():
            models[name] = common.mlp(config["features"], config["hidden"], seed=0)
        callbacks[name] = [] if pack is None else [
            common.gradient_aggregation(bytes_per_pack=pack)[0]]
        common.timed_fit(models[name], data, config["warmup_steps"], callbacks[name])
    steps = {name: [] for name in variants}
    names = list(variants)
    for round_ in range(config["rounds"]):
        # Rotated each round, so no variant always runs first (or after the same one).
        for name in names[round_ % len(names):] + names[:round_ % len(names)]:
            steps[name].append(common.timed_fit(models[name], data, config["steps"],
                                                callbacks[name])["step_s"])
    model = models["keras_dist"]
    shapes = [int(v.shape.num_elements()) for v in model.trainable_variables]
    result = {"workers": workers, "step_s": common.median(steps["keras_dist"]),
              "chunks": steps["keras_dist"], "params": sum(shapes),
              "strategy": type(strategy).__name__,
              "variants": {name: {"step_s": common.median(chunks), "chunks": chunks,
                                  "bytes_per_pack": resolve_bytes_per_pack(
                                      "auto" if not variants[name] else variants[name])}
                           for name, chunks in steps.items()}}
    if workers > 1 and breakdown:
        result.update(_breakdown(config, strategy, shapes, x, y))
    return result


def _breakdown(config: dict, strategy, shapes, x, y) -> dict:
    """Where a 2-worker step goes: local compute (both workers busy) and the all-reduce."""
    import tensorflow as tf

    from keras_dist.planning import bench as _bench

    # Outside any scope: the default strategy, no collective; run on both workers at
    # once, so it feels the same contention for cores as a training step.
    local_model = common.mlp(config["features"], config["hidden"], seed=0)
    local_data = tf.data.Dataset.from_tensor_slices((x, y)).batch(
        config["per_worker_batch"]).repeat()
    common.timed_fit(local_model, local_data, config["warmup_steps"])
    local = common.median([common.timed_fit(local_model, local_data, config["steps"])["step_s"]
                           for _ in range(config["rounds"])])
    # One pack, as TensorFlow's default does it: the all-reduce alone, wall and CPU time.
    all_reduce, cpu = _bench.time_all_reduce(strategy, shapes, "keras_dist_fp32",
                                             bytes_per_pack=ONE_PACK,
                                             budget_bytes=8 * 4 * sum(shapes), with_cpu=True)
    return {"local_step_s": local, "all_reduce_s": all_reduce, "all_reduce_cpu_s": cpu}


def run(mode: str) -> dict:
    config = settings(mode)
    by_threads = {}
    for threads in config["inter_op_threads_options"]:
        by_threads[str(threads)] = _run_threads(dict(config, intra_op_threads=1,
                                                     inter_op_threads=threads))
    headline = by_threads[str(config["inter_op_threads_options"][0])]
    return dict(headline, by_inter_op_threads=by_threads, config=config)


def _run_threads(config: dict) -> dict:
    """Every figure for one thread configuration (`config["inter_op_threads"]`)."""
    one, pairs = [], []
    for _ in range(config["launches"]):
        if config["concurrent"]:
            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                single = pool.submit(common.run_isolated, measure, kwargs={"config": config})
                pair = pool.submit(common.run_workers, measure, 2, kwargs={"config": config})
                one.append(single.result())
                pairs.append(pair.result())
            continue
        one.append(common.run_isolated(measure, kwargs={"config": config}))
        pairs.append(common.run_workers(measure, 2, kwargs={"config": config}))
    batch = config["per_worker_batch"]
    eps_1 = common.median([batch / r["step_s"] for r in one])
    variants = {name: _variant(pairs, name, batch, eps_1) for name in VARIANTS}
    default = variants["keras_dist"]
    parts = _slowest_breakdown(pairs[0])
    params = one[0]["params"]
    return {
        "inter_op_threads": config["inter_op_threads"],
        "eps_1": eps_1,
        "eps_2": default["eps_2"],
        "efficiency": default["efficiency"],
        "efficiency_one_pack": variants["one_pack"]["efficiency"],
        "overlap_efficiency": default["overlap_efficiency"],
        "overlap_efficiency_one_pack": variants["one_pack"]["overlap_efficiency"],
        # Same hook, only the packing differs: > 1 when the buckets help.
        "bucket_speedup": variants["one_pack"]["step_ms"] / variants["buckets_hook"]["step_ms"],
        "overlap_bound": parts["bound"],
        "overlap_vs_bound": default["overlap_efficiency"] / parts["bound"],
        "variants": variants,
        "params": params,
        "gflop_per_worker_step": 6 * params * batch / 1e9,
        "gradient_bytes": 4 * params,
        "step_ms_1": [1000 * r["step_s"] for r in one],
        "step_ms_2": [[1000 * w["step_s"] for w in group] for group in pairs],
        # Each 2-worker step, taken apart on the slowest worker of the first group.
        "breakdown_ms_2": parts,
        "strategies": [one[0]["strategy"], pairs[0][0]["strategy"]],
    }


def _variant(pairs: list, name: str, batch: int, eps_1: float) -> dict:
    """Scaling and overlap efficiency of one 2-worker variant (medians over launches)."""
    steps = [max(w["variants"][name]["step_s"] for w in group) for group in pairs]
    locals_ = [max(w["local_step_s"] for w in group) for group in pairs]
    eps_2 = common.median([2 * batch / step for step in steps])
    return {"eps_2": eps_2, "efficiency": eps_2 / (2 * eps_1),
            "overlap_efficiency": common.median([l / s for l, s in zip(locals_, steps)]),
            "bytes_per_pack": pairs[0][0]["variants"][name]["bytes_per_pack"],
            "step_ms": 1000 * common.median(steps)}


def _slowest_breakdown(group: list) -> dict:
    slowest = max(group, key=lambda w: w["step_s"])
    local, cpu = slowest["local_step_s"], slowest["all_reduce_cpu_s"]
    return {"step": 1000 * slowest["step_s"],
            "local_compute_same_load": 1000 * local,
            "gradient_all_reduce": 1000 * slowest["all_reduce_s"],
            "gradient_all_reduce_cpu": 1000 * cpu,
            "bound": local / (local + cpu)}


def report(result: dict) -> None:
    config = result["config"]
    rows = []
    for threads, part in result["by_inter_op_threads"].items():
        rows.append((threads, 1, "-", part["eps_1"], 1.0, "-"))
        rows += [(threads, 2, f"{name} ({common.format_bytes(v['bytes_per_pack'])} packs)"
                  if v["bytes_per_pack"] < ONE_PACK else f"{name} (one pack)", v["eps_2"],
                  v["efficiency"], v["overlap_efficiency"])
                 for name, v in part["variants"].items()]
    common.print_table(
        f"scaling: MLP {config['features']}->{'->'.join(map(str, config['hidden']))}->10 "
        f"({result['params']:,} params, {result['gflop_per_worker_step']:.1f} GFLOP and "
        f"{common.format_bytes(result['gradient_bytes'])} of gradients per worker step), "
        f"batch {config['per_worker_batch']} per worker, 1 intra-op thread",
        ["inter-op threads", "workers", "all-reduce", "examples/s", "efficiency", "overlap"],
        rows,
    )
    for threads, part in result["by_inter_op_threads"].items():
        parts = part["breakdown_ms_2"]
        print(f"{threads} inter-op thread(s): 2-worker step {parts['step']:.1f} ms; local "
              f"compute with both workers busy {parts['local_compute_same_load']:.1f} ms; "
              f"gradient all-reduce alone {parts['gradient_all_reduce']:.1f} ms wall, "
              f"{parts['gradient_all_reduce_cpu']:.1f} ms CPU; bound local / (local + "
              f"all-reduce CPU) = {parts['bound']:.3f}; overlap "
              f"{part['overlap_efficiency']:.3f} = {part['overlap_vs_bound']:.2f} x bound "
              f"(one pack: {part['overlap_efficiency_one_pack']:.3f}); same hook, one pack "
              f"/ default buckets step time: {part['bucket_speedup']:.3f}", flush=True)
