"""model_parallel: keras.distribution on TensorFlow -- bytes per device and step time.

One wide MLP whose two big kernels dominate its variables (and Adam's two moments per
kernel), trained on the same 4 devices (virtual CPUs here) with the same global batch by:

* `strategy`: `keras_dist.strategy()` (MirroredStrategy: a full copy per device);
* `data_parallel`: `keras.distribution.DataParallel` (DTensor; replicated variables);
* `model_parallel_2x2`: `ModelParallel` on a (2, 2) mesh, the kernels split Megatron-style
  (the first on its output axis, the second on its input axis) along "model";
* `model_parallel_1x4`: the same layout on a (1, 4) mesh (no batch split);
* `fsdp`: `keras_dist.distribution.FSDP` (no layout map: every variable of at least 1024
  elements split in 4 on its largest divisible dimension, the batch split in 4).

Each runs in its own fresh process. Bytes per device are what device 0 stores of the
model's variables (params) and the optimizer's (slots) (`keras_dist.parallel.shards`; a
mirrored variable is a full copy on each device). Step time is the steady-state `fit` step.
`build_peak` is the rise of the process's resident memory while the model and its slots
are created: the 4 virtual devices share the process, so every shard counts; a variable
created whole and then split adds its whole size on top of its shards for a moment
(`build_peak - full params+slots ~ the largest variable`), one created shard-wise does not.

    bytes_ratio = model_parallel_2x2 bytes per device / data_parallel bytes per device
    fsdp_bytes_ratio = fsdp bytes per device / data_parallel bytes per device
    step_ratio_vs_data_parallel = model_parallel_2x2 step / data_parallel step
    step_ratio_vs_strategy = model_parallel_2x2 step / strategy step
    fsdp_step_vs_data_parallel, fsdp_step_vs_strategy: the same for fsdp
"""

from __future__ import annotations

from benchmarks import common

NAME = "model_parallel"
VARIANTS = ("strategy", "data_parallel", "model_parallel_2x2", "model_parallel_1x4", "fsdp")
DEVICES = 4


def settings(mode: str) -> dict:
    return dict(
        features=common.pick(mode, smoke=16, quick=256, full=256),
        hidden=common.pick(mode, smoke=64, quick=1024, full=2048),
        batch=common.pick(mode, smoke=16, quick=64, full=128),
        steps=common.pick(mode, smoke=3, quick=12, full=30),
    )


def _distribution(variant: str):
    from keras import distribution as kd

    import keras_dist

    devices = kd.list_devices()
    if variant == "fsdp":
        return keras_dist.distribution.FSDP(min_elements=1024)
    if variant == "data_parallel":
        return kd.DataParallel(devices=devices)
    shape = (2, 2) if variant == "model_parallel_2x2" else (1, 4)
    mesh = kd.DeviceMesh(shape, ["batch", "model"], devices)
    layout_map = kd.LayoutMap(mesh)
    layout_map[".*wide_in/kernel"] = (None, "model")
    layout_map[".*wide_in/bias"] = ("model",)
    layout_map[".*wide_out/kernel"] = ("model", None)
    return kd.ModelParallel(layout_map=layout_map, batch_dim_name="batch")


