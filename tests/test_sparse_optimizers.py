"""Optimizers on sparse gradients with repeated ids equal the same optimizer on the dense
gradient (compat fix `sparse_duplicates_summed`, issue 37).

An `Embedding(16, 8)` looked up at ids with repeats (an `IndexedSlices` gradient with
duplicate indices) against the same table read as `one_hot(ids) @ table` (a dense
gradient): same initial table, same data, 3 steps, every Keras optimizer with non-linear
state (SGD with momentum, linear, is the control), and Adam through the paths that touch
the gradient on the way (GradientAggregation's clipping and accumulation, Keras' own
`global_clipnorm`, `LossScaleOptimizer`, a custom `train_step`). One device and 2 replicas
run in one subprocess (2 virtual CPUs); 2 workers on the shared worker pool, where the
all-reduce gathers the rows of both workers, so ids repeat across workers too. The same
subprocess reverts the fix and shows the bug it fixes.
"""

import numpy as np
import pytest

from keras_dist.testing import run_in_subprocess

# One subprocess (2 virtual CPUs) and the shared worker pool: the fast lane.
pytestmark = [pytest.mark.multiworker, pytest.mark.timeout(400)]

OPTIMIZERS = ("Adam", "AdamW", "RMSprop", "Adagrad", "Nadam", "Adamax", "SGD")
# Adam through each path that touches a gradient between the model and `update_step`.
PATHS = ("aggregation_clipnorm", "aggregation_accumulation", "stock_global_clipnorm",
         "loss_scale", "train_step")
ONE_DEVICE_PATHS = ("stock_global_clipnorm",)
EXACT = 1e-5
GLOBAL_BATCH = 8
STEPS = 3


def _cases(paths=PATHS):
    return [(name, "") for name in OPTIMIZERS] + [("Adam", path) for path in paths]


# Two devices: Adam through every path, SGD the control; every optimizer with a reduction
# runs on 2 workers (below: Adam and SGD in the fast lane, the others in the slow lane).
FAST_TWO_DEVICE_CASES = [case for case in _cases() if case[0] in ("Adam", "SGD")]


