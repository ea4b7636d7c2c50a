"""keras_dist.callbacks: argument checks, logs users see, and the replica sync check.

One-replica behaviour runs in this process (default strategy); the replica sync check
and per-replica figures run in one subprocess with 2 virtual CPU devices.
"""

import keras
import numpy as np
import pytest

from keras_dist import callbacks as kd_callbacks
from keras_dist.testing import run_in_subprocess


def _model(strategy=None, **optimizer_kwargs):
    import tensorflow as tf

    strategy = strategy or tf.distribute.get_strategy()
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(**{"learning_rate": 0.1, **optimizer_kwargs}),
                      loss="mse")
    return model


def _dataset(examples=48, batch_size=8):
    import tensorflow as tf

    rng = np.random.default_rng(0)
    x = rng.normal(size=(examples, 4)).astype("float32")
    y = rng.normal(size=(examples, 1)).astype("float32")
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_size)


def _learning_rates(model, callbacks, epochs=1):
    """The learning rate each batch trained with."""
    rates = []
    recorder = keras.callbacks.LambdaCallback(
        on_train_batch_begin=lambda batch, logs: rates.append(
            float(model.optimizer.learning_rate.numpy()))
    )
    history = model.fit(_dataset(), epochs=epochs, verbose=0, shuffle=False,
                        callbacks=[*callbacks, recorder])
    return rates, history.history


def test_public_surface():
    assert sorted(kd_callbacks.__all__) == [
        "BackupAndRestore", "BackupError", "GradientAggregation", "GradientNormLogger",
        "LearningRateWarmup", "ModelCheckpoint", "Profiler", "ReplicaDivergenceError",
        "ReplicaSyncCheck", "StepTimeMonitor", "TensorBoard", "Throughput",
    ]
    from keras_dist.callbacks.base import Callback

    classes = [getattr(kd_callbacks, name) for name in kd_callbacks.__all__
               if name not in ("ReplicaDivergenceError", "BackupError")]
    for cls in classes:
        # One base for all, so tf_keras' CallbackList can ask each about its batch hooks.
        assert issubclass(cls, Callback), cls
        assert issubclass(cls, keras.callbacks.Callback), cls
    # One module per callback (the chief-only writers share one in keras_dist.checkpointing).
    own_modules = [cls.__module__ for cls in classes
                   if cls.__name__ not in ("ModelCheckpoint", "TensorBoard")]
    assert len(set(own_modules)) == len(own_modules), own_modules


@pytest.mark.parametrize("make, message", [
    (lambda: kd_callbacks.GradientAggregation(clipnorm=-1.0), "`clipnorm`"),
    (lambda: kd_callbacks.GradientAggregation(compression="fp8"), "`compression`"),
    (lambda: kd_callbacks.GradientAggregation(accumulation_steps=0), "`accumulation_steps`"),
    (lambda: kd_callbacks.GradientNormLogger(update_freq="step"), "`update_freq`"),
    (lambda: kd_callbacks.ReplicaSyncCheck(every_n_batches=0), "`every_n_batches`"),
    (lambda: kd_callbacks.LearningRateWarmup(), "exactly one"),
    (lambda: kd_callbacks.LearningRateWarmup(warmup_epochs=1, warmup_steps=5), "exactly one"),
    (lambda: kd_callbacks.LearningRateWarmup(warmup_steps=0), "`warmup_steps`"),
    (lambda: kd_callbacks.LearningRateWarmup(warmup_steps=2, target_lr=-1), "`target_lr`"),
    (lambda: kd_callbacks.Throughput(global_batch_size=0), "`global_batch_size`"),
])
def test_constructors_validate(make, message):
    with pytest.raises(ValueError, match=message):
        make()


@pytest.mark.parametrize("optimizer_kwargs, aggregation_kwargs, message", [
    ({"global_clipnorm": 1.0}, {"clipnorm": 1.0}, "Remove global_clipnorm"),
    ({"clipvalue": 1.0}, {"clipnorm": 1.0}, "Remove clipvalue"),
    ({"gradient_accumulation_steps": 2}, {}, "keras-team/keras#20582"),
])
def test_gradient_aggregation_refuses_conflicting_optimizer_settings(
        optimizer_kwargs, aggregation_kwargs, message):
    model = _model(**optimizer_kwargs)
    with pytest.raises(ValueError, match=message):
        model.fit(_dataset(), verbose=0, shuffle=False,
                  callbacks=[kd_callbacks.GradientAggregation(**aggregation_kwargs)])


def test_gradient_norm_logger_extends_history_with_the_epoch_mean():
    model = _model()
    batch_norms = []
    recorder = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: batch_norms.append(logs["gradient_norm"]))
    history = model.fit(_dataset(), epochs=2, verbose=0, shuffle=False, callbacks=[
        kd_callbacks.GradientNormLogger(update_freq="batch"), recorder])
    assert len(history.history["gradient_norm"]) == 2
    assert "loss" in history.history  # extended, not replaced
    assert history.history["gradient_norm"][1] == pytest.approx(np.mean(batch_norms[6:]))


