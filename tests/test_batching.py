"""Batch arithmetic: global vs per-replica batch and learning-rate scaling, with errors.

This process has TensorFlow's default strategy (1 replica); the 4-replica arithmetic runs
in a fresh process with 4 virtual CPU devices (logical devices are fixed per process).
"""

import math

import pytest

import keras_dist
from keras_dist.testing import run_in_subprocess


def test_one_replica_by_default():
    assert keras_dist.global_batch_size(64) == 64
    assert keras_dist.per_replica_batch_size(64) == 64
    assert keras_dist.scale_learning_rate(0.1) == pytest.approx(0.1)
    assert keras_dist.scale_learning_rate(0.1, base_batch=256, per_replica=64) == (
        pytest.approx(0.025))
    assert keras_dist.scale_learning_rate(0.1, rule="sqrt", base_batch=16,
                                          per_replica=64) == pytest.approx(0.2)


@pytest.mark.parametrize("value", [0, -3, 2.0, True, "8", None])
def test_batch_sizes_must_be_positive_integers(value):
    with pytest.raises(ValueError, match="per_replica"):
        keras_dist.global_batch_size(value)
    with pytest.raises(ValueError, match="global_batch"):
        keras_dist.per_replica_batch_size(value)


@pytest.mark.parametrize("base_lr", [0, -0.1, math.nan, math.inf, True, "0.1"])
def test_base_lr_must_be_positive_and_finite(base_lr):
    with pytest.raises(ValueError, match="base_lr"):
        keras_dist.scale_learning_rate(base_lr)


def test_scale_learning_rate_argument_errors():
    with pytest.raises(ValueError, match="rule"):
        keras_dist.scale_learning_rate(0.1, rule="cubic")
    with pytest.raises(ValueError, match="per_replica"):
        keras_dist.scale_learning_rate(0.1, per_replica=32)
    with pytest.raises(ValueError, match="needs `per_replica`"):
        keras_dist.scale_learning_rate(0.1, base_batch=256)
    with pytest.raises(ValueError, match="base_batch"):
        keras_dist.scale_learning_rate(0.1, base_batch=0, per_replica=32)


def test_strategy_must_be_a_strategy():
    with pytest.raises(TypeError, match="tf.distribute.Strategy"):
        keras_dist.global_batch_size(8, strategy="mirrored")


def _four_replica_arithmetic():
    import tensorflow as tf

    import keras_dist

    strategy = keras_dist.strategy()
    errors = {}
    for label, global_batch in (("not_divisible", 30), ("below_replicas", 2)):
        try:
            keras_dist.per_replica_batch_size(global_batch)
        except ValueError as error:
            errors[label] = str(error)
    one_device = tf.distribute.OneDeviceStrategy("/cpu:0")
    with one_device.scope():
        in_scope = keras_dist.global_batch_size(8)
    return {
        "replicas": strategy.num_replicas_in_sync,
        "global": keras_dist.global_batch_size(8),
        "per_replica": keras_dist.per_replica_batch_size(32),
        "linear": keras_dist.scale_learning_rate(0.1),
        "sqrt": keras_dist.scale_learning_rate(1e-3, rule="sqrt"),
        "none": keras_dist.scale_learning_rate(0.1, rule="none"),
        "base_batch": keras_dist.scale_learning_rate(0.1, base_batch=256, per_replica=64),
        "explicit_strategy": keras_dist.global_batch_size(8, strategy=one_device),
        "active_scope": in_scope,
        "errors": errors,
    }


@pytest.mark.timeout(240)
@pytest.mark.multiworker
@pytest.mark.slow
def test_four_replicas():
    result = run_in_subprocess(_four_replica_arithmetic, virtual_devices=4, timeout=180)
    assert result["replicas"] == 4
    assert result["global"] == 32 and result["per_replica"] == 8
    assert result["linear"] == pytest.approx(0.4)
    assert result["sqrt"] == pytest.approx(2e-3)
    assert result["none"] == pytest.approx(0.1)
    assert result["base_batch"] == pytest.approx(0.1)  # 64 x 4 = 256: unchanged
    # An explicit strategy, then the active scope, win over the one keras_dist created.
    assert result["explicit_strategy"] == 8 and result["active_scope"] == 8
    message = result["errors"]["not_divisible"]
    assert "30" in message and "4" in message and "28" in message and "32" in message
    assert result["errors"]["below_replicas"].endswith("e.g. 4.")
