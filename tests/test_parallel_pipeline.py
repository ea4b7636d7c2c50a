"""keras_dist.parallel pipelines: equal to the unsplit model on one device, placed per stage.

Logical CPU devices stand in for GPUs. Every single-process check (the equivalence grid,
loss reductions, placement and save/load, bad inputs, and the sharded layers of
tests/test_parallel_sharded.py) runs in ONE fresh process with 4 logical devices
(`local_results()`, computed once per pytest process); the tests below assert on their
part of it. The hybrid case runs on 2 launched workers.
"""

import pytest

from keras_dist.testing import run_in_subprocess, run_on_workers

pytestmark = pytest.mark.multiworker

TOLERANCE = 1e-5


def _local_checks():
    return {"equivalence": _equivalence_matrix(), "reductions": _reductions(),
            "placement": _placement_save_load(), "bad": _bad_inputs(),
            "sharded": _sharded_vs_dense()}


_LOCAL: dict = {}


def local_results():
    """The single-process checks, run once (shared with test_parallel_sharded.py); a
    failure is remembered too, so each test reports it without running them again."""
    if "result" not in _LOCAL:
        try:
            _LOCAL["result"] = run_in_subprocess(_local_checks, virtual_devices=4,
                                                 timeout=540)
        except Exception as error:  # noqa: BLE001 - re-raised by every test that needs it
            _LOCAL["result"] = error
    if isinstance(_LOCAL["result"], Exception):
        raise _LOCAL["result"]
    return _LOCAL["result"]


def _equivalence_matrix():
    import keras
    import numpy as np

    from keras_dist.parallel import PipelineModel, split_sequential

    def make():
        keras.utils.set_random_seed(0)
        return keras.Sequential([keras.Input((6,))] + [
            keras.layers.Dense(8, activation="tanh") for _ in range(3)] + [
            keras.layers.Dense(2)])

    x = np.random.RandomState(1).randn(16, 6).astype("float32")
    y = np.random.RandomState(2).randn(16, 2).astype("float32")
    optimizers = {"sgd": lambda: keras.optimizers.SGD(0.1),
                  "adam": lambda: keras.optimizers.Adam(0.01)}
    base = make()  # PipelineModel copies built stages onto their devices: base stays as is
    diffs = {}
    for name, optimizer in optimizers.items():
        reference = make()
        reference.compile(optimizer=optimizer(), loss="mse", metrics=["mae"])
        ref_logs = reference.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        for stages in (2, 4):
            for microbatches in (1, 2, 4, 8):
                # Every pair of (optimizer, stages, micro-batches, remat) values once: remat
                # alternates with each of the other three (16 cases, not all 32).
                remat = (stages == 4) ^ (microbatches in (2, 8)) ^ (name == "adam")
                pipe = PipelineModel(split_sequential(base, stages),
                                     num_microbatches=microbatches, remat=remat)
                # Tracing dominates these tiny models: the compiled (tf.function) path
                # runs for M=4, the others eagerly (same code, no trace).
                pipe.compile(optimizer=optimizer(), loss="mse", metrics=["mae"],
                             run_eagerly=microbatches != 4)
                logs = pipe.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
                weights = max(float(np.abs(a - b).max()) for a, b in
                              zip(reference.get_weights(), pipe.get_weights()))
                metrics = max(abs(logs.history[k][-1] - ref_logs.history[k][-1])
                              for k in ("loss", "mae"))
                diffs[f"{name} K={stages} M={microbatches} remat={remat}"] = (
                    weights, metrics)
    return diffs


@pytest.mark.slow
def test_pipeline_equals_unsplit_model_sgd_and_adam():
    diffs = local_results()["equivalence"]
    assert len(diffs) == 16
    assert {case.split("remat=")[1] for case in diffs} == {"False", "True"}
    for case, (weights, metrics) in diffs.items():
        print(f"{case}: weights {weights:.2e} loss/mae {metrics:.2e}")
    for case, (weights, metrics) in diffs.items():
        assert weights < TOLERANCE and metrics < TOLERANCE, (case, weights, metrics)


