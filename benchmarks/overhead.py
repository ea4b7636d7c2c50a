"""overhead: the seed trained with keras_dist vs by hand with tf.distribute, same process.

The seed is the classic tf.distribute MNIST MLP (784 -> 100 -> 10, SGD) on a
`MirroredStrategy` over 2 virtual CPU devices, fed by
`from_tensor_slices().shuffle().batch().repeat()`. keras_dist's version is
`keras_dist.strategy()` + `distribute_dataset` + `GradientAggregation()`. Two steps in
between (keras_dist's strategy with the seed's pipeline; then keras_dist's data too)
split the difference by keras_dist function.

All four models are built once in one process, traced and warmed up, then timed in
alternating chunks of `fit` (ABCD, BCDA, ...), so drift in the machine's load hits
each equally; each figure is the median over chunks. A chunk's time is the steady
state, from the end of its first step to the end of its last.
"""

from __future__ import annotations

from benchmarks import common

NAME = "overhead"
VARIANTS = ("plain", "strategy", "strategy+data", "keras_dist")
_DESCRIPTIONS = {
    "plain": "tf.distribute.MirroredStrategy + seed tf.data pipeline",
    "strategy": "keras_dist.strategy() + seed tf.data pipeline",
    "strategy+data": "keras_dist.strategy() + distribute_dataset",
    "keras_dist": "keras_dist.strategy() + distribute_dataset + GradientAggregation()",
}


def settings(mode: str, *, device_type: str = "CPU", replicas: int = 2,
             implementation: str = "auto", mixed_precision: bool = False) -> dict:
    return dict(
        device_type=device_type,
        replicas=replicas,
        implementation=implementation,
        mixed_precision=mixed_precision,
        per_replica_batch=64,
        examples=common.pick(mode, smoke=512, quick=4096, full=8192),
        warmup_steps=common.pick(mode, smoke=3, quick=10, full=40),
        steps=common.pick(mode, smoke=4, quick=60, full=300),
        rounds=common.pick(mode, smoke=1, quick=5, full=11),
    )


def measure(config: dict) -> dict:
    """Runs in a fresh process: builds the four variants, alternates timed chunks."""
    import keras
    import tensorflow as tf

    import keras_dist

    devices = keras_dist.virtual_devices(config["replicas"], config["device_type"])
    if config["mixed_precision"]:
        keras.mixed_precision.set_global_policy("mixed_float16")
    x, y = common.synthetic_classification(config["examples"], 784)
    per_replica = config["per_replica_batch"]
    global_batch = per_replica * len(devices)
    buffer = config["examples"]

    def build(strategy):
        with strategy.scope():
            return common.mlp(784, [100], seed=0, learning_rate=0.01)

    variants = {}
    # The seed first, traced before keras_dist.strategy() applies its Keras fixes, so
    # its train function is stock Keras.
    plain = tf.distribute.MirroredStrategy(devices)
    variants["plain"] = (build(plain), common.seed_pipeline(x, y, global_batch, buffer), [])
    common.timed_fit(*variants["plain"][:2], config["warmup_steps"])

    strategy = keras_dist.strategy(devices=devices, implementation=config["implementation"])
    data = keras_dist.distribute_dataset((x, y), per_replica, shuffle_buffer=buffer,
                                         repeat=True)
    aggregation, how = common.gradient_aggregation()
    variants["strategy"] = (build(strategy), common.seed_pipeline(x, y, global_batch, buffer),
                            [])
    variants["strategy+data"] = (build(strategy), data, [])
    variants["keras_dist"] = (build(strategy), data, [aggregation])
    for name in VARIANTS[1:]:
        model, dataset, callbacks = variants[name]
        common.timed_fit(model, dataset, config["warmup_steps"], callbacks)

    ops = {name: _train_step_ops(variants[name][0], variants[name][1],
                                 plain if name == "plain" else strategy)
           for name in VARIANTS}
    chunks = {name: [] for name in VARIANTS}
    for round_index in range(config["rounds"]):
        shift = round_index % len(VARIANTS)
        for name in VARIANTS[shift:] + VARIANTS[:shift]:
            model, dataset, callbacks = variants[name]
            chunks[name].append(common.timed_fit(model, dataset, config["steps"], callbacks))
    return {
        "chunks": chunks,
        "train_step_ops": ops,
        "global_batch": global_batch,
        "aggregation": how,
        "strategy_class": type(strategy).__name__,
        "cross_device_ops": _cross_device_ops_name(strategy),
        "plain_cross_device_ops": _cross_device_ops_name(plain),
    }


