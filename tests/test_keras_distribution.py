"""`keras.distribution` on the TensorFlow backend (keras_dist.distribution, on DTensor).

User code written for `keras.distribution` runs unchanged after `import keras_dist`; each
scenario is checked against the same model trained on one device with the same global
batch. The scenarios of a group run in one process (4 virtual CPUs, forked from the
preloaded server), and each test asserts one of them.
"""

from __future__ import annotations

import numpy as np
import pytest

from keras_dist.testing import run_in_subprocess

pytestmark = pytest.mark.multiworker


def _max(a, b) -> float:
    return float(max(np.abs(np.asarray(x) - np.asarray(y)).max() for x, y in zip(a, b)))


def _core_scenarios(tmp):
    import os

    import keras
    import numpy as np
    import tensorflow as tf
    from keras import distribution as kd

    import keras_dist
    from keras_dist import compat

    out = {"applied": compat.applied().get("keras_distribution_on_tensorflow"),
           "devices": kd.list_devices(), "count": kd.get_device_count()}
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 16)).astype("float32")
    y = rng.normal(size=(64, 8)).astype("float32")

    def build(name="sequential"):
        # keras.Sequential's default name, Adam and a compiled metric: the case in which
        # DTensor's dropped read-after-write order left every weight unchanged.
        keras.utils.set_random_seed(3)
        model = keras.Sequential([keras.Input((16,)),
                                  keras.layers.Dense(32, activation="relu", name="up"),
                                  keras.layers.Dense(8, name="down")], name=name)
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", metrics=["mae"])
        return model

    def run(model, partial=False):
        # Slots made eagerly (not in fit's traced step): on the second and third meshes
        # too, each slot on its variable's mesh.
        model.optimizer.build(model.trainable_variables)
        history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        result = {"history": history.history,
                  "evaluate": model.evaluate(x, y, batch_size=16, verbose=0,
                                             return_dict=True),
                  "predict": model.predict(x, batch_size=16, verbose=0),
                  "call": np.asarray(model(x[:6])),
                  "weights": model.get_weights()}
        if partial:  # 62 rows in batches of 16: the last (14) is not split, placed whole
            result["predict_partial"] = model.predict(x[:62], batch_size=16, verbose=0)
            result["evaluate_partial"] = model.evaluate(x[:62], y[:62], batch_size=16,
                                                        verbose=0, return_dict=True)
        return result

    reference = build()
    out["one_device"] = run(reference, partial=True)
    # A process may use both APIs: keras_dist.strategy() applies every other fix (one of
    # them wraps the trainer's step factory); keras.distribution must keep working after.
    keras_dist.strategy(devices=["/cpu:0", "/cpu:1"])
    out["all_fixes"] = sorted(name for name, on in compat.applied().items() if on)

    def mesh_2x2():
        mesh = kd.DeviceMesh((2, 2), ["batch", "model"], kd.list_devices())
        layout_map = kd.LayoutMap(mesh)
        layout_map[".*up/kernel"] = (None, "model")
        layout_map[".*up/bias"] = ("model",)
        layout_map[".*down/kernel"] = ("model", None)
        return kd.ModelParallel(layout_map=layout_map, batch_dim_name="batch")

    distributions = {"dp2": lambda: kd.DataParallel(device_mesh=kd.DeviceMesh(
                         (2,), ["batch"], kd.list_devices()[:2])),
                     "dp4": lambda: kd.DataParallel(devices=kd.list_devices()),
                     "mp22": mesh_2x2}
    models = {}
    for name, make in distributions.items():
        if name == "dp2":  # entered with scope(), as the keras-io guide shows
            with make().scope():
                models[name] = model = build()
                out[name] = run(model)
        else:  # set_distribution, as keras-hub's examples show
            kd.set_distribution(make())
            try:
                models[name] = model = build()
                out[name] = run(model, partial=name == "mp22")
            finally:
                kd.set_distribution(None)
        out[name]["kernel_shards"] = [
            (device, value.shape) for device, value in keras_dist.parallel.shards(
                model.get_layer("up").kernel)]
        out[name]["slot_shards"] = {
            variable.path: [value.shape for _, value in keras_dist.parallel.shards(variable)]
            for variable in model.optimizer.variables if "up_kernel" in variable.path}

    # Saving writes full values; a (2,2) checkpoint loads on one device and the reverse.
    sharded = models["mp22"]
    sharded.save_weights(os.path.join(tmp, "mesh.weights.h5"))
    single = build()
    single.load_weights(os.path.join(tmp, "mesh.weights.h5"))
    out["mesh_to_one"] = _max(single.get_weights(), sharded.get_weights())
    reference.save_weights(os.path.join(tmp, "one.weights.h5"))
    sharded.load_weights(os.path.join(tmp, "one.weights.h5"))
    out["one_to_mesh"] = _max(sharded.get_weights(), reference.get_weights())
    out["one_to_mesh_shards"] = [value.shape for _, value in keras_dist.parallel.shards(
        sharded.get_layer("up").kernel)]
    sharded.save(os.path.join(tmp, "mesh.keras"))
    loaded = keras.saving.load_model(os.path.join(tmp, "mesh.keras"))
    out["keras_file"] = _max(loaded.get_weights(), sharded.get_weights())
    out["keras_file_optimizer"] = _max([v.numpy() for v in loaded.optimizer.variables],
                                       [v.numpy() for v in sharded.optimizer.variables])

    # Bad inputs: one message each.
    errors = {}

    def error_of(label, make_and_use):
        try:
            make_and_use()
        except (ValueError, RuntimeError) as error:
            errors[label] = f"{type(error).__name__}: {error}"
        finally:
            kd.set_distribution(None)

    def with_layout(key, axes, shape=(2, 2)):
        def go():
            mesh = kd.DeviceMesh(shape, ["batch", "model"], kd.list_devices()[:int(np.prod(
                shape))])
            layout_map = kd.LayoutMap(mesh)
            layout_map[key] = axes
            kd.set_distribution(kd.ModelParallel(layout_map=layout_map))
            model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(6, name="odd")])
            model.build((None, 16))
        return go

    error_of("not_divisible", with_layout(".*odd/kernel", (None, "model"), (1, 4)))
    error_of("axis_not_in_mesh", with_layout(".*odd/kernel", (None, "tensor")))
    error_of("too_many_dims", with_layout(".*odd/bias", (None, "model")))
    error_of("mesh_too_large", lambda: kd.DeviceMesh(
        (2, 4), ["batch", "model"], [f"cpu:{i}" for i in range(8)]).backend_mesh)

    def batch_dim_not_in_mesh():
        mesh = kd.DeviceMesh((2, 2), ["batch", "model"], kd.list_devices())
        kd.set_distribution(kd.ModelParallel(layout_map=kd.LayoutMap(mesh),
                                             batch_dim_name="data"))
        build()

    error_of("batch_dim_not_in_mesh", batch_dim_not_in_mesh)

    def batch_not_divisible():
        kd.set_distribution(kd.DataParallel(devices=kd.list_devices()))
        build().fit(x[:30], y[:30], batch_size=10, epochs=1, verbose=0)

    error_of("batch_not_divisible", batch_not_divisible)

    def mixed_with_strategy():
        kd.set_distribution(kd.DataParallel(devices=kd.list_devices()))
        with keras_dist.strategy(devices=[f"/cpu:{i}" for i in range(2)]).scope():
            build()

    error_of("mixed_with_strategy", mixed_with_strategy)
    out["errors"] = errors

    # DTensor's defect, still there? Without the read-after-write containment, Keras's
    # train_step (Adam, "mae", a model named "sequential") trains to wrong weights (a model
    # named "m" would not: the order follows the ops' names).
    from keras_dist.compat import keras_distribution

    keras_distribution.forward_written_values = False
    kd.set_distribution(kd.DataParallel(devices=kd.list_devices()[:2]))
    try:
        uncontained = build()
        uncontained.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        out["uncontained_vs_one_device"] = _max(uncontained.get_weights(),
                                                out["one_device"]["weights"])
    finally:
        kd.set_distribution(None)
        keras_distribution.forward_written_values = True

    # Without the fix, Keras's own TF prototype runs: the distribution is ignored.
    compat.revert("keras_distribution_on_tensorflow")
    kd.set_distribution(kd.DataParallel(devices=kd.list_devices()))
    try:
        plain = build()
        out["without_fix_shards"] = len(keras_dist.parallel.shards(
            plain.get_layer("up").kernel))
    finally:
        kd.set_distribution(None)
        compat.apply(names=("keras_distribution_on_tensorflow",))
    out["reapplied"] = compat.applied()["keras_distribution_on_tensorflow"]
    del tf
    return out