def _reductions():
    """Every loss reduction, sample weights and regularizers: K=2, M=4, Adam, 2 steps."""
    import keras
    import numpy as np

    from keras_dist.parallel import PipelineModel, split_sequential

    def make(kernel=False, activity=False):
        keras.utils.set_random_seed(0)
        extra = {}
        if kernel:
            extra["kernel_regularizer"] = keras.regularizers.L2(0.01)
        if activity:
            extra["activity_regularizer"] = keras.regularizers.L1(0.01)
        return keras.Sequential([
            keras.Input((6,)), keras.layers.Dense(8, activation="tanh", **extra),
            keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(2, **extra)])

    x = np.random.RandomState(1).randn(16, 6).astype("float32")
    y = np.random.RandomState(2).randn(16, 2).astype("float32")
    weights = np.random.RandomState(3).rand(16).astype("float32")

    def mse(reduction):
        return lambda: keras.losses.MeanSquaredError(reduction=reduction)

    cases = {  # name: (loss, sample_weight, kernel/activity regularizers, compiled)
        "sum": (mse("sum"), False, False, False),
        "none": (mse(None), False, False, False),
        "mean_with_sample_weight+sw": (mse("mean_with_sample_weight"), True, False, False),
        "sum_over_batch_size+sw": (mse("sum_over_batch_size"), True, False, False),
        "kernel+activity regularizers": (mse("sum_over_batch_size"), False, True, False),
        "sum+sw+regularizers compiled": (mse("sum"), True, True, True),
    }
    diffs = {}
    for name, (loss, use_weights, regularized, compiled) in cases.items():
        fit = dict(batch_size=16, epochs=2, shuffle=False, verbose=0,
                   sample_weight=weights if use_weights else None)
        reference = make(regularized, regularized)
        reference.compile(optimizer=keras.optimizers.Adam(0.01), loss=loss())
        ref_loss = reference.fit(x, y, **fit).history["loss"][-1]
        pipe = PipelineModel(split_sequential(make(regularized, regularized), 2),
                             num_microbatches=4)
        pipe.compile(optimizer=keras.optimizers.Adam(0.01), loss=loss(),
                     run_eagerly=not compiled)
        pipe_loss = pipe.fit(x, y, **fit).history["loss"][-1]
        diffs[name] = (max(float(np.abs(a - b).max()) for a, b in
                           zip(reference.get_weights(), pipe.get_weights())),
                       abs(pipe_loss - ref_loss) / max(1.0, abs(ref_loss)))
    pipe = PipelineModel(split_sequential(make(activity=True), 2), num_microbatches=2,
                         remat=True)
    pipe.compile(optimizer="sgd", loss="mse")
    try:
        pipe.fit(x, y, batch_size=16, verbose=0)
        refusal = None
    except ValueError as error:
        refusal = str(error)
    return {"diffs": diffs, "remat_call_losses": refusal}


@pytest.mark.slow
def test_every_loss_reduction_and_sample_weight_equal_the_unsplit_model():
    result = local_results()["reductions"]
    assert len(result["diffs"]) == 6
    for case, (weights, loss) in result["diffs"].items():
        print(f"{case}: weights {weights:.2e} loss (relative) {loss:.2e}")
    for case, (weights, loss) in result["diffs"].items():
        assert weights < TOLERANCE and loss < TOLERANCE, (case, weights, loss)
    assert "PipelineModel(remat=True) cannot train a stage that adds losses in call()" in (
        result["remat_call_losses"])


