"""Legacy Keras 2 (`tf_keras` with TF_USE_LEGACY_KERAS=1) on 2 launched workers.

tf_keras runs multi-worker `fit` without keras_dist's Keras 3 fixes; keras_dist's strategy
factory, data pipeline and the callbacks that do not hook the optimizer work there, and the
Keras 3-only aggregation refuses a tf_keras model with a clear message.
"""

import pytest

from keras_dist.testing import run_on_workers

pytest.importorskip("tf_keras", reason="legacy Keras tests need tf_keras (in the [test] extras)")


def _legacy_fit():
    import numpy as np
    import tensorflow as tf

    import keras_dist

    strategy = keras_dist.strategy()
    assert tf.keras.__name__.startswith("tf_keras"), tf.keras.__name__
    rng = np.random.default_rng(0)
    x = rng.normal(size=(400, 8)).astype("float32")
    y = (x.sum(axis=1) > 0).astype("int64")
    data = keras_dist.distribute_dataset((x, y), per_replica_batch_size=16, repeat=True)
    tf.keras.utils.set_random_seed(0)
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.Input((8,)), tf.keras.layers.Dense(16, "relu"),
                                     tf.keras.layers.Dense(2)])
        model.compile(tf.keras.optimizers.SGD(0.1),
                      tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
    history = model.fit(data, epochs=3, steps_per_epoch=keras_dist.steps_per_epoch(data),
                        verbose=0)
    refusal = None
    try:
        model.fit(data, epochs=1, steps_per_epoch=1, verbose=0,
                  callbacks=[keras_dist.callbacks.GradientAggregation(clipnorm=1.0)])
    except (TypeError, ValueError) as error:
        refusal = str(error)
    return {
        "type": type(strategy).__name__,
        "replicas": strategy.num_replicas_in_sync,
        "loss": history.history["loss"],
        "weights": [w.tolist() for w in model.get_weights()],
        "refusal": refusal,
    }


@pytest.mark.multiworker
@pytest.mark.timeout(300)
@pytest.mark.slow
def test_legacy_keras_multi_worker_fit():
    results = run_on_workers(_legacy_fit, num_workers=2, timeout=240,
                             env={"TF_USE_LEGACY_KERAS": "1"})
    chief, other = results
    assert chief["replicas"] == 2
    assert chief["loss"][-1] < chief["loss"][0]
    assert chief["loss"] == pytest.approx(other["loss"])
    assert chief["weights"] == other["weights"]
    assert chief["refusal"] and "tf_keras" in chief["refusal"]