@pytest.fixture(scope="module")
def core(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("keras_distribution"))
    return run_in_subprocess(_core_scenarios, args=(tmp,), virtual_devices=4, timeout=300)


def test_import_keras_dist_installs_it_and_lists_the_virtual_devices(core):
    assert core["applied"] is True
    assert "keras_distribution_on_tensorflow" in core["all_fixes"]
    assert "custom_step_loss_scale" in core["all_fixes"]  # applied before the models below
    assert core["devices"] == ["cpu:0", "cpu:1", "cpu:2", "cpu:3"] and core["count"] == 4


@pytest.mark.parametrize("name", ["dp2", "dp4", "mp22"])
def test_fit_evaluate_predict_equal_one_device(core, name):
    got, want = core[name], core["one_device"]
    for key, values in want["history"].items():
        np.testing.assert_allclose(got["history"][key], values, atol=1e-5)
    for key, value in want["evaluate"].items():
        np.testing.assert_allclose(got["evaluate"][key], value, atol=1e-5)
    assert _max(got["weights"], want["weights"]) < 1e-5
    np.testing.assert_allclose(got["predict"], want["predict"], atol=1e-5)
    np.testing.assert_allclose(got["call"], want["call"], atol=1e-5)  # eager model(x)
    if name == "mp22":  # a last batch the batch axis does not divide: placed whole
        np.testing.assert_allclose(got["predict_partial"], want["predict_partial"],
                                   atol=1e-5)
        for key, value in want["evaluate_partial"].items():
            np.testing.assert_allclose(got["evaluate_partial"][key], value, atol=1e-5)