def _placement_save_load():
    import os
    import tempfile

    import keras
    import numpy as np

    from keras_dist.parallel import PipelineModel, split_sequential

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(8), keras.layers.Dense(3)])
    original = [w.copy() for w in model.get_weights()]
    pipe = PipelineModel(split_sequential(model, 2, balance=[1, 2]),
                         devices=["/device:CPU:1", "/device:CPU:0"], num_microbatches=2)
    pipe.compile(optimizer="adam", loss="mse")
    same_order = all(np.array_equal(a, b) for a, b in zip(original, pipe.get_weights()))
    x, y = np.ones((8, 4), "float32"), np.zeros((8, 3), "float32")
    pipe.fit(x, y, batch_size=8, verbose=0)
    placed = [(v.path, v.value.device[-5:], device[-5:])
              for stage, device in zip(pipe.stages, pipe.devices) for v in stage.variables]
    slots = {v.value.device[-5:] for v in pipe.optimizer.variables if v.shape.rank}
    path = os.path.join(tempfile.mkdtemp(), "pipe.keras")
    pipe.save(path)
    loaded = keras.saving.load_model(path)
    load_diff = max(float(np.abs(a - b).max())
                    for a, b in zip(pipe.get_weights(), loaded.get_weights()))
    predict_diff = float(np.abs(pipe.predict(x, verbose=0) - loaded.predict(x, verbose=0)).max())
    # Without the compat fix (pipeline_slot_placement) Keras puts every slot on one device.
    os.environ["KERAS_DIST_DISABLE_COMPAT"] = "pipeline_slot_placement"
    try:
        unfixed = PipelineModel(split_sequential(model, 2, balance=[1, 2]),
                                devices=["/device:CPU:1", "/device:CPU:0"])
        unfixed.compile(optimizer="adam", loss="mse")
        unfixed.fit(x, y, batch_size=8, verbose=0)  # fit builds the slots, in its trace
        unfixed_slots = {v.value.device[-5:] for v in unfixed.optimizer.variables
                         if v.shape.rank}
    finally:
        del os.environ["KERAS_DIST_DISABLE_COMPAT"]
    return {"same_order": same_order, "placed": placed, "slots": sorted(slots),
            "unfixed_slots": sorted(unfixed_slots),
            "load_diff": load_diff, "predict_diff": predict_diff,
            "loaded_type": type(loaded).__name__, "loaded_devices": list(loaded.devices),
            "loaded_compiled": loaded.compiled,
            "loaded_slots": len(loaded.optimizer.variables) == len(pipe.optimizer.variables)}


@pytest.mark.slow
def test_variables_on_their_stage_device_weights_order_and_save_load():
    result = local_results()["placement"]
    assert result["same_order"]
    for path, actual, expected in result["placed"]:
        assert actual == expected, path
    assert result["slots"] == ["CPU:0", "CPU:1"]
    assert result["loaded_type"] == "PipelineModel"
    assert result["loaded_devices"] == ["/device:CPU:1", "/device:CPU:0"]
    assert result["loaded_compiled"] and result["loaded_slots"]
    assert result["load_diff"] == 0.0 and result["predict_diff"] < TOLERANCE


@pytest.mark.slow
def test_slot_placement_fix_is_needed():
    # The fix's reason, measured: without it every slot lands on one device.
    assert len(local_results()["placement"]["unfixed_slots"]) == 1


def _bad_inputs():
    """The bad inputs that need a runtime with devices (the rest: tests/test_bad_inputs.py)."""
    import keras
    import numpy as np

    from keras_dist.parallel import PipelineModel, split_sequential

    def error(fn):
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - the message is what is tested
            return f"{type(exc).__name__}: {exc}"
        return None

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(2)])
    first = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    second = keras.Sequential([keras.Input((5,)), keras.layers.Dense(2)])

    def bad_batch():
        pipe = PipelineModel(split_sequential(model, 2), num_microbatches=4)
        pipe.compile(optimizer="sgd", loss="mse")
        pipe.fit(np.ones((6, 4), "float32"), np.ones((6, 2), "float32"), batch_size=6,
                 verbose=0)

    return {
        "auto": [len(s.layers) for s in split_sequential(model, 2, device_map="auto")],
        "batch": error(bad_batch),
        "missing": error(lambda: PipelineModel(split_sequential(model, 2),
                                               devices=["/device:CPU:0", "/device:GPU:7"])),
        "shapes": error(lambda: PipelineModel([first, second])),
    }


@pytest.mark.slow
def test_bad_inputs_get_clear_errors():
    errors = local_results()["bad"]
    assert errors["auto"] == [1, 1]
    assert "num_microbatches=4" in errors["batch"] and "[4, 8]" in errors["batch"]
    assert "/device:GPU:7" in errors["missing"] and "/device:CPU:3" in errors["missing"]
    assert "Stage 0 gives shape (None, 3)" in errors["shapes"]
    assert "stage 1 expects input shape (None, 5)" in errors["shapes"]


