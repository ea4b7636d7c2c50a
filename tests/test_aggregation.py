"""Gradient aggregation: N replicas train exactly like one device with the same global batch.

The multi-replica figures come from one subprocess with 4 virtual CPU devices (TF fixes
its devices once per process); it trains the same deterministic model under
OneDeviceStrategy (the reference) and MirroredStrategy on 2 and 4 devices and returns
max-abs weight differences, which the tests below assert on.
"""

import numpy as np
import pytest

from keras_dist.aggregation import AggregationConfig
from keras_dist.testing import run_in_subprocess
from helpers import initial_weights, max_diff

LR = 0.1


def _data(examples=64, scale=1.0):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(examples, 8)).astype("float32")
    y = (rng.normal(size=(examples, 4)) * scale).astype("float32")
    return x, y


def _train(strategy, batch_size, *, callbacks=(), optimizer="sgd", loss_scale=False,
           examples=64, scale=1.0, stock_fit_first=False, **optimizer_kwargs):
    """Trains the reference model one epoch; returns weights, iterations, batch logs."""
    import keras
    import tensorflow as tf

    x, y = _data(examples, scale)
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((8,)), keras.layers.Dense(16, activation="tanh"),
            keras.layers.Dense(4),
        ])
        model.set_weights(initial_weights())
        if optimizer == "sgd":
            opt = keras.optimizers.SGD(LR, **optimizer_kwargs)
        else:
            opt = keras.optimizers.Adam(0.01, **optimizer_kwargs)
        if loss_scale:
            opt = keras.optimizers.LossScaleOptimizer(opt)
        model.compile(optimizer=opt, loss="mse")
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_size)
    batch_logs = []
    recorder = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: batch_logs.append(dict(logs))
    )
    if stock_fit_first:  # traces a train function without keras_dist's hook
        model.fit(dataset, epochs=1, verbose=0, shuffle=False)
        model.set_weights(initial_weights())
        model.optimizer.iterations.assign(0)
    history = model.fit(dataset, epochs=1, verbose=0, shuffle=False,
                        callbacks=[*callbacks, recorder])
    return {
        "weights": model.get_weights(),
        "iterations": int(model.optimizer.iterations.numpy()),
        "batch_logs": batch_logs,
        "history": history.history,
    }


def _mirrored_figures():
    import keras
    import tensorflow as tf

    import keras_dist
    from keras_dist.callbacks import GradientAggregation, GradientNormLogger

    devices = keras_dist.local_devices("CPU")
    one = keras_dist.strategy(kind="one_device", devices=devices[:1])
    two = keras_dist.strategy(devices=devices[:2])
    four = keras_dist.strategy(devices=devices[:4])
    out = {"replicas": [two.num_replicas_in_sync, four.num_replicas_in_sync]}

    ref = _train(one, 16)
    for name, strategy in (("plain_2", two), ("plain_4", four)):
        run = _train(strategy, 16, callbacks=[GradientAggregation()])
        out[name] = max_diff(ref["weights"], run["weights"])

    # Clipping: ours after the all-reduce vs single-device Keras global_clipnorm.
    ref_clip = _train(one, 16, global_clipnorm=0.5)
    ours = _train(two, 16, callbacks=[GradientAggregation(clipnorm=0.5)])
    out["clip_2"] = max_diff(ref_clip["weights"], ours["weights"])
    out["clip_moves_weights"] = max_diff(ref_clip["weights"], ref["weights"])
    stock = _train(two, 16, global_clipnorm=0.5)
    out["stock_clip_2"] = max_diff(ref_clip["weights"], stock["weights"])
    # A train function traced by an earlier fit without the hook is rebuilt.
    retraced = _train(two, 16, stock_fit_first=True, callbacks=[GradientAggregation(clipnorm=0.5)])
    out["clip_2_second_fit"] = max_diff(ref_clip["weights"], retraced["weights"])
    # Keras' own global_clipnorm acts on the aggregated gradient once the hook is in.
    hooked_keras_clip = _train(two, 16, callbacks=[GradientAggregation()], global_clipnorm=0.5)
    out["keras_clip_2_hooked"] = max_diff(ref_clip["weights"], hooked_keras_clip["weights"])

    # Accumulation: 4 micro-batches of 16 == one batch of 64 (SGD, Adam, LSO).
    for name, kwargs in (("sgd", {}), ("adam", {"optimizer": "adam"}),
                         ("lso", {"loss_scale": True})):
        ref_big = _train(one, 64, examples=256, **kwargs)
        callback = GradientAggregation(accumulation_steps=4)
        run = _train(two, 16, examples=256, callbacks=[callback], **kwargs)
        out[f"acc_{name}_2"] = max_diff(ref_big["weights"], run["weights"])
        out[f"acc_{name}_2_counts"] = (callback.aggregator.all_reduce_count,
                                       run["iterations"], ref_big["iterations"])
    callback = GradientAggregation(accumulation_steps=4, compression="bf16", clipnorm=0.5)
    ref_big = _train(one, 64, examples=256, global_clipnorm=0.5)
    run = _train(four, 16, examples=256, callbacks=[callback])
    out["acc_bf16_clip_4"] = max_diff(ref_big["weights"], run["weights"])

    for compression in ("bf16", "fp16"):
        callback = GradientAggregation(compression=compression)
        run = _train(four, 16, callbacks=[callback])
        out[compression + "_4"] = max_diff(ref["weights"], run["weights"])
        out[compression + "_4_fallbacks"] = callback.aggregator.fallback_count

    # fp16 overflow (targets x 1e6: gradients far above 65504) falls back to fp32.
    exact = _train(two, 16, scale=1e6, callbacks=[GradientAggregation()])
    callback = GradientAggregation(compression="fp16")
    run = _train(two, 16, scale=1e6, callbacks=[callback])
    out["fp16_overflow_2"] = max_diff(exact["weights"], run["weights"])
    out["fp16_overflow_finite"] = all(np.isfinite(w).all() for w in run["weights"])
    out["fp16_overflow_fallbacks"] = (callback.aggregator.fallback_count,
                                      callback.aggregator.all_reduce_count)

    # gradient_norm at the first step vs the single-device gradient, by hand.
    x, y = _data()
    with one.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"),
                                  keras.layers.Dense(4)])
        model.set_weights(initial_weights())
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(x[:16]) - y[:16]))
    grads = tape.gradient(loss, model.trainable_variables)
    out["norm_by_hand"] = float(tf.linalg.global_norm(grads))
    run = _train(two, 16, callbacks=[GradientNormLogger(update_freq="batch")])
    out["norm_2_first_step"] = run["batch_logs"][0]["gradient_norm"]
    out["norm_2_epoch"] = run["history"]["gradient_norm"]
    return out


