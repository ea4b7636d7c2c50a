"""Stock optimizer options under keras_dist.strategy() train like one device.

`clipnorm`, `global_clipnorm` and `clipvalue` act on the aggregated gradient, and
`gradient_accumulation_steps` works (Keras' own one-device semantics), with no keras_dist
callback: in `fit`, in a custom `strategy.run` loop, and inside a `LossScaleOptimizer`.
One subprocess with 4 virtual CPU devices and one launch of 2 workers train every case
there and on one device (same global batch) and return the weights; the tests compare.
"""

from __future__ import annotations


import numpy as np
import pytest

from keras_dist.testing import run_in_subprocess
from helpers import initial_weights, max_diff, start_workers_first

# The fixtures train every case before the first test that uses them returns.
pytestmark = [pytest.mark.multiworker, pytest.mark.slow, pytest.mark.timeout(900)]

GLOBAL_BATCH = 16
EXAMPLES = 64
EPOCHS = 2
TOLERANCE = 1e-5

# name -> how the optimizer is built (see `_optimizer`). The LossScaleOptimizer case also
# checks that learning-rate schedules see micro-steps and Adam's bias correction updates,
# as on one device; the EMA cases compare weights overwritten with the moving average.
CASES = {
    "sgd_clipnorm": {"clipnorm": 0.05},
    "sgd_global_clipnorm": {"global_clipnorm": 0.05},
    "adam_global_clipnorm": {"optimizer": "adam", "global_clipnorm": 0.1},
    "sgd_clipvalue": {"clipvalue": 0.01},
    "sgd_accumulate_4": {"gradient_accumulation_steps": 4},
    "lso_adam_accumulate_2_schedule_global_clipnorm": {
        "optimizer": "adam", "loss_scale": True, "schedule": True,
        "gradient_accumulation_steps": 2, "global_clipnorm": 0.1,
    },
    "sgd_ema_overwrite_3": {"use_ema": True, "ema_overwrite_frequency": 3},
    "sgd_ema_overwrite_2_accumulate_2": {
        "use_ema": True, "ema_overwrite_frequency": 2, "gradient_accumulation_steps": 2,
    },
}
_OPTION_FIXES = ("clip_after_all_reduce", "optimizer_conds_cross_replica")


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(EXAMPLES, 8)).astype("float32")
    y = rng.normal(size=(EXAMPLES, 4)).astype("float32")
    return x, y


def _optimizer(spec):
    import keras

    spec = dict(spec)
    name = spec.pop("optimizer", "sgd")
    loss_scale = spec.pop("loss_scale", False)
    learning_rate = 0.1 if name == "sgd" else 0.01
    if spec.pop("schedule", False):
        learning_rate = keras.optimizers.schedules.ExponentialDecay(
            learning_rate, decay_steps=1, decay_rate=0.7)
    cls = keras.optimizers.SGD if name == "sgd" else keras.optimizers.Adam
    optimizer = cls(learning_rate, **spec)
    if loss_scale:
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer, initial_scale=2.0**10)
    return optimizer


def _model(strategy, spec):
    import keras

    with strategy.scope():
        model = keras.Sequential([
            keras.Input((8,)), keras.layers.Dense(16, activation="tanh"),
            keras.layers.Dense(4),
        ])
        model.set_weights(initial_weights())
        model.compile(optimizer=_optimizer(spec), loss="mse")
    return model


def _fit(strategy, spec, callbacks=()):
    """Trains `EPOCHS` epochs with `model.fit`; returns weights and `iterations`."""
    import tensorflow as tf

    model = _model(strategy, spec)
    dataset = tf.data.Dataset.from_tensor_slices(_data()).batch(GLOBAL_BATCH)
    model.fit(dataset, epochs=EPOCHS, verbose=0, shuffle=False, callbacks=list(callbacks))
    return {"weights": model.get_weights(), "iterations": int(model.optimizer.iterations.numpy())}


def _custom_loop(strategy, spec):
    """The TF custom-training tutorial's loop: `strategy.run` + `apply_gradients`."""
    import tensorflow as tf

    model = _model(strategy, spec)
    optimizer = model.optimizer
    dataset = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices(_data()).batch(GLOBAL_BATCH))

    def train_step(x, y):
        with tf.GradientTape() as tape:
            per_example = tf.reduce_mean(tf.square(model(x, training=True) - y), axis=-1)
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    @tf.function
    def distributed_step(x, y):
        strategy.run(train_step, args=(x, y))

    for _ in range(EPOCHS):
        for x, y in dataset:
            distributed_step(x, y)
    return {"weights": model.get_weights(), "iterations": int(optimizer.iterations.numpy())}


def _compare(strategy, one_device, references):
    """{case: {"diff", "iterations", "reference_iterations"}}; fills `references`."""
    out = {}
    for name, spec in CASES.items():
        ours = _fit(strategy, spec)
        reference = references[name] = _fit(one_device, spec)
        out[name] = {
            "diff": max_diff(ours["weights"], reference["weights"]),
            "iterations": ours["iterations"],
            "reference_iterations": reference["iterations"],
        }
    return out