def _sharded_vs_dense():
    """For tests/test_parallel_sharded.py: sharded layers against Dense / Embedding."""
    import keras
    import numpy as np

    from keras_dist.parallel import ShardedDense, ShardedEmbedding

    devices = ["/device:CPU:0", "/device:CPU:1"]
    x = np.random.RandomState(0).randn(8, 6).astype("float32")
    y = np.random.RandomState(1).randn(8, 5).astype("float32")
    ids = np.random.RandomState(2).randint(0, 11, size=(8, 3))

    def pair(sharded, plain, inputs, targets, input_shape):
        sharded_model = keras.Sequential([keras.Input(input_shape), sharded])
        plain_model = keras.Sequential([keras.Input(input_shape), plain])
        plain.set_weights(sharded.get_weights())  # sharded -> unsharded layout
        forward = float(np.abs(sharded_model.predict(inputs, verbose=0)
                               - plain_model.predict(inputs, verbose=0)).max())
        for model in (sharded_model, plain_model):
            model.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
            model.fit(inputs, targets, batch_size=8, epochs=3, verbose=0, shuffle=False)
        trained = max(float(np.abs(a - b).max()) for a, b in
                      zip(sharded.get_weights(), plain.get_weights()))
        placed = sorted({v.value.device[-5:] for v in sharded.variables})
        # unsharded -> sharded round trip
        sharded.set_weights(plain.get_weights())
        round_trip = max(float(np.abs(a - b).max()) for a, b in
                         zip(sharded.get_weights(), plain.get_weights()))
        return {"forward": forward, "trained": trained, "devices": placed,
                "round_trip": round_trip}

    return {
        "column": pair(ShardedDense(5, devices, mode="column", activation="tanh"),
                       keras.layers.Dense(5, activation="tanh"), x, y, (6,)),
        "row": pair(ShardedDense(5, devices, mode="row", activation="tanh"),
                    keras.layers.Dense(5, activation="tanh"), x, y, (6,)),
        "embedding": pair(ShardedEmbedding(11, 5, devices), keras.layers.Embedding(11, 5),
                          ids, np.ones((8, 3, 5), "float32"), (3,)),
    }


def _hybrid_worker(global_x, global_y):
    import keras
    import numpy as np

    import keras_dist
    from keras_dist.parallel import PipelineModel, split_sequential

    def make():
        keras.utils.set_random_seed(0)
        return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                                 keras.layers.Dense(8, activation="tanh"),
                                 keras.layers.Dense(2)])

    strategy = keras_dist.strategy()  # starts the collective runtime of the job
    try:
        with strategy.scope():
            PipelineModel(split_sequential(make(), 2))
        refusal = None
    except ValueError as error:
        refusal = str(error)
    rank, size = keras_dist.worker_index(), keras_dist.num_workers()
    share = len(global_x) // size
    rows = slice(rank * share, (rank + 1) * share)
    pipe = PipelineModel(split_sequential(make(), 2), num_microbatches=2, data_parallel=True)
    pipe.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    pipe.fit(global_x[rows], global_y[rows], batch_size=share, epochs=3, shuffle=False,
             verbose=0)
    reference = make()
    reference.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    reference.fit(global_x, global_y, batch_size=len(global_x), epochs=3, shuffle=False,
                  verbose=0)
    return {"weights": [w.tolist() for w in pipe.get_weights()],
            "vs_one_device": max(float(np.abs(a - b).max()) for a, b in
                                 zip(pipe.get_weights(), reference.get_weights())),
            "refusal": refusal}


def test_pipeline_in_each_of_two_workers_equals_one_device():
    import numpy as np

    x = np.random.RandomState(1).randn(16, 6).astype("float32")
    y = np.random.RandomState(2).randn(16, 2).astype("float32")
    results = run_on_workers(_hybrid_worker, num_workers=2, args=(x, y), virtual_devices=2,
                             timeout=180)
    assert "outside a tf.distribute strategy scope" in results[0]["refusal"]
    assert results[0]["weights"] == results[1]["weights"]
    for result in results:
        assert result["vs_one_device"] < TOLERANCE, result["vs_one_device"]


@pytest.mark.slow
def test_pipeline_benchmark_smoke_through_the_runner(tmp_path, capsys):
    import json
    import os
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, root)
    from benchmarks import run as bench_run

    output = tmp_path / "results.json"
    assert bench_run.main(["--smoke", "--only", "pipeline", "--no-plot",
                           "--output", str(output)]) == 0
    result = json.loads(output.read_text())["pipeline"]
    assert [row["microbatches"] for row in result["throughput"]] == [1, 2]
    assert result["throughput"][1]["bubble"] == 1 / 3
    assert set(result["throughput"][0]["bytes_by_device"]) == {"CPU:0", "CPU:1"}
    assert set(result["memory"]) == {"False", "True"}
    assert "bubble" in capsys.readouterr().out