def measure(config: dict, variant: str) -> dict:
    """One process on 4 virtual CPUs: bytes on device 0, then the timed fit."""
    import keras
    import tensorflow as tf
    from keras import distribution as kd

    import keras_dist

    x, y = common.synthetic_classification(config["batch"] * 4, config["features"])
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(
        config["batch"], drop_remainder=True).repeat()

    def build():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([
            keras.Input((config["features"],)),
            keras.layers.Dense(config["hidden"], activation="relu", name="wide_in"),
            keras.layers.Dense(config["hidden"], activation="relu", name="wide_out"),
            keras.layers.Dense(10, name="head"),
        ])
        model.compile(optimizer=keras.optimizers.Adam(1e-3),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    with common.RssSampler() as building:
        if variant == "strategy":
            with keras_dist.strategy().scope():
                model = build()
                model.optimizer.build(model.trainable_variables)
        else:
            kd.set_distribution(_distribution(variant))
            model = build()
            model.optimizer.build(model.trainable_variables)

    def held(variables):
        if variant == "strategy":  # MirroredVariable: one full copy on each device
            return sum(int(v.numpy().nbytes) for v in variables)
        return sum(int(keras_dist.parallel.shards(v)[0][1].nbytes) for v in variables)

    params, slots = list(model.weights), list(model.optimizer.variables)
    full = sum(int(v.numpy().nbytes) for v in params + slots)
    per_device_params, per_device_slots = held(params), held(slots)
    per_device = per_device_params + per_device_slots
    largest = max(int(v.numpy().nbytes) for v in params)
    timing = common.timed_fit(model, data, config["steps"])
    return {"variant": variant, "full_bytes": full, "bytes_per_device": per_device,
            "params_per_device": per_device_params, "slots_per_device": per_device_slots,
            "build_peak": building.peak - building.start, "largest_variable": largest,
            "step_s": timing["step_s"], "wall_step_s": timing["wall_step_s"],
            "loss": float(model.evaluate(data, steps=1, verbose=0))}


def _measure_all(config: dict) -> dict:
    """Every variant in this one process (smoke: the timings mean nothing there)."""
    from keras import distribution as kd

    results = {}
    for name in VARIANTS:
        try:
            results[name] = measure(config, name)
        finally:
            kd.set_distribution(None)
    return results


def run(mode: str) -> dict:
    config = settings(mode)
    if mode == "smoke":
        results = common.run_isolated(_measure_all, kwargs={"config": config},
                                      virtual_devices=DEVICES)
    else:  # a fresh process each, one after the other: step times must not overlap
        results = {name: common.run_isolated(measure, kwargs={"config": config,
                                                              "variant": name},
                                             virtual_devices=DEVICES)
                   for name in VARIANTS}
    mp, dp, strategy = (results["model_parallel_2x2"], results["data_parallel"],
                        results["strategy"])
    return {
        "bytes_ratio": common.ratio(mp["bytes_per_device"], dp["bytes_per_device"]),
        "bytes_ratio_1x4": common.ratio(results["model_parallel_1x4"]["bytes_per_device"],
                                        dp["bytes_per_device"]),
        "step_ratio_vs_data_parallel": common.ratio(mp["step_s"], dp["step_s"]),
        "step_ratio_vs_strategy": common.ratio(mp["step_s"], strategy["step_s"]),
        "data_parallel_vs_strategy": common.ratio(dp["step_s"], strategy["step_s"]),
        "fsdp_bytes_ratio": common.ratio(results["fsdp"]["bytes_per_device"],
                                         dp["bytes_per_device"]),
        "fsdp_step_vs_data_parallel": common.ratio(results["fsdp"]["step_s"], dp["step_s"]),
        "fsdp_step_vs_strategy": common.ratio(results["fsdp"]["step_s"], strategy["step_s"]),
        "variants": results,
        "config": config,
    }


def report(result: dict) -> None:
    config = result["config"]
    rows = [(name, common.format_bytes(v["full_bytes"]),
             common.format_bytes(v["params_per_device"]),
             common.format_bytes(v["slots_per_device"]),
             common.format_bytes(v["build_peak"]), v["step_s"] * 1000, v["loss"])
            for name, v in result["variants"].items()]
    common.print_table(
        f"model_parallel: MLP {config['features']}->{config['hidden']}->"
        f"{config['hidden']}->10, Adam, global batch {config['batch']}, {DEVICES} devices",
        ["variant", "params+slots (all)", "params / device", "slots / device",
         "build peak", "step (ms)", "loss"], rows)
    print(f"model_parallel_2x2 / data_parallel: bytes per device "
          f"{result['bytes_ratio']:.3f}, step {result['step_ratio_vs_data_parallel']:.3f}; "
          f"/ keras_dist.strategy(): step {result['step_ratio_vs_strategy']:.3f}", flush=True)
    print(f"fsdp / data_parallel: bytes per device {result['fsdp_bytes_ratio']:.3f}, step "
          f"{result['fsdp_step_vs_data_parallel']:.3f}; / keras_dist.strategy(): step "
          f"{result['fsdp_step_vs_strategy']:.3f}", flush=True)
