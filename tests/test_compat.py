"""Keras 3 multi-worker fixes (keras-team/keras#20585, tensorflow/tensorflow#72388).

The seed example (fit + evaluate + predict under a real 2-worker
MultiWorkerMirroredStrategy) runs with the fixes and crashes without each of them.
"""

import numpy as np
import pytest

from keras_dist.testing import WorkerError, run_in_subprocess, run_on_workers


def _seed_example(epochs=3):
    """The seed program, with keras_dist.strategy() as the only change."""
    import keras
    import numpy as np
    import tensorflow as tf

    import keras_dist

    strategy = keras_dist.strategy()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(512, 16)).astype("float32")
    y = (x[:, :8].sum(axis=1) > x[:, 8:].sum(axis=1)).astype("int64")
    global_batch = 32 * strategy.num_replicas_in_sync
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch)
    keras.utils.set_random_seed(1)
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((16,)),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(2),
        ])
        model.compile(
            optimizer=keras.optimizers.SGD(0.1),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    history = model.fit(dataset, epochs=epochs, verbose=0)
    evaluation = model.evaluate(dataset, verbose=0, return_dict=True)
    predictions = model.predict(dataset, verbose=0)
    return {
        "replicas": strategy.num_replicas_in_sync,
        "loss": history.history["loss"],
        "accuracy": history.history["accuracy"],
        "evaluation": evaluation,
        "predictions_shape": list(predictions.shape),
        "weights": [w.tolist() for w in model.get_weights()],
    }


@pytest.mark.multiworker
@pytest.mark.slow
def test_seed_example_trains_on_two_workers_with_the_fix():
    results = run_on_workers(_seed_example, num_workers=2, timeout=240)
    chief, other = results
    assert chief["replicas"] == other["replicas"] == 2
    assert chief["loss"][-1] < chief["loss"][0], "loss must fall"
    # Logs are global values: identical on every worker.
    assert chief["loss"] == pytest.approx(other["loss"], abs=1e-6)
    assert chief["accuracy"] == pytest.approx(other["accuracy"], abs=1e-6)
    assert chief["evaluation"] == pytest.approx(other["evaluation"], abs=1e-6)
    assert chief["predictions_shape"] == [512, 2]
    for mine, theirs in zip(chief["weights"], other["weights"]):
        np.testing.assert_array_equal(np.array(mine), np.array(theirs))


@pytest.mark.multiworker
@pytest.mark.parametrize(
    "disabled, upstream_error",
    [
        # _maybe_symbolic_build all-reduces the PerReplica input batch.
        ("symbolic_build_multi_worker", "unsupported type"),
        # reduce_per_replica reduces scalar logs along axis 0.
        ("reduce_per_replica_scalar", "Invalid reduction dimension 0"),
    ],
)
@pytest.mark.slow
def test_seed_example_fails_without_each_fix(disabled, upstream_error):
    with pytest.raises(WorkerError, match=upstream_error):
        run_on_workers(
            _seed_example,
            kwargs={"epochs": 1},
            num_workers=2,
            timeout=240,
            env={"KERAS_DIST_DISABLE_COMPAT": disabled},
        )


def _fixes_applied():
    import keras_dist
    from keras_dist import compat

    keras_dist.strategy()
    return compat.applied(), compat.probe_report()


@pytest.mark.multiworker
@pytest.mark.slow
def test_strategy_applies_exactly_the_fixes_whose_bug_the_probe_finds():
    applied, report = run_in_subprocess(_fixes_applied, timeout=120)
    assert set(applied) == set(report)
    for name, verdict in report.items():
        assert applied[name] is (verdict != "fixed"), (name, verdict)


def _equivalence(steps=5):
    import keras
    import numpy as np
    import tensorflow as tf

    import keras_dist

    devices = keras_dist.virtual_devices(4, "CPU")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64 * steps, 10)).astype("float32")
    y = rng.normal(size=(64 * steps, 3)).astype("float32")

    def train(strategy):
        keras.utils.set_random_seed(7)
        with strategy.scope():
            model = keras.Sequential([
                keras.Input((10,)),
                keras.layers.Dense(16, activation="tanh"),
                keras.layers.Dense(3),
            ])
            model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
        model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(64), epochs=1,
                  verbose=0, shuffle=False)
        return [w.tolist() for w in model.get_weights()]

    mirrored = keras_dist.strategy(devices=devices)
    return mirrored.num_replicas_in_sync, train(mirrored), train(
        tf.distribute.OneDeviceStrategy("/cpu:0"))


@pytest.mark.multiworker
@pytest.mark.slow
def test_four_virtual_devices_match_one_device_with_the_same_global_batch():
    replicas, distributed, single = run_in_subprocess(_equivalence, timeout=180)
    assert replicas == 4
    for d, s in zip(distributed, single):
        np.testing.assert_allclose(np.array(d), np.array(s), atol=1e-5)
