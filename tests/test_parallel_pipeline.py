"""keras_dist.parallel pipelines: equal to the unsplit model on one device, placed per stage.

Each test runs in one fresh process with logical CPU devices standing in for GPUs; the
equivalence matrix runs in a single process to keep CI time small.
"""

import pytest

from keras_dist.testing import run_in_subprocess, run_on_workers

TOLERANCE = 1e-5


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
    diffs = {}
    for name, optimizer in optimizers.items():
        reference = make()
        reference.compile(optimizer=optimizer(), loss="mse", metrics=["mae"])
        ref_logs = reference.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        for stages in (2, 4):
            for microbatches in (1, 2, 4, 8):
                for remat in (False, True):
                    pipe = PipelineModel(split_sequential(make(), stages),
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


def test_pipeline_equals_unsplit_model_sgd_and_adam():
    diffs = run_in_subprocess(_equivalence_matrix, virtual_devices=4, timeout=240)
    assert len(diffs) == 32
    for case, (weights, metrics) in diffs.items():
        print(f"{case}: weights {weights:.2e} loss/mae {metrics:.2e}")
    for case, (weights, metrics) in diffs.items():
        assert weights < TOLERANCE and metrics < TOLERANCE, (case, weights, metrics)


def _placement_save_load(tmp_dir):
    import os

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
    path = os.path.join(tmp_dir, "pipe.keras")
    pipe.save(path)
    loaded = keras.saving.load_model(path)
    load_diff = max(float(np.abs(a - b).max())
                    for a, b in zip(pipe.get_weights(), loaded.get_weights()))
    predict_diff = float(np.abs(pipe.predict(x, verbose=0) - loaded.predict(x, verbose=0)).max())
    return {"same_order": same_order, "placed": placed, "slots": sorted(slots),
            "load_diff": load_diff, "predict_diff": predict_diff,
            "loaded_type": type(loaded).__name__, "loaded_devices": list(loaded.devices),
            "loaded_compiled": loaded.compiled,
            "loaded_slots": len(loaded.optimizer.variables) == len(pipe.optimizer.variables)}


def test_variables_on_their_stage_device_weights_order_and_save_load(tmp_path):
    result = run_in_subprocess(_placement_save_load, args=(str(tmp_path),),
                               virtual_devices=2, timeout=120)
    assert result["same_order"]
    for path, actual, expected in result["placed"]:
        assert actual == expected, path
    assert result["slots"] == ["CPU:0", "CPU:1"]
    assert result["loaded_type"] == "PipelineModel"
    assert result["loaded_devices"] == ["/device:CPU:1", "/device:CPU:0"]
    assert result["loaded_compiled"] and result["loaded_slots"]
    assert result["load_diff"] == 0.0 and result["predict_diff"] < TOLERANCE


def _bad_inputs():
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
    stages = split_sequential(model, 2)
    inputs = keras.Input((4,))
    functional = keras.Model(inputs, keras.layers.Dense(2)(inputs))
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
        "count": error(lambda: PipelineModel(stages, devices=["/device:CPU:0"])),
        "missing": error(lambda: PipelineModel(stages, devices=["/device:CPU:0",
                                                                "/device:GPU:7"])),
        "shapes": error(lambda: PipelineModel([first, second])),
        "too_many": error(lambda: split_sequential(model, 3)),
        "not_sequential": error(lambda: split_sequential(functional, 2)),
    }


def test_bad_inputs_get_clear_errors():
    errors = run_in_subprocess(_bad_inputs, virtual_devices=2, timeout=120)
    assert errors["auto"] == [1, 1]
    assert "num_microbatches=4" in errors["batch"] and "[4, 8]" in errors["batch"]
    assert "2 device names" in errors["count"] and "Got 1 devices" in errors["count"]
    assert "/device:GPU:7" in errors["missing"] and "/device:CPU:1" in errors["missing"]
    assert "Stage 0 gives shape (None, 3)" in errors["shapes"]
    assert "stage 1 expects input shape (None, 5)" in errors["shapes"]
    assert "at most the number of layers (2)" in errors["too_many"]
    assert "build the stages yourself" in errors["not_sequential"]


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


def test_pipeline_benchmark_smoke(tmp_path, capsys):
    import json
    import os
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, root)
    from benchmarks import pipeline as bench

    output = tmp_path / "pipeline.json"
    assert bench.main(["--smoke", "--output", str(output)]) == 0
    result = json.loads(output.read_text())["pipeline"]
    assert [row["microbatches"] for row in result["throughput"]] == [1, 2]
    assert result["throughput"][1]["bubble"] == 1 / 3
    assert set(result["throughput"][0]["bytes_by_device"]) == {"CPU:0", "CPU:1"}
    assert set(result["memory"]) == {"False", "True"}
    assert "bubble" in capsys.readouterr().out