@pytest.fixture(scope="module")
def mirrored():
    return run_in_subprocess(_mirrored_figures, virtual_devices=4, timeout=400)


# -- pure transformations ------------------------------------------------------------
def test_global_norm_and_clip_match_numpy():
    import tensorflow as tf

    from keras_dist.aggregation import ops

    grads = [tf.constant([3.0, 4.0]), None, tf.constant([[12.0]])]
    norm = ops.global_norm(grads)
    assert float(norm) == pytest.approx(13.0)
    clipped = ops.clip_by_global_norm(grads, 6.5, norm)
    assert clipped[1] is None
    np.testing.assert_allclose(clipped[0].numpy(), [1.5, 2.0], rtol=1e-6)
    unclipped = ops.clip_by_global_norm(grads, 100.0, norm)
    np.testing.assert_allclose(unclipped[2].numpy(), [[12.0]], rtol=1e-6)
    # Rows sharing an index count once with their sum, as in the dense gradient.
    sparse = tf.IndexedSlices(tf.constant([[3.0], [1.0]]), tf.constant([0, 0]), [2, 1])
    assert float(ops.global_norm([sparse])) == pytest.approx(4.0)


def test_compress_round_trip_and_groups():
    import tensorflow as tf

    from keras_dist.aggregation import ops

    grads = [tf.constant([1.0 + 2**-12], tf.float32), tf.constant([1.0], tf.float16),
             tf.constant([0.5], tf.float64)]
    dtypes = ops.dtypes_of(grads)
    compressed = ops.compress(grads, "bf16")
    assert [g.dtype for g in compressed] == [tf.bfloat16, tf.float16, tf.bfloat16]
    restored = ops.decompress(compressed, dtypes)
    assert [g.dtype for g in restored] == dtypes
    assert float(restored[0][0]) == 1.0  # bf16 drops the 2**-12
    assert ops.compress(grads, None) == grads
    assert list(ops.group_by_dtype(compressed).values()) == [[0, 2], [1]]
    assert bool(ops.all_finite(grads))
    assert not bool(ops.all_finite([tf.constant([np.inf], tf.float16)]))


@pytest.mark.parametrize("kwargs, message", [
    ({"clipnorm": 0}, "clipnorm"),
    ({"clipnorm": True}, "clipnorm"),
    ({"compression": "int8"}, "compression"),
    ({"accumulation_steps": 0}, "accumulation_steps"),
    ({"accumulation_steps": 2.0}, "accumulation_steps"),
    ({"bytes_per_pack": -1}, "bytes_per_pack"),
    ({"timeout_seconds": 0}, "timeout_seconds"),
    ({"implementation": "mpi"}, "implementation"),
])
def test_config_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=f"`{message}`.*Received"):
        AggregationConfig(**kwargs)