def _train_step_ops(model, data, strategy) -> dict:
    """Op types in one traced training step (both replicas), for deterministic attribution.

    Timings on a busy machine are noisy; the ops keras_dist adds to every step are not.
    """
    import collections

    import tensorflow as tf

    step = tf.function(lambda batch: strategy.run(model.train_step, args=(batch,)))
    graph = step.get_concrete_function(data.element_spec).graph
    return dict(collections.Counter(op.type for op in graph.get_operations()))


def _ops_added(ops: dict, base: dict) -> dict:
    kinds = set(ops) | set(base)
    return {kind: ops.get(kind, 0) - base.get(kind, 0) for kind in sorted(kinds)
            if ops.get(kind, 0) != base.get(kind, 0)}


def _cross_device_ops_name(strategy) -> str:
    # What MirroredStrategy picked (None until first used means "its inferred default").
    extended = strategy.extended
    chosen = getattr(extended, "_cross_device_ops", None) or getattr(
        extended, "_inferred_cross_device_ops", None)
    return type(chosen).__name__


def summarize(raw: dict, config: dict) -> dict:
    batch = raw["global_batch"]
    variants = {}
    for name in VARIANTS:
        steps = [chunk["step_s"] for chunk in raw["chunks"][name]]
        walls = [chunk["wall_step_s"] for chunk in raw["chunks"][name]]
        variants[name] = {
            "description": _DESCRIPTIONS[name],
            "eps": batch / common.median(steps),
            "wall_eps": batch / common.median(walls),
            "step_ms": 1000 * common.median(steps),
            "chunk_step_ms": [1000 * s for s in steps],
        }
    step = {name: variants[name]["step_ms"] for name in VARIANTS}
    plain_chunks = sorted(variants["plain"]["chunk_step_ms"])
    return {
        "plain_eps": variants["plain"]["eps"],
        "keras_dist_eps": variants["keras_dist"]["eps"],
        "ratio": common.ratio(variants["keras_dist"]["eps"], variants["plain"]["eps"]),
        "wall_ratio": common.ratio(variants["keras_dist"]["wall_eps"],
                                   variants["plain"]["wall_eps"]),
        # Extra milliseconds per step each keras_dist piece adds (negative: saves).
        "cost_ms_per_step": {
            "keras_dist.strategy": step["strategy"] - step["plain"],
            "keras_dist.distribute_dataset": step["strategy+data"] - step["strategy"],
            "GradientAggregation": step["keras_dist"] - step["strategy+data"],
        },
        "plain_chunk_spread_ms": plain_chunks[-1] - plain_chunks[0],
        # Graph ops each piece adds to one training step (all replicas), by op type.
        "train_step_ops": {name: sum(raw["train_step_ops"][name].values())
                           for name in VARIANTS},
        "ops_added": {
            "keras_dist.strategy": _ops_added(raw["train_step_ops"]["strategy"],
                                              raw["train_step_ops"]["plain"]),
            "GradientAggregation": _ops_added(raw["train_step_ops"]["keras_dist"],
                                              raw["train_step_ops"]["strategy+data"]),
        },
        "variants": variants,
        "global_batch": batch,
        "aggregation": raw["aggregation"],
        "cross_device_ops": {"plain": raw["plain_cross_device_ops"],
                             "keras_dist": raw["cross_device_ops"]},
        "config": config,
    }


def run(mode: str, **options) -> dict:
    config = settings(mode, **options)
    raw = common.run_isolated(measure, kwargs={"config": config})
    return summarize(raw, config)


def report(result: dict) -> None:
    rows = [
        (name, v["eps"], v["step_ms"], common.ratio(v["eps"], result["plain_eps"]),
         v["description"])
        for name, v in result["variants"].items()
    ]
    config = result["config"]
    common.print_table(
        f"overhead: seed MLP, {config['replicas']} virtual {config['device_type']} devices, "
        f"global batch {result['global_batch']}, median of {config['rounds']} chunks x "
        f"{config['steps']} steps",
        ["variant", "examples/s", "ms/step", "vs plain", "what"], rows,
    )
    costs = ", ".join(f"{k} {v:+.3f} ms" for k, v in result["cost_ms_per_step"].items())
    ops = result["train_step_ops"]
    print("ops per training step: " + ", ".join(f"{k} {v}" for k, v in ops.items()))
    for piece, added in result["ops_added"].items():
        print(f"  {piece} adds: " + (", ".join(f"{k} {v:+d}" for k, v in added.items())
                                     or "nothing"))
    print(f"ratio keras_dist/plain = {result['ratio']:.3f} (wall, incl. fit set-up: "
          f"{result['wall_ratio']:.3f}); cost per step: {costs}; plain chunk spread "
          f"{result['plain_chunk_spread_ms']:.3f} ms", flush=True)