def _train(strategy, optimizer_name, path, dense):
    """The embedding table after 3 steps (dense: read as one_hot @ table)."""
    import keras
    import tensorflow as tf

    import keras_dist

    ids = np.array([[1, 1, 2, 1], [3, 1, 1, 0], [5, 5, 1, 2], [1, 1, 1, 7]] * 6)
    targets = np.random.default_rng(0).normal(size=(len(ids), 1)).astype("float32")
    table = np.random.default_rng(1).normal(size=(16, 8)).astype("float32")

    class OneHotEmbedding(keras.layers.Layer):
        def build(self, _):
            self.embeddings = self.add_weight(
                shape=table.shape, initializer=keras.initializers.Constant(table))

        def call(self, inputs):
            return tf.matmul(tf.one_hot(inputs, table.shape[0]), self.embeddings)

    class OwnStep(keras.Sequential):
        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True))
                loss = self.optimizer.scale_loss(loss)
            grads = tape.gradient(loss, self.trainable_variables)
            self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
            return {"loss": loss}

    options = {"momentum": 0.9} if optimizer_name == "SGD" else {}
    if path == "stock_global_clipnorm":
        options["global_clipnorm"] = 0.05
    callbacks, batch, steps = [], GLOBAL_BATCH, STEPS
    if path == "aggregation_clipnorm":
        # Its clipnorm is Keras' global_clipnorm of the dense gradient, on one device.
        callbacks = [] if dense else [keras_dist.callbacks.GradientAggregation(clipnorm=0.05)]
        options["global_clipnorm"] = 0.05 if dense else None
    if path == "aggregation_accumulation" and not dense:
        # 2 micro-batches of 4 per update equal one device's batch of 8.
        callbacks = [keras_dist.callbacks.GradientAggregation(accumulation_steps=2)]
        batch, steps = GLOBAL_BATCH // 2, 2 * STEPS
    with strategy.scope():
        layers = [keras.Input((4,), dtype="int32"),
                  OneHotEmbedding() if dense else keras.layers.Embedding(
                      16, 8, embeddings_initializer=keras.initializers.Constant(table)),
                  keras.layers.GlobalAveragePooling1D(),
                  keras.layers.Dense(1, kernel_initializer="ones")]
        model = OwnStep(layers) if path == "train_step" else keras.Sequential(layers)
        optimizer = getattr(keras.optimizers, optimizer_name)(0.1, **options)
        if path == "loss_scale":
            optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
        model.compile(optimizer, "mse")
    data = keras_dist.distribute_dataset(
        (ids[:batch * steps], targets[:batch * steps]),
        batch // strategy.num_replicas_in_sync, strategy=strategy, shuffle=False)
    model.fit(data, epochs=1, verbose=0, callbacks=callbacks)
    return keras.ops.convert_to_numpy(model.layers[0].weights[0])


def _differences(strategy, cases):
    """{"optimizer/path": max |sparse - dense|} on `strategy`."""
    return {f"{name}/{path}": float(np.abs(_train(strategy, name, path, False)
                                           - _train(strategy, name, path, True)).max())
            for name, path in cases}


def _on_one_and_two_devices():
    import keras_dist
    from keras_dist import compat

    two = keras_dist.strategy()
    one = keras_dist.strategy(kind="one_device", devices=["/cpu:0"])
    out = {"applied": compat.applied().get("sparse_duplicates_summed"),
           "probe": compat.probe_report()["sparse_duplicates_summed"],
           "replicas": two.num_replicas_in_sync,
           # The paths through a reduction matter with replicas; Keras' own clipping on
           # one device too.
           "one_device": _differences(one, _cases(ONE_DEVICE_PATHS)),
           "two_devices": _differences(two, FAST_TWO_DEVICE_CASES)}
    compat.revert("sparse_duplicates_summed")
    out["one_device_without_fix"] = _differences(one, [("Adam", ""), ("SGD", "")])
    return out


# On 2 workers: Adam alone and through GradientAggregation's clipping (its all-reduce),
# SGD the control, in the fast lane; the other optimizers in the slow lane.
FAST_WORKER_CASES = [("Adam", ""), ("SGD", ""), ("Adam", "aggregation_clipnorm")]
SLOW_WORKER_CASES = [case for case in _cases(("aggregation_clipnorm",))
                     if case not in FAST_WORKER_CASES]


def _on_each_worker(cases):
    import keras_dist

    strategy = keras_dist.strategy()
    return {"replicas": strategy.num_replicas_in_sync,
            "differences": _differences(strategy, cases)}


@pytest.fixture(scope="module")
def devices():
    return run_in_subprocess(_on_one_and_two_devices, virtual_devices=2, timeout=300)


def test_the_fix_is_applied_by_the_strategy_where_the_bug_is_present(devices):
    assert devices["probe"] == "present"
    assert devices["applied"] is True


def test_without_the_fix_adam_on_repeated_ids_differs_from_the_dense_gradient(devices):
    # The bug the fix removes: Adam's state sees each repeated row on its own.
    assert devices["one_device_without_fix"]["Adam/"] > 1e-2
    assert devices["one_device_without_fix"]["SGD/"] < EXACT  # linear: never affected


@pytest.mark.parametrize("name,path", _cases(ONE_DEVICE_PATHS))
def test_one_device_sparse_equals_dense(devices, name, path):
    assert devices["one_device"][f"{name}/{path}"] < EXACT


@pytest.mark.parametrize("name,path", FAST_TWO_DEVICE_CASES)
def test_two_devices_sparse_equals_dense(devices, name, path):
    assert devices["replicas"] == 2
    assert devices["two_devices"][f"{name}/{path}"] < EXACT, devices["two_devices"]


def _check_workers(chief, other, cases):
    assert chief["replicas"] == other["replicas"] == 2
    assert chief["differences"] == other["differences"]
    assert set(chief["differences"]) == {f"{name}/{path}" for name, path in cases}
    assert {key: value for key, value in chief["differences"].items() if value >= EXACT} == {}


def test_two_workers_sparse_equals_dense(worker_pool):
    chief, other = worker_pool.run(_on_each_worker, args=(FAST_WORKER_CASES,))
    _check_workers(chief, other, FAST_WORKER_CASES)


@pytest.mark.slow
def test_two_workers_other_optimizers_sparse_equal_dense(worker_pool):
    chief, other = worker_pool.run(_on_each_worker, args=(SLOW_WORKER_CASES,))
    _check_workers(chief, other, SLOW_WORKER_CASES)
