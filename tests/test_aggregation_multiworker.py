"""Gradient aggregation and its callbacks on 2 real workers (MultiWorkerMirroredStrategy).

One call on the session's 2 shared workers (1 CPU replica each; tests/conftest.py's
`worker_pool`) runs every check; the single-device references are trained in this process
(default strategy, same global batch).
"""

import numpy as np
import pytest

from helpers import initial_weights, max_diff
from test_aggregation import _data, _train
from test_compat_loss_scale import INITIAL_SCALE, _model, _poisoned_data

pytestmark = pytest.mark.multiworker


def _on_each_worker():
    import tensorflow as tf

    import keras_dist
    from keras_dist.callbacks import (
        GradientAggregation, GradientNormLogger, LearningRateWarmup, ReplicaDivergenceError,
        ReplicaSyncCheck, Throughput,
    )

    strategy = keras_dist.strategy()
    out = {"replicas": strategy.num_replicas_in_sync, "rank": keras_dist.worker_index()}

    run = _train(strategy, 16, callbacks=[
        GradientAggregation(), GradientNormLogger(update_freq="batch"), Throughput(),
        ReplicaSyncCheck(every_n_batches=2),
    ])
    out["plain"] = run["weights"]
    out["norm_first_step"] = run["batch_logs"][0]["gradient_norm"]
    out["history"] = run["history"]
    warmup = LearningRateWarmup(warmup_steps=3)
    out["warmup_history"] = _train(strategy, 16, callbacks=[warmup])["history"]
    out["warmup_initial_lr"] = warmup.initial_lr

    callback = GradientAggregation(accumulation_steps=4)
    run = _train(strategy, 16, examples=256, callbacks=[callback])
    out["accumulate"] = run["weights"]
    out["accumulate_counts"] = (callback.aggregator.all_reduce_count, run["iterations"])
    out["clip"] = _train(strategy, 16, callbacks=[GradientAggregation(clipnorm=0.5)])["weights"]
    # Buckets (here one per tensor: bytes_per_pack=64) keep every stage exact.
    out["packs"] = {
        "plain": _train(strategy, 16, callbacks=[GradientAggregation(bytes_per_pack=64)]),
        "clip": _train(strategy, 16, callbacks=[
            GradientAggregation(clipnorm=0.5, bytes_per_pack=64)]),
        "accumulate": _train(strategy, 16, examples=256, callbacks=[
            GradientAggregation(accumulation_steps=4, bytes_per_pack=64)]),
    }
    out["packs"] = {name: run["weights"] for name, run in out["packs"].items()}
    out["stock_clip"] = _train(strategy, 16, global_clipnorm=0.5)["weights"]

    # Overflow in worker 1's half of the first global batch only.
    x, y = _poisoned_data()
    for name, steps in (("lso", 1), ("lso_accumulate", 2)):
        model, callbacks = _model(strategy, accumulation_steps=steps)
        model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(16), verbose=0,
                  shuffle=False, callbacks=callbacks)
        out[name] = {
            "finite": all(bool(np.isfinite(w).all()) for w in model.get_weights()),
            "scale": float(model.optimizer.dynamic_scale.numpy()),
        }

    # A weight changed on worker 1 only is caught, by name, on every worker.
    model, _ = _model(strategy)
    if keras_dist.worker_index() == 1:
        kernel = model.trainable_weights[0]
        kernel.assign(kernel.numpy() + 1.0)
    try:
        model.fit(tf.data.Dataset.from_tensor_slices((x[16:], y[16:])).batch(16), verbose=0,
                  callbacks=[ReplicaSyncCheck(every_n_batches=1)])
        out["divergence"] = None
    except ReplicaDivergenceError as error:
        out["divergence"] = str(error)
    out["kernel_path"] = model.trainable_weights[0].path
    return out


@pytest.fixture(scope="module")
def workers(worker_pool):
    return worker_pool.run(_on_each_worker, timeout=400)


@pytest.fixture(scope="module")
def reference():
    import tensorflow as tf

    default = tf.distribute.get_strategy()
    return {
        "plain": _train(default, 16)["weights"],
        "accumulate": _train(default, 64, examples=256)["weights"],
        "clip": _train(default, 16, global_clipnorm=0.5)["weights"],
    }


def test_two_workers_equal_single_device(workers, reference):
    for worker in workers:
        assert worker["replicas"] == 2
        assert max_diff(worker["plain"], reference["plain"]) < 1e-5
        assert max_diff(worker["clip"], reference["clip"]) < 1e-5
        # Keras' own global_clipnorm acts on the aggregated gradient under
        # keras_dist.strategy() (the clip_after_all_reduce fix).
        assert max_diff(worker["stock_clip"], reference["clip"]) < 1e-5
        for name, weights in worker["packs"].items():
            assert max_diff(weights, reference[name]) < 1e-5, name


def test_two_workers_accumulate_and_all_reduce_once_per_k_steps(workers, reference):
    for worker in workers:
        assert max_diff(worker["accumulate"], reference["accumulate"]) < 1e-5
        assert worker["accumulate_counts"] == (4, 4)  # 16 micro-steps, k=4


def test_gradient_norm_and_logs_are_global(workers):
    import keras
    import tensorflow as tf

    x, y = _data()
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"),
                              keras.layers.Dense(4)])
    model.set_weights(initial_weights())
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(x[:16]) - y[:16]))
    norm = float(tf.linalg.global_norm(tape.gradient(loss, model.trainable_variables)))
    chief, other = workers
    for worker in workers:
        assert worker["norm_first_step"] == pytest.approx(norm, rel=1e-5)
        history = worker["history"]
        assert history["examples_per_second"][0] > 0
        assert history["examples_per_second_per_replica"][0] == pytest.approx(
            history["examples_per_second"][0] / 2)
        assert worker["warmup_history"]["learning_rate"] == [pytest.approx(0.1)]
        assert worker["warmup_initial_lr"] == pytest.approx(0.05)  # target / 2 replicas
    assert chief["history"]["gradient_norm"] == pytest.approx(other["history"]["gradient_norm"])


def test_overflow_on_worker_1_skips_the_step_on_both_workers(workers):
    for worker in workers:
        assert worker["lso"] == {"finite": True, "scale": INITIAL_SCALE / 2}
        assert worker["lso_accumulate"] == {"finite": True, "scale": INITIAL_SCALE / 2}


def test_replica_sync_check_names_the_variable_changed_on_one_worker(workers):
    for worker in workers:
        assert worker["divergence"] is not None, "the desync must be caught"
        assert repr(worker["kernel_path"]) in worker["divergence"]
        assert "replica(s) [1]" in worker["divergence"]
