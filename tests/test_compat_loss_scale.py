"""LossScaleOptimizer must skip a step when *any* replica's gradient is not finite.

Upstream (keras-team/keras#18691, Keras 3.0 - 3.15.1 at least), `_tf_apply` takes the
finite/non-finite decision from the first replica's local gradients. Here replica 1
(the second half of the first global batch) overflows; replica 0 does not. With
keras_dist's `loss_scale_finite_across_replicas` fix the step is skipped on all
replicas and the scale halves; with `KERAS_DIST_DISABLE_COMPAT` naming it, inf/NaN
reaches the weights.
"""

import numpy as np
import pytest

from keras_dist.testing import run_in_subprocess

INITIAL_SCALE = 1024.0
FIX = "loss_scale_finite_across_replicas"


def _poison_layer():
    import keras

    class PoisonMarked(keras.layers.Layer):
        """Multiplies rows whose last input feature is 1 by inf (an overflow)."""

        def call(self, inputs, marker):
            factor = keras.ops.where(marker > 0.5, np.inf, 1.0)
            return inputs * keras.ops.cast(factor, inputs.dtype)[:, None]

    return PoisonMarked()


def _model(strategy, accumulation_steps=1, mixed=False):
    import keras

    from keras_dist.callbacks import GradientAggregation

    if mixed:
        keras.mixed_precision.set_dtype_policy("mixed_float16")
    with strategy.scope():
        inputs = keras.Input((9,))
        features, marker = inputs[:, :8], inputs[:, 8]
        # Mixed precision: small weights, so that at Keras' default scale (2**15) only the
        # poisoned replica overflows (each replica's loss is its own mean, as on one device).
        hidden = keras.layers.Dense(4, kernel_initializer=keras.initializers.Constant(
            0.1 if mixed else 1.0))(features)
        outputs = _poison_layer()(hidden, marker)
        model = keras.Model(inputs, keras.layers.Activation("linear", dtype="float32")(outputs))
        optimizer = keras.optimizers.SGD(0.1)
        if not mixed:  # mixed_float16 wraps the optimizer itself
            optimizer = keras.optimizers.LossScaleOptimizer(optimizer, initial_scale=INITIAL_SCALE)
        model.compile(optimizer=optimizer, loss="mse")
    keras.mixed_precision.set_dtype_policy("float32")
    callbacks = [GradientAggregation(accumulation_steps=accumulation_steps)] if (
        accumulation_steps > 1) else []
    return model, callbacks


def _poisoned_data(steps=2, global_batch=16):
    """`steps` global batches; rows 8-15 of the first (replica 1's half) overflow."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(steps * global_batch, 9)).astype("float32")
    x[:, 8] = 0.0
    x[global_batch // 2:global_batch, 8] = 1.0
    y = rng.normal(size=(steps * global_batch, 4)).astype("float32")
    return x, y


def _loss_scale_runs():
    """(weights finite, scale, iterations, weights) per case, on 2 replicas."""
    import tensorflow as tf

    import keras_dist

    two = keras_dist.strategy(devices=keras_dist.local_devices("CPU")[:2])
    one = keras_dist.strategy(kind="one_device", devices=keras_dist.local_devices("CPU")[:1])
    x, y = _poisoned_data()
    results = {}
    for name, strategy, kwargs, data in (
        ("lso", two, {}, (x, y)),
        ("lso_accumulate", two, {"accumulation_steps": 2}, (x, y)),
        ("mixed_float16", two, {"mixed": True}, (x, y)),
        # Reference: one device, trained only on the clean second batch.
        ("reference", one, {}, (x[16:], y[16:])),
    ):
        model, callbacks = _model(strategy, **kwargs)
        dataset = tf.data.Dataset.from_tensor_slices(data).batch(16)
        model.fit(dataset, epochs=1, verbose=0, shuffle=False, callbacks=callbacks)
        weights = model.get_weights()
        results[name] = {
            "finite": all(bool(np.isfinite(w).all()) for w in weights),
            "scale": float(model.optimizer.dynamic_scale.numpy()),
            "iterations": int(model.optimizer.iterations.numpy()),
            "weights": weights,
        }
    return results


@pytest.fixture(scope="module")
def with_fix():
    return run_in_subprocess(_loss_scale_runs, virtual_devices=2, timeout=300)


@pytest.fixture(scope="module")
def without_fix():
    return run_in_subprocess(_loss_scale_runs, virtual_devices=2, timeout=300,
                             env={"KERAS_DIST_DISABLE_COMPAT": FIX})


@pytest.mark.multiworker
@pytest.mark.slow
def test_overflow_on_replica_1_skips_the_step_everywhere(with_fix):
    lso = with_fix["lso"]
    assert lso["finite"]
    assert lso["scale"] == INITIAL_SCALE / 2
    assert lso["iterations"] == 1  # the poisoned step was skipped, the clean one applied
    reference = with_fix["reference"]
    for got, expected in zip(lso["weights"], reference["weights"]):
        np.testing.assert_allclose(got, expected, atol=1e-5)


@pytest.mark.multiworker
@pytest.mark.slow
def test_overflow_skips_with_accumulation_and_mixed_precision(with_fix):
    # With accumulation_steps=2 the poisoned micro-step is dropped: one clean micro-step
    # is not yet an update.
    accumulate = with_fix["lso_accumulate"]
    assert accumulate["finite"]
    assert accumulate["scale"] == INITIAL_SCALE / 2
    assert accumulate["iterations"] == 0
    mixed = with_fix["mixed_float16"]
    assert mixed["finite"]
    assert mixed["scale"] == 2.0**15 / 2  # Keras' default initial scale, halved
    assert mixed["iterations"] == 1


@pytest.mark.multiworker
@pytest.mark.slow
def test_without_the_fix_the_overflow_reaches_the_weights(without_fix):
    # Pins the upstream bug: only replica 0's (finite) gradients were checked, so the
    # poisoned step was applied. (The scale is halved only by the next step, whose
    # gradients are NaN on every replica because the weights already are.)
    for name in ("lso", "lso_accumulate", "mixed_float16"):
        assert not without_fix[name]["finite"], name


def test_fix_is_registered_and_probe_gated():
    from keras_dist import compat

    fix = {f.name: f for f in compat.FIXES}[FIX]
    # The bug is in every Keras 3 release so far, and in the pinned keras-nightly.
    assert fix.probe() == compat.PRESENT
