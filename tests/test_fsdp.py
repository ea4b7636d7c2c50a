"""`keras_dist.distribution.FSDP`, random numbers on a mesh, the keras-io guide (issue 38).

Every scenario is compared with the same model trained on one device with the same global
batch. The scenarios of a group run in one process (4 or 8 virtual CPUs) and each test
asserts one of them.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from keras_dist.testing import run_in_subprocess

pytestmark = pytest.mark.multiworker

GUIDE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tutorials",
                     "keras_distribution_guide.py")


def _max(a, b) -> float:
    return float(max(np.abs(np.asarray(x) - np.asarray(y)).max() for x, y in zip(a, b)))


def _fsdp_scenarios():
    import keras
    import numpy as np
    import tensorflow as tf
    from keras import distribution as kd

    import keras_dist
    from keras_dist.distribution import FSDP

    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 16)).astype("float32")
    y = rng.normal(size=(64, 8)).astype("float32")

    def build(dropout=0.0):
        keras.utils.set_random_seed(3)
        layers = [keras.Input((16,)), keras.layers.Dense(64, activation="relu", name="up"),
                  keras.layers.Dense(64, activation="relu", name="mid")]
        if dropout:
            layers.append(keras.layers.Dropout(dropout))
        layers.append(keras.layers.Dense(8, name="down"))
        model = keras.Sequential(layers)
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
        return model

    def train(model):
        model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        return model

    out = {}
    reference = train(build())
    with FSDP(min_elements=1024).scope():
        model = build()
    train(model)
    out["mlp"] = _max(model.get_weights(), reference.get_weights())
    out["predict"] = float(np.abs(model.predict(x, verbose=0)
                                  - reference.predict(x, verbose=0)).max())
    out["layouts"] = {v.path.split("/", 1)[1]: tuple(v._layout.axes) for v in model.weights}
    # Bytes each device holds of params + slots, against the whole and the replicated part.
    variables = model.weights + model.optimizer.variables
    total = sum(np.asarray(v).nbytes for v in variables)
    small = sum(np.asarray(v).nbytes for v in variables if np.prod(v.shape) < 1024)
    out["per_device"] = [sum(keras_dist.parallel.shards(v)[d][1].nbytes for v in variables)
                         for d in range(4)]
    out["bound"] = (total - small) / 4 + small
    # Model weights are gathered where used; the optimizer's slots are read as stored
    # (its update runs on the shards: gathering them doubled FSDP's step time).
    gathered = {v.path: hasattr(v._value, "_keras_dist_compute_layout")
                for v in model.weights + model.optimizer.variables
                if "mid" in v.path and "kernel" in v.path}
    out["gathered"] = sorted(path for path, on in gathered.items() if on)
    out["slot_shards"] = sorted({value.shape for v in model.optimizer.variables
                                 if "mid_kernel" in v.path
                                 for _, value in keras_dist.parallel.shards(v)})

    # set_distribution, a mesh of its own, min_elements=0: every divisible variable sharded.
    kd.set_distribution(FSDP(kd.DeviceMesh((2,), ["data"], kd.list_devices()[:2]),
                             batch_dim_name="data", min_elements=0))
    try:
        model = train(build())
    finally:
        kd.set_distribution(None)
    out["mesh2_min0"] = _max(model.get_weights(), reference.get_weights())
    out["bias_shards"] = [value.shape for _, value in keras_dist.parallel.shards(
        model.get_layer("up").bias)]

    # Dropout on a mesh draws one device's mask (DataParallel and FSDP); keras_dist's
    # per-shard-seed containment off, DTensor's own draws differ.
    dropped = train(build(dropout=0.3))
    for name, make in {"dp": lambda: kd.DataParallel(devices=kd.list_devices()),
                       "fsdp": lambda: FSDP(min_elements=1024)}.items():
        with make().scope():
            model = build(dropout=0.3)
        out[f"dropout_{name}"] = _max(train(model).get_weights(), dropped.get_weights())
    from keras_dist.compat import _distribution_internals as _internals, _patch
    random = _internals._tf_random()
    patched = random.dropout
    random.dropout = _patch.original(random, "dropout")
    try:
        with kd.DataParallel(devices=kd.list_devices()).scope():
            model = build(dropout=0.3)
        out["dropout_per_shard"] = _max(train(model).get_weights(), dropped.get_weights())
    finally:
        random.dropout = patched

    # keras.ops.slice_update in a step on a mesh (keras-hub's KV cache): XLA's
    # DynamicUpdateSlice has no DTensor layout propagation; keras_dist's select equals it.
    class Update(keras.layers.Layer):
        def build(self, shape):
            self.w = self.add_weight((1, 2, 4), initializer="ones")

        def call(self, inputs):
            update = inputs[:, 1:3, :] * self.w + 1.0
            return keras.ops.slice_update(inputs, [0, 3, 0], update)

    def updater():
        return keras.Sequential([keras.Input((5, 4)), Update()])

    cube = rng.normal(size=(8, 5, 4)).astype("float32")
    expected = updater().predict(cube, verbose=0)
    with kd.DataParallel(devices=kd.list_devices()).scope():
        updating = updater()
    out["slice_update"] = float(np.abs(updating.predict(cube, verbose=0) - expected).max())

    # Bad inputs: one message each.
    errors = {}

    def error_of(label, make):
        try:
            make()
        except (ValueError, TypeError) as error:
            errors[label] = f"{type(error).__name__}: {error}"
        finally:
            kd.set_distribution(None)

    error_of("mesh_2d", lambda: FSDP(kd.DeviceMesh((2, 2), ["batch", "model"],
                                                   kd.list_devices())))
    error_of("min_elements", lambda: FSDP(min_elements=-1))
    error_of("both", lambda: FSDP(kd.DeviceMesh((4,), ["batch"], kd.list_devices()),
                                  devices=kd.list_devices()))
    error_of("axis_name", lambda: FSDP(kd.DeviceMesh((4,), ["data"], kd.list_devices())))

    def not_divisible():
        with FSDP(min_elements=16).scope():
            keras.Sequential([keras.Input((5,)), keras.layers.Dense(7, name="odd")])

    error_of("not_divisible", not_divisible)

    def in_strategy_scope():
        with keras_dist.strategy(devices=["/cpu:0", "/cpu:1"]).scope():
            FSDP()

    error_of("strategy_scope", in_strategy_scope)

    def strategy_inside():
        with FSDP().scope(), keras_dist.strategy(devices=["/cpu:0", "/cpu:1"]).scope():
            build()

    error_of("strategy_inside", strategy_inside)
    out["errors"] = errors
    del tf
    return out


@pytest.fixture(scope="module")
def fsdp():
    return run_in_subprocess(_fsdp_scenarios, virtual_devices=4, timeout=300)


def test_fsdp_trains_an_mlp_with_adam_like_one_device(fsdp):
    assert fsdp["mlp"] < 1e-5, fsdp
    assert fsdp["predict"] < 1e-5, fsdp
    assert fsdp["mesh2_min0"] < 1e-5, fsdp


def test_fsdp_shards_each_large_variable_on_its_largest_divisible_dimension(fsdp):
    assert fsdp["layouts"] == {
        "up/kernel": (None, "batch"),    # (16, 64): 1024 elements, its 64 dimension
        "mid/kernel": ("batch", None),   # (64, 64): the first of two equal dimensions
        "down/kernel": (None, None),     # (64, 8): 512 elements, replicated
        "up/bias": (None,), "mid/bias": (None,), "down/bias": (None,)}, fsdp["layouts"]
    assert fsdp["slot_shards"] == [(16, 64)]  # Adam's slots follow their variable
    assert [path.split("/", 1)[1] for path in fsdp["gathered"]] == ["mid/kernel"]
    assert fsdp["bias_shards"] == [(32,), (32,)]  # min_elements=0 shards the biases too


def test_fsdp_each_device_holds_a_quarter_plus_the_replicated_small_variables(fsdp):
    for held in fsdp["per_device"]:
        assert held <= fsdp["bound"] + 1e-9, fsdp


def test_slice_update_on_a_mesh_equals_one_device(fsdp):
    assert fsdp["slice_update"] < 1e-6, fsdp


def test_dropout_on_a_mesh_draws_one_devices_mask(fsdp):
    assert fsdp["dropout_dp"] < 1e-5, fsdp
    assert fsdp["dropout_fsdp"] < 1e-5, fsdp
    # Without keras_dist's draw, DTensor seeds each shard's part by device: other masks.
    assert fsdp["dropout_per_shard"] > 1e-3, fsdp


# (label, what the user did, fragments of the message): docs/bad_inputs.md is rendered from it.
FSDP_CASES = [
    ("mesh_2d", "`FSDP(DeviceMesh((2, 2), ['batch', 'model'], ...))`",
     ("one axis", "(2, 2)", "ModelParallel")),
    ("min_elements", "`FSDP(min_elements=-1)`", ("min_elements", "-1")),
    ("both", "`FSDP(device_mesh, devices=...)`", ("device_mesh or devices",)),
    ("axis_name", "`FSDP(DeviceMesh((4,), ['data'], ...))`, batch_dim_name left 'batch'",
     ("batch_dim_name='batch'", "batch_dim_name='data'")),
    ("not_divisible", "a (5, 7) kernel under `FSDP(min_elements=16)` on 4 devices (no "
     "dimension divisible by 4)", ("odd/kernel'", "(5, 7)", "min_elements=36")),
    ("strategy_scope", "`FSDP()` created inside `keras_dist.strategy().scope()`",
     ("strategy scope", "keras_dist.strategy()")),
    ("strategy_inside", "a model created under `FSDP().scope()` inside "
     "`keras_dist.strategy().scope()`", ("tf.distribute", "Use one")),
]


@pytest.mark.parametrize("label, parts", [(label, parts) for label, _, parts in FSDP_CASES])
def test_fsdp_bad_input_is_a_clear_error(fsdp, label, parts):
    message = fsdp["errors"].get(label, "")
    for part in parts:
        assert part in message, (label, message)


def _guide(path):
    """The keras-io guide, unchanged, on 8 virtual CPUs, then again on one device."""
    import keras
    import numpy as np

    import keras_dist  # noqa: F401

    source = open(path).read()
    runs = {}
    original_fit = keras.Model.fit
    set_distribution = keras.distribution.set_distribution
    for mode in ("one_device", "mesh"):
        np.random.seed(0)
        keras.utils.set_random_seed(0)
        fitted = []

        def fit(self, *args, **kwargs):
            history = original_fit(self, *args, **kwargs)
            fitted.append((self, history.history["loss"]))
            return history

        keras.Model.fit = fit
        if mode == "one_device":
            keras.distribution.set_distribution = lambda value: None
        namespace = {"__name__": "__main__"}
        try:
            exec(compile(source, path, "exec"), namespace)
            # The ModelParallel model (its "d2/output" layout) in predict and eager calls.
            images = np.random.default_rng(1).normal(size=(16, 28, 28, 1))
            predicted = namespace["model"].predict(images, batch_size=8, verbose=0)
            called = np.asarray(namespace["model"](images[:4]))
        finally:
            keras.Model.fit = original_fit
            keras.distribution.set_distribution = set_distribution
            set_distribution(None)
        runs[f"{mode}_outputs"] = (predicted, called)
        runs[mode] = [{"weights": model.get_weights(), "loss": loss,
                       "kernel_shards": sorted({value.shape for _, value in
                                                keras_dist.parallel.shards(model.weights[0])})}
                      for model, loss in fitted]
    return runs


@pytest.mark.slow
def test_the_keras_io_distribution_guide_runs_unchanged_and_equals_one_device():
    runs = run_in_subprocess(_guide, args=(GUIDE,), virtual_devices=8, timeout=300)
    assert len(runs["mesh"]) == len(runs["one_device"]) == 2  # DataParallel, ModelParallel
    for mesh, one in zip(runs["mesh"], runs["one_device"]):
        assert _max(mesh["weights"], one["weights"]) < 1e-5
        assert np.allclose(mesh["loss"], one["loss"], atol=1e-5)
    for mesh, one in zip(runs["mesh_outputs"], runs["one_device_outputs"]):
        assert np.abs(mesh - one).max() < 1e-5  # predict, eager call
    # The (784, 200) first kernel: whole on each device (DataParallel), split in 4 on
    # "model" by the guide's "d1/kernel" key (ModelParallel (2, 4)).
    assert [run["kernel_shards"] for run in runs["mesh"]] == [[(784, 200)], [(784, 50)]]


LLMS = ("mistral", "qwen3", "phi3", "gpt2")


def _keras_hub_fsdp():
    """Tiny keras-hub LLMs (random init, float32, GPT-2 with its dropout) + an LM head,
    SGD with momentum, FSDP(min_elements=1024) on 4 devices against one device."""
    import keras
    import keras_hub
    import numpy as np

    import keras_dist
    from keras_dist.distribution import FSDP

    vocabulary = 128
    models = keras_hub.models
    common = dict(vocabulary_size=vocabulary, num_layers=1, hidden_dim=32,
                  intermediate_dim=64, dtype="float32")
    make = {
        "mistral": lambda: models.MistralBackbone(num_query_heads=4, num_key_value_heads=2,
                                                  sliding_window=8, **common),
        "qwen3": lambda: models.Qwen3Backbone(num_query_heads=4, num_key_value_heads=2,
                                              head_dim=8, **common),
        "phi3": lambda: models.Phi3Backbone(num_query_heads=4, num_key_value_heads=2,
                                            **common),
        "gpt2": lambda: models.GPT2Backbone(num_heads=4, max_sequence_length=16, **common),
    }
    rng = np.random.default_rng(0)
    x = {"token_ids": rng.integers(0, vocabulary, (16, 8)).astype("int32"),
         "padding_mask": np.ones((16, 8), "int32")}
    y = rng.integers(0, vocabulary, (16, 8)).astype("int32")

    def build(name):
        keras.utils.set_random_seed(0)
        inputs = {"token_ids": keras.Input((8,), dtype="int32", name="token_ids"),
                  "padding_mask": keras.Input((8,), dtype="int32", name="padding_mask")}
        logits = keras.layers.Dense(vocabulary, name="lm_head")(make[name]()(inputs))
        model = keras.Model(inputs, logits)
        model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    out = {}
    for name in LLMS:
        reference = build(name)
        reference.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        with FSDP(min_elements=1024).scope():
            model = build(name)
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        large = [v for v in model.weights + model.optimizer.variables
                 if np.prod(v.shape) >= 1024]
        out[name] = {
            "weights": _max(model.get_weights(), reference.get_weights()),
            "fractions": sorted({keras_dist.parallel.shards(v)[0][1].size / np.prod(v.shape)
                                 for v in large}),
            "large_slots": sum("momentum" in v.path for v in large),
        }
    return out


@pytest.fixture(scope="module")
def keras_hub_fsdp():
    return run_in_subprocess(_keras_hub_fsdp, virtual_devices=4, timeout=400)


@pytest.mark.slow
@pytest.mark.parametrize("name", LLMS)
def test_fsdp_trains_keras_hub_llms_like_one_device(keras_hub_fsdp, name):
    out = keras_hub_fsdp[name]
    assert out["weights"] < 1e-4, out
    assert out["fractions"] == [0.25], out  # every large variable and slot: 1/4 per device
    assert out["large_slots"] > 0, out