def _error_of(function):
    try:
        function()
    except Exception as error:  # the test asserts on the type and message
        return f"{type(error).__name__}: {error}"
    return None


def _four_devices():
    import os

    import tensorflow as tf

    import keras_dist
    from keras_dist import compat
    from keras_dist.callbacks import GradientAggregation

    devices = keras_dist.local_devices("CPU")
    strategy = keras_dist.strategy(devices=devices[:4])
    one = tf.distribute.get_strategy()
    references = {}
    out = {"replicas": strategy.num_replicas_in_sync,
           "fit": _compare(strategy, one, references), "references": references}

    loop_spec = {"optimizer": "adam", "global_clipnorm": 0.1, "gradient_accumulation_steps": 2}
    ours, reference = _custom_loop(strategy, loop_spec), _custom_loop(one, loop_spec)
    out["custom_loop"] = {"diff": max_diff(ours["weights"], reference["weights"]),
                          "iterations": (ours["iterations"], reference["iterations"])}

    # Never clip twice: GradientAggregation with the optimizer's own clipping clips once,
    # after the all-reduce; keras_dist's and Keras' clipping together are refused.
    clip = CASES["sgd_global_clipnorm"]
    clip_reference = references["sgd_global_clipnorm"]["weights"]
    out["callback_and_keras_clip"] = max_diff(
        _fit(strategy, clip, [GradientAggregation()])["weights"], clip_reference)
    out["callback_clip_and_keras_clip"] = _error_of(
        lambda: _fit(strategy, clip, [GradientAggregation(clipnorm=0.05)]))

    # A tf.distribute strategy keras_dist did not create keeps stock Keras behaviour.
    plain = tf.distribute.MirroredStrategy(devices[:4])
    out["plain_tf_distribute_clip"] = max_diff(_fit(plain, clip)["weights"], clip_reference)

    # Without the fixes, upstream's behaviour comes back (what the fixes are for).
    os.environ["KERAS_DIST_DISABLE_COMPAT"] = ",".join(_OPTION_FIXES)
    compat.revert()
    compat.apply()
    out["disabled_clip"] = max_diff(_fit(strategy, clip)["weights"], clip_reference)
    out["disabled_accumulate"] = _error_of(lambda: _fit(strategy, CASES["sgd_accumulate_4"]))
    return out


@pytest.fixture(scope="module")
def _launch(request):
    return start_workers_first(request, "two_workers", _on_each_worker, timeout=600)


@pytest.fixture(scope="module")
def four_devices(_launch):
    return run_in_subprocess(_four_devices, virtual_devices=4, timeout=600)


@pytest.fixture(scope="module")
def two_workers(_launch):
    return _launch.result()


@pytest.mark.parametrize("name", sorted(CASES))
def test_fit_on_four_replicas_equals_one_device(four_devices, name):
    assert four_devices["replicas"] == 4
    case = four_devices["fit"][name]
    assert case["diff"] < TOLERANCE, case
    assert case["iterations"] == case["reference_iterations"]


def test_custom_training_loop_equals_one_device(four_devices):
    loop = four_devices["custom_loop"]
    assert loop["diff"] < TOLERANCE, loop
    # 8 micro-steps, gradient_accumulation_steps=2: iterations counts updates, as on one device.
    assert loop["iterations"] == (4 * EPOCHS // 2, 4 * EPOCHS // 2)


def test_gradient_aggregation_never_clips_twice(four_devices):
    assert four_devices["callback_and_keras_clip"] < TOLERANCE
    message = four_devices["callback_clip_and_keras_clip"]
    assert message.startswith("ValueError") and "clipped twice" in message


def test_strategies_keras_dist_did_not_create_stay_stock(four_devices):
    # Stock Keras clips each replica's local gradient before the all-reduce.
    assert four_devices["plain_tf_distribute_clip"] > 1e-3


def test_without_the_fixes_upstream_is_wrong(four_devices):
    assert four_devices["disabled_clip"] > 1e-3
    assert four_devices["disabled_accumulate"] is not None


def _on_each_worker():
    """Every case on 2 workers (the one-device references: `four_devices`')."""
    import keras_dist

    strategy = keras_dist.strategy()
    return {"replicas": strategy.num_replicas_in_sync,
            "runs": {name: _fit(strategy, spec) for name, spec in CASES.items()}}


@pytest.mark.multiworker
def test_two_workers_equal_one_device(two_workers, four_devices):
    workers = two_workers
    # The same data, initial weights and one-device fit as the references trained there.
    references = four_devices["references"]
    for worker in workers:
        assert worker["replicas"] == 2
        for name, reference in references.items():
            run = worker["runs"][name]
            diff = max_diff(run["weights"], reference["weights"])
            assert diff < TOLERANCE, (name, diff)
            assert run["iterations"] == reference["iterations"], name