# -- one replica (the default strategy, in this process) ------------------------------
def test_one_replica_is_the_identity_and_features_still_work():
    import tensorflow as tf

    from keras_dist.callbacks import GradientAggregation

    default = tf.distribute.get_strategy()
    stock = _train(default, 16)
    ours = _train(default, 16, callbacks=[GradientAggregation()])
    assert max_diff(stock["weights"], ours["weights"]) == 0.0
    clipped = _train(default, 16, callbacks=[GradientAggregation(clipnorm=0.5)])
    keras_clip = _train(default, 16, global_clipnorm=0.5)
    assert max_diff(clipped["weights"], keras_clip["weights"]) < 1e-6
    callback = GradientAggregation(accumulation_steps=4)
    accumulated = _train(default, 16, examples=256, callbacks=[callback])
    big_batch = _train(default, 64, examples=256)
    assert max_diff(accumulated["weights"], big_batch["weights"]) < 1e-6
    assert callback.aggregator.all_reduce_count == 4
    assert accumulated["iterations"] == big_batch["iterations"] == 4


# -- several replicas (MirroredStrategy, 2 and 4 virtual devices) ----------------------
@pytest.mark.multiworker
@pytest.mark.slow
def test_mirrored_equals_single_device(mirrored):
    assert mirrored["replicas"] == [2, 4]
    assert mirrored["plain_2"] < 1e-5
    assert mirrored["plain_4"] < 1e-5


@pytest.mark.multiworker
@pytest.mark.slow
def test_clipnorm_after_all_reduce_equals_single_device_global_clipnorm(mirrored):
    assert mirrored["clip_moves_weights"] > 1e-3, "the clip must be active in this test"
    assert mirrored["clip_2"] < 1e-5
    assert mirrored["clip_2_second_fit"] < 1e-5
    assert mirrored["keras_clip_2_hooked"] < 1e-5


@pytest.mark.multiworker
@pytest.mark.slow
def test_stock_keras_clipping_acts_on_the_aggregated_gradient(mirrored):
    # Upstream clips each replica's local gradient before the all-reduce; under
    # keras_dist.strategy() the clip_after_all_reduce fix makes it one-device clipping
    # (upstream's behaviour under plain tf.distribute: tests/test_stock_optimizer.py).
    assert mirrored["stock_clip_2"] < 1e-5


@pytest.mark.parametrize("name", ["sgd", "adam", "lso"])
@pytest.mark.multiworker
@pytest.mark.slow
def test_accumulation_equals_single_device_with_k_times_the_batch(mirrored, name):
    assert mirrored[f"acc_{name}_2"] < 1e-5
    all_reduces, iterations, reference_iterations = mirrored[f"acc_{name}_2_counts"]
    assert all_reduces == 16 // 4  # 16 micro-steps
    assert iterations == reference_iterations == 4


@pytest.mark.multiworker
@pytest.mark.slow
def test_accumulation_compression_and_clipping_compose(mirrored):
    assert mirrored["acc_bf16_clip_4"] < 2e-3


@pytest.mark.multiworker
@pytest.mark.slow
def test_compression_within_documented_tolerance(mirrored):
    assert mirrored["bf16_4"] < 2e-3
    assert mirrored["fp16_4"] < 3e-4
    assert mirrored["bf16_4_fallbacks"] == mirrored["fp16_4_fallbacks"] == 0


@pytest.mark.multiworker
@pytest.mark.slow
def test_fp16_overflow_falls_back_to_float32(mirrored):
    assert mirrored["fp16_overflow_finite"]
    fallbacks, rounds = mirrored["fp16_overflow_fallbacks"]
    assert fallbacks == rounds == 4
    assert mirrored["fp16_overflow_2"] == 0.0


@pytest.mark.multiworker
@pytest.mark.slow
def test_gradient_norm_is_the_single_device_norm(mirrored):
    assert mirrored["norm_2_first_step"] == pytest.approx(mirrored["norm_by_hand"], rel=1e-5)
    assert mirrored["norm_2_epoch"][0] > 0


def test_strategy_and_aggregation_share_one_communication_options_object():
    """One check and one conversion for implementation/bytes_per_pack/timeout_seconds."""
    import keras_dist
    from keras_dist.strategies.communication import CommunicationSettings

    config = AggregationConfig(bytes_per_pack=1 << 20, timeout_seconds=30,
                               implementation="ring")
    assert config.communication == CommunicationSettings("ring", 1 << 20, 30)
    options = config.communication.to_tf()
    assert (options.bytes_per_pack, options.timeout_seconds) == (1 << 20, 30)
    for bad in ({"bytes_per_pack": -1}, {"timeout_seconds": 0}, {"implementation": "mpi"}):
        with pytest.raises(ValueError) as from_config:
            AggregationConfig(**bad)
        with pytest.raises(ValueError) as from_strategy:
            keras_dist.strategy(**bad)
        assert str(from_config.value) == str(from_strategy.value)
