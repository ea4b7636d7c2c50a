"""Drop-in: TensorFlow's own tutorial code runs unchanged with `keras_dist.strategy()`.

Each test is the shape of an official tutorial that failed before: a model around a
`keras.layers.TFSMLayer` trained on one device (save_and_load), and a multi-worker script
that builds its datasets before the strategy (multi_worker_with_keras).
"""

import pytest

from keras_dist.testing import run_in_subprocess, run_on_workers

pytestmark = pytest.mark.multiworker


def _fit_around_tfsm_layer(export_dir):
    import numpy as np
    import tensorflow as tf

    import keras
    import keras_dist

    strategy = keras_dist.strategy()
    keras.utils.set_random_seed(0)
    inner = keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(2, 3, activation="relu"),
        keras.layers.Flatten(),
        keras.layers.Dense(3),
    ])
    tf.saved_model.save(inner, export_dir)
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((8, 8, 1)),
            keras.layers.TFSMLayer(export_dir, call_endpoint="serving_default",
                                   trainable=True),
            keras.layers.Lambda(lambda outputs: list(outputs.values())[0]
                                if isinstance(outputs, dict) else outputs),
        ])
        model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9), loss="mse")
    images = np.random.RandomState(0).rand(16, 8, 8, 1).astype("float32")
    targets = np.random.RandomState(1).rand(16, 3).astype("float32")
    history = model.fit(images, targets, batch_size=8, epochs=1, verbose=0)
    return type(strategy).__name__, history.history["loss"]


@pytest.mark.slow
def test_tfsm_layer_model_fits_on_one_device(tmp_path):
    # Under TF's default strategy Keras builds the momentum slots inside the traced step
    # and fails with "'..._kernel:0_momentum' is not a valid scope name".
    name, losses = run_in_subprocess(
        _fit_around_tfsm_layer, args=(str(tmp_path / "exported"),), timeout=120)
    assert name == "MirroredStrategy"
    assert len(losses) == 1 and losses[0] == losses[0]  # finite, not NaN


def _data_before_strategy():
    import numpy as np
    import tensorflow as tf

    import keras
    import keras_dist

    features = np.random.RandomState(0).rand(64, 4).astype("float32")
    labels = features.sum(axis=1, keepdims=True)
    # The tutorial's order: the dataset and a tensor first, then the strategy.
    dataset = tf.data.Dataset.from_tensor_slices((features, labels)).batch(16)
    scale = tf.constant(2.0)
    strategy = keras_dist.strategy()
    task_type, task_id = (strategy.cluster_resolver.task_type,
                          strategy.cluster_resolver.task_id)
    with strategy.scope():
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.fit(dataset.map(lambda x, y: (x * scale, y)), epochs=2, verbose=0)
    return {
        "task": [task_type, task_id],
        "replicas": strategy.num_replicas_in_sync,
        "weights": [w.tolist() for w in model.get_weights()],
    }


@pytest.mark.multiworker
@pytest.mark.slow
def test_datasets_built_before_the_strategy_on_two_workers():
    results = run_on_workers(_data_before_strategy, num_workers=2, timeout=120)
    assert [r["task"] for r in results] == [["worker", 0], ["worker", 1]]
    assert [r["replicas"] for r in results] == [2, 2]
    assert results[0]["weights"] == results[1]["weights"]


def _data_before_strategy_with_virtual_devices():
    import tensorflow as tf

    import keras_dist

    tf.constant(1.0)  # starts the runtime: the layout must already be the virtual one
    strategy = keras_dist.strategy()
    return len(keras_dist.local_devices("CPU")), strategy.num_replicas_in_sync


@pytest.mark.multiworker
@pytest.mark.slow
def test_virtual_devices_survive_an_op_before_the_strategy():
    results = run_on_workers(_data_before_strategy_with_virtual_devices, num_workers=2,
                             timeout=120, virtual_devices=2)
    assert results == [(2, 2), (2, 2)]


def _strategy_after_too_early_op():
    import json
    import os

    import tensorflow as tf

    import keras_dist
    from keras_dist.startup import early_init as _early_init

    tf.constant(1.0)  # TensorFlow starts before there is a cluster to prepare for
    os.environ["TF_CONFIG"] = json.dumps({
        "cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]},
        "task": {"type": "worker", "index": 0},
    })
    messages = []
    try:
        keras_dist.strategy()
    except RuntimeError as error:
        messages.append((type(error).__module__, str(error)))
    # What `import keras_dist` finds when the script ran an op before importing it.
    _early_init.configure_collectives_at_import()
    try:
        keras_dist.strategy()
    except RuntimeError as error:
        messages.append((type(error).__module__, str(error)))
    return messages


@pytest.mark.slow
def test_op_before_the_cluster_is_known_gets_a_clear_error():
    (late_config, late_import) = run_in_subprocess(_strategy_after_too_early_op, timeout=120)
    assert late_config[0] == "builtins"
    assert "the cluster changed after `import keras_dist`" in late_config[1]
    assert "before the script starts, or before `import keras_dist`" in late_config[1]
    assert "before `import keras_dist`" in late_import[1]
    assert "Move `import keras_dist` above the first TensorFlow op" in late_import[1]
    for _, message in (late_config, late_import):
        assert message.startswith("keras_dist.strategy() cannot start")
