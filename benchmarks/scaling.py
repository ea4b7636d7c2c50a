"""scaling: the same per-worker work on 1 worker and on 2 launched workers.

Each worker is pinned to 1 intra-op and 1 inter-op thread (set before TensorFlow starts),
so two workers on a 2-core machine have a core each, and trains a compute-bound model:
wide Dense layers on large per-worker batches, so FLOPs per step (6 x params x batch) far
outweigh the bytes all-reduced (4 x params). The single worker runs TensorFlow's default
strategy (no collective); the pair runs `MultiWorkerMirroredStrategy` via
`keras_dist.strategy()`, both fed by `distribute_dataset`.

    efficiency = eps_2 / (2 * eps_1)

where eps is examples/s of the whole job (global batch / step time, median over chunks,
slowest worker). Launch groups alternate (1, 2, 1, 2, ...) in full mode.
"""

from __future__ import annotations

import concurrent.futures

from benchmarks import common

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
        launches=common.pick(mode, smoke=1, quick=1, full=2),
        # Smoke only: start the 1- and 2-worker runs together (timings mean nothing).
        concurrent=common.pick(mode, smoke=True, quick=False, full=False),
        intra_op_threads=1,
        inter_op_threads=1,
    )


def measure(config: dict) -> dict:
    """One worker: pin threads, build, warm up, time `rounds` chunks of `steps`."""
    common.pin_threads(config["intra_op_threads"], config["inter_op_threads"])
    import keras_dist

    strategy = keras_dist.strategy()
    workers = keras_dist.num_workers()
    batch = config["per_worker_batch"]
    # Every worker's shard holds the same 4 batches, whatever the worker count.
    x, y = common.synthetic_classification(4 * batch * workers, config["features"])
    data = keras_dist.distribute_dataset((x, y), batch // (strategy.num_replicas_in_sync
                                                           // workers),
                                         shuffle=False, repeat=True)
    with strategy.scope():
        model = common.mlp(config["features"], config["hidden"], seed=0)
    common.timed_fit(model, data, config["warmup_steps"])
    steps = [common.timed_fit(model, data, config["steps"])["step_s"]
             for _ in range(config["rounds"])]
    shapes = [int(v.shape.num_elements()) for v in model.trainable_variables]
    result = {"workers": workers, "step_s": common.median(steps), "chunks": steps,
              "params": sum(shapes), "strategy": type(strategy).__name__}
    if workers > 1:
        result.update(_breakdown(config, strategy, shapes, x, y))
    return result


def _breakdown(config: dict, strategy, shapes, x, y) -> dict:
    """Where a 2-worker step goes: local compute (both workers busy) and the all-reduce."""
    import tensorflow as tf

    from keras_dist import _bench

    # Outside any scope: the default strategy, no collective; run on both workers at
    # once, so it feels the same contention for cores as a training step.
    local_model = common.mlp(config["features"], config["hidden"], seed=0)
    local_data = tf.data.Dataset.from_tensor_slices((x, y)).batch(
        config["per_worker_batch"]).repeat()
    common.timed_fit(local_model, local_data, config["warmup_steps"])
    local = common.median([common.timed_fit(local_model, local_data, config["steps"])["step_s"]
                           for _ in range(config["rounds"])])
    all_reduce = _bench.time_all_reduce(strategy, shapes, "plain_fp32",
                                        budget_bytes=8 * 4 * sum(shapes))
    return {"local_step_s": local, "all_reduce_s": all_reduce}


def run(mode: str) -> dict:
    config = settings(mode)
    one, two = [], []
    for _ in range(config["launches"]):
        if config["concurrent"]:
            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                single = pool.submit(common.run_isolated, measure, kwargs={"config": config})
                pair = pool.submit(common.run_workers, measure, 2, kwargs={"config": config})
                one.append(single.result())
                two.append(pair.result())
            continue
        one.append(common.run_isolated(measure, kwargs={"config": config}))
        two.append(common.run_workers(measure, 2, kwargs={"config": config}))
    batch = config["per_worker_batch"]
    eps_1 = common.median([batch / r["step_s"] for r in one])
    eps_2 = common.median([2 * batch / max(w["step_s"] for w in group) for group in two])
    params = one[0]["params"]
    return {
        "eps_1": eps_1,
        "eps_2": eps_2,
        "efficiency": eps_2 / (2 * eps_1),
        "params": params,
        "gflop_per_worker_step": 6 * params * batch / 1e9,
        "gradient_bytes": 4 * params,
        "step_ms_1": [1000 * r["step_s"] for r in one],
        "step_ms_2": [[1000 * w["step_s"] for w in group] for group in two],
        # Each 2-worker step, taken apart on the slowest worker of the first group.
        "breakdown_ms_2": _slowest_breakdown(two[0]),
        "strategies": [one[0]["strategy"], two[0][0]["strategy"]],
        "config": config,
    }


def _slowest_breakdown(group: list) -> dict:
    slowest = max(group, key=lambda w: w["step_s"])
    return {"step": 1000 * slowest["step_s"],
            "local_compute_same_load": 1000 * slowest["local_step_s"],
            "gradient_all_reduce": 1000 * slowest["all_reduce_s"]}


def report(result: dict) -> None:
    config = result["config"]
    common.print_table(
        f"scaling: MLP {config['features']}->{'->'.join(map(str, config['hidden']))}->10 "
        f"({result['params']:,} params, {result['gflop_per_worker_step']:.1f} GFLOP and "
        f"{common.format_bytes(result['gradient_bytes'])} of gradients per worker step), "
        f"batch {config['per_worker_batch']} per worker, 1 intra + 1 inter-op thread",
        ["workers", "examples/s", "ideal", "efficiency"],
        [(1, result["eps_1"], result["eps_1"], 1.0),
         (2, result["eps_2"], 2 * result["eps_1"], result["efficiency"])],
    )
    parts = result["breakdown_ms_2"]
    print(f"2-worker step {parts['step']:.1f} ms = local compute with both workers busy "
          f"{parts['local_compute_same_load']:.1f} ms + gradient all-reduce alone "
          f"{parts['gradient_all_reduce']:.1f} ms (+ the rest); 1-worker step "
          f"{result['step_ms_1'][0]:.1f} ms", flush=True)