def test_data_parallel_replicates_every_variable_on_each_device(core):
    assert [shape for _, shape in core["dp2"]["kernel_shards"]] == [(16, 32)] * 2
    assert [shape for _, shape in core["dp4"]["kernel_shards"]] == [(16, 32)] * 4


def test_model_parallel_stores_a_slice_per_device_and_slots_follow(core):
    shards = core["mp22"]["kernel_shards"]
    assert [device.rsplit(":", 1)[-1] for device, _ in shards] == ["0", "1", "2", "3"]
    assert [shape for _, shape in shards] == [(16, 16)] * 4  # half of (16, 32) each
    slots = core["mp22"]["slot_shards"]
    assert len(slots) == 2  # Adam's two moments
    assert all(shapes == [(16, 16)] * 4 for shapes in slots.values())


def test_saving_writes_full_values_and_loads_across_mesh_and_one_device(core):
    assert core["mesh_to_one"] == 0.0
    assert core["one_to_mesh"] == 0.0
    assert core["one_to_mesh_shards"] == [(16, 16)] * 4
    assert core["keras_file"] == 0.0 and core["keras_file_optimizer"] == 0.0


# (label, what the user did, fragments of the ValueError): docs/bad_inputs.md lists them.
MESH_CASES = [
    ("not_divisible", "LayoutMap `'.*odd/kernel': (None, 'model')` on a (1, 4) mesh for a "
     "(16, 6) kernel", ["'sequential", "odd/kernel'", "(16, 6)", "'model' (4)",
                        "not divisible"]),
    ("axis_not_in_mesh", "LayoutMap layout `(None, 'tensor')` on a mesh of axes "
     "('batch', 'model') (Keras's own TensorLayout check)", ["'tensor'"]),
    ("too_many_dims", "LayoutMap `'.*odd/bias': (None, 'model')` for a (6,) bias",
     ["odd/bias'", "(6,)", "2 dimensions"]),
    ("mesh_too_large", "`DeviceMesh((2, 4), ...)` over 8 devices in a job of 4",
     ["(2, 4)", "8 CPU devices", "has 4"]),
    ("batch_dim_not_in_mesh", "`ModelParallel(..., batch_dim_name='data')` on axes "
     "('batch', 'model')", ["batch_dim_name='data'", "'batch': 2, 'model': 2"]),
    ("batch_not_divisible", "`fit(batch_size=10)` under `DataParallel` over 4 devices",
     ["10 rows", "'batch'", "multiple of 4", "drop_remainder"]),
    ("mixed_with_strategy", "a model created under `DataParallel` inside "
     "`keras_dist.strategy().scope()`", ["MirroredStrategy",
                                          "keras_dist.strategy().scope()", "Use one"]),
]


@pytest.mark.parametrize("label, parts", [(label, parts) for label, _, parts in MESH_CASES])
def test_bad_input_is_a_clear_value_error(core, label, parts):
    message = core["errors"].get(label, "")
    assert message.startswith("ValueError"), (label, message)
    for part in parts:
        assert part in message, (label, part, message)


def test_dtensor_still_drops_a_read_after_a_write_without_the_containment(core):
    # If this fails, TensorFlow fixed the defect: the forwarding in
    # keras_dist/compat/keras_distribution.py may then be gated off by a probe.
    assert core["uncontained_vs_one_device"] > 1e-3  # contained: 6e-8 (dp2 above)