def test_learning_rate_warmup_is_linear_then_constant():
    model = _model(learning_rate=0.4)
    rates, history = _learning_rates(
        model, [kd_callbacks.LearningRateWarmup(warmup_steps=4, initial_lr=0.1)])
    np.testing.assert_allclose(rates, [0.175, 0.25, 0.325, 0.4, 0.4, 0.4], rtol=1e-6)
    assert history["learning_rate"] == [pytest.approx(0.4)]
    # Resuming (a second fit) continues from optimizer.iterations: already warm.
    rates, _ = _learning_rates(model, [kd_callbacks.LearningRateWarmup(warmup_steps=4)])
    np.testing.assert_allclose(rates, [0.4] * 6, rtol=1e-6)


def test_learning_rate_warmup_by_epochs_counts_updates_under_accumulation():
    model = _model(learning_rate=0.4)
    warmup = kd_callbacks.LearningRateWarmup(warmup_epochs=1, initial_lr=0.0)
    rates, _ = _learning_rates(model, [warmup], epochs=2)  # 6 steps per epoch
    np.testing.assert_allclose(rates[:6], 0.4 * np.arange(1, 7) / 6, rtol=1e-6)
    # With 2 micro-batches per update, the rate moves once per update.
    model = _model(learning_rate=0.4)
    rates, _ = _learning_rates(model, [
        kd_callbacks.GradientAggregation(accumulation_steps=2),
        kd_callbacks.LearningRateWarmup(warmup_steps=3, initial_lr=0.1)])
    np.testing.assert_allclose(rates, [0.2, 0.2, 0.3, 0.3, 0.4, 0.4], rtol=1e-6)


def test_learning_rate_warmup_refuses_a_schedule():
    model = _model(learning_rate=keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.9))
    with pytest.raises(ValueError, match="schedule"):
        model.fit(_dataset(), verbose=0, shuffle=False,
                  callbacks=[kd_callbacks.LearningRateWarmup(warmup_steps=2)])


def test_throughput_logs_examples_per_second(capsys, monkeypatch):
    model = _model()
    for throughput in (kd_callbacks.Throughput(global_batch_size=8,
                                               single_replica_examples_per_second=1.0),
                       kd_callbacks.Throughput(verbose=1)):  # counts the examples itself
        history = model.fit(_dataset(), epochs=2, verbose=0, shuffle=False,
                            callbacks=[throughput]).history
        assert len(history["examples_per_second"]) == 2
        assert all(value > 0 for value in history["examples_per_second"])
        assert history["examples_per_second_per_replica"] == history["examples_per_second"]
        assert "loss" in history
    assert "scaling_efficiency" not in history
    assert capsys.readouterr().out.count("Throughput: epoch") == 2
    # Only the chief prints.
    from keras_dist.callbacks import throughput as throughput_module

    monkeypatch.setattr(throughput_module, "is_chief", lambda: False)
    history = model.fit(_dataset(), verbose=0, shuffle=False, callbacks=[
        kd_callbacks.Throughput(verbose=1, single_replica_examples_per_second=1.0)]).history
    assert history["scaling_efficiency"] == pytest.approx(history["examples_per_second"])
    assert "Throughput" not in capsys.readouterr().out


def test_replica_sync_check_is_a_no_op_on_one_replica():
    model = _model()
    model.fit(_dataset(), verbose=0, shuffle=False,
              callbacks=[kd_callbacks.ReplicaSyncCheck(every_n_batches=1)])


def _two_replica_checks():
    import keras_dist
    from keras_dist.callbacks import ReplicaDivergenceError, ReplicaSyncCheck, Throughput

    strategy = keras_dist.strategy(devices=keras_dist.local_devices("CPU")[:2])
    out = {}
    model = _model(strategy, momentum=0.9)
    throughput = Throughput()
    history = model.fit(_dataset(), epochs=1, verbose=0,
                        callbacks=[ReplicaSyncCheck(every_n_batches=1), throughput]).history
    out["in_sync"] = "passed"
    out["per_replica_ratio"] = (history["examples_per_second"][0]
                                / history["examples_per_second_per_replica"][0])
    for name, variable in (("kernel", model.trainable_weights[0]),
                           ("momentum", model.optimizer.variables[-1])):
        copy = variable.value.values[1]  # replica 1's copy of the mirrored variable
        copy.assign(copy.numpy() + 1.0)
        try:
            model.fit(_dataset(), verbose=0, shuffle=False,
                      callbacks=[ReplicaSyncCheck(every_n_batches=2)])
            out[name] = None
        except ReplicaDivergenceError as error:
            out[name] = (variable.path, str(error))
        copy.assign(variable.value.values[0].numpy())
    return out


@pytest.fixture(scope="module")
def two_replicas():
    return run_in_subprocess(_two_replica_checks, virtual_devices=2, timeout=300)


@pytest.mark.multiworker
@pytest.mark.slow
def test_replica_sync_check_passes_when_in_sync(two_replicas):
    assert two_replicas["in_sync"] == "passed"
    assert two_replicas["per_replica_ratio"] == pytest.approx(2.0)


@pytest.mark.parametrize("name", ["kernel", "momentum"])
@pytest.mark.multiworker
@pytest.mark.slow
def test_replica_sync_check_names_the_divergent_variable(two_replicas, name):
    assert two_replicas[name] is not None, "the divergence must be caught"
    path, message = two_replicas[name]
    assert repr(path) in message
    assert "replica(s) [1]" in message and "after batch 1 of epoch 0" in message