def test_without_the_fix_keras_prototype_runs_and_apply_restores_it(core):
    assert core["without_fix_shards"] == 1  # one ordinary variable: the distribution ignored
    assert core["reapplied"] is True


def _on_two_workers():
    """One launched worker's part of DataParallel and ModelParallel (2, 2) over 2 x 2 CPUs."""
    import keras
    import numpy as np
    import tensorflow as tf
    from keras import distribution as kd

    import keras_dist

    kd.initialize()  # the job from TF_CONFIG, as keras-dist launch sets it
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 16)).astype("float32")
    y = rng.normal(size=(64, 8)).astype("float32")

    def build():
        keras.utils.set_random_seed(3)
        model = keras.Sequential([keras.Input((16,)),
                                  keras.layers.Dense(32, activation="relu", name="up"),
                                  keras.layers.Dense(8, name="down")])
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
        return model

    def dataset():
        return tf.data.Dataset.from_tensor_slices((x, y)).batch(16)

    reference = build()
    reference.fit(dataset(), epochs=2, verbose=0)
    devices = kd.list_devices()
    mesh = kd.DeviceMesh((2, 2), ["batch", "model"], devices)
    layout_map = kd.LayoutMap(mesh)
    layout_map[".*up/kernel"] = (None, "model")
    layout_map[".*down/kernel"] = ("model", None)
    out = {"devices": devices}
    for name, distribution in {
            "dp": kd.DataParallel(devices=devices),
            "mp22": kd.ModelParallel(layout_map=layout_map, batch_dim_name="batch"),
            "fsdp": keras_dist.distribution.FSDP(min_elements=256)}.items():
        kd.set_distribution(distribution)
        try:
            model = build()
            model.fit(dataset(), epochs=2, verbose=0)
        finally:
            kd.set_distribution(None)
        out[name] = {
            "processes": (distribution.num_processes, distribution._process_id),
            "weights": max(float(np.abs(a - b).max()) for a, b in zip(
                model.get_weights(), reference.get_weights())),
            "kernel_shards": [(device.split("/")[-2:], value.shape) for device, value in
                              keras_dist.parallel.shards(model.get_layer("up").kernel)],
        }
    return out


@pytest.mark.slow
def test_two_launched_workers_train_like_one_device():
    from keras_dist.testing import run_on_workers

    results = run_on_workers(_on_two_workers, 2, virtual_devices=2, timeout=300)
    for index, out in enumerate(results):
        assert out["devices"] == ["cpu:0", "cpu:1", "cpu:2", "cpu:3"]
        for name in ("dp", "mp22", "fsdp"):
            assert out[name]["processes"] == (2, index)
            assert out[name]["weights"] < 1e-5, (index, name, out[name])
        # Each worker stores its own two devices' parts: whole (dp) or half (mp) kernels.
        assert [shape for _, shape in out["dp"]["kernel_shards"]] == [(16, 32)] * 2
        assert [shape for _, shape in out["mp22"]["kernel_shards"]] == [(16, 16)] * 2
        # FSDP: the (16, 32) kernel split in 4 along its 32 dimension, 2 parts per worker.
        assert [shape for _, shape in out["fsdp"]["kernel_shards"]] == [(16, 8)] * 2
        assert {part[0] for part, _ in out["mp22"]["kernel_shards"]} == {
            f"task:{index}"}


@pytest.mark.slow
def test_a_tf_config_with_a_chief_is_refused_clearly_by_every_process(tmp_path):
    """A Kubeflow TFJob with a Chief replica: DTensor needs one job; each process says so
    at once (no process waits for a peer that will not come)."""
    import json
    import os
    import subprocess
    import sys

    from keras_dist.launching.local import free_ports

    ports = free_ports(2)
    cluster = {"chief": [f"127.0.0.1:{ports[0]}"], "worker": [f"127.0.0.1:{ports[1]}"]}
    code = ("import keras_dist, keras\n"
            "try:\n    keras.distribution.initialize()\n"
            "except ValueError as error:\n    print('REFUSED', error)\n")
    for task in ({"type": "chief", "index": 0}, {"type": "worker", "index": 0}):
        env = dict(os.environ, TF_CONFIG=json.dumps({"cluster": cluster, "task": task}),
                   TF_CPP_MIN_LOG_LEVEL="2")
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                              text=True, timeout=120)
        assert "REFUSED" in done.stdout, (task, done.stdout, done.stderr[-2000:])
        for part in ("'chief' task", "Worker replicas only", "keras_dist.strategy()"):
            assert part in done.stdout, (part, done.stdout)
