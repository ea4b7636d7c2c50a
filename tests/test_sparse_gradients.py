"""Sparse gradients (tf.IndexedSlices) through the whole aggregation pipeline.

Embedding tables get `tf.IndexedSlices` gradients. The matrix below trains three real
architectures — a tiny keras_hub `BertBackbone` (embeddings, padding mask, pooled output
+ Dense head), a tiny `GPT2Backbone` causal LM (Dense head, so the token embedding's
gradient stays sparse) and a conv net with `BatchNormalization(synchronized=True)`,
Dropout and mixed precision — on 2 virtual devices (one subprocess) and on 2 launched
workers (one launch, running alongside). BERT trains under every `GradientAggregation`
option in both modes and the stock optimizer options (`clipnorm`, `global_clipnorm`,
`clipvalue`, `gradient_accumulation_steps`; no keras_dist callback) on the workers; the
conv net under the mixed-precision-sensitive options on the virtual devices; GPT-2 without
options (one scenario per assertion: see `DEVICE_OPTIONS`). Each mode returns its whole
matrix as data; the tests assert on it. Each model is built once per strategy and
recompiled per run. Models are built from code with random init: nothing is downloaded.

Equivalence runs switch dropout off; one extra run per model with dropout on checks
that the replicas/workers still hold identical weights.
"""

import os

import numpy as np
import pytest

from keras_dist.testing import run_in_subprocess
from helpers import max_diff, start_workers_first

# The matrix fixtures train every case before the first test that uses them returns.
pytestmark = [pytest.mark.multiworker, pytest.mark.slow, pytest.mark.timeout(1200)]

MODELS = ("bert", "gpt2", "convnet")
OPTIONS = ("none", "clipnorm", "bf16", "fp16", "accumulate")
# The options each model trains under, per mode. BERT carries the options' assertion for
# an embedding table's IndexedSlices and for the dense layers after it, in both modes;
# GPT-2's option runs repeated it (the same sparse path through the same all-reduce) and
# the conv net's on 2 workers repeated BERT's dense layers there, so those train without
# options. The conv net keeps, on the virtual devices, the options that act on its
# float16 gradients and its synchronized BatchNormalization: fp16 compression and
# accumulation (its clipnorm and bf16 runs repeated BERT's assertion for dense layers).
DEVICE_OPTIONS = {"bert": OPTIONS, "gpt2": ("none",),
                  "convnet": ("none", "fp16", "accumulate")}
WORKER_OPTIONS = {"bert": OPTIONS, "gpt2": ("none",), "convnet": ("none",)}
# Stock Keras optimizer options (no keras_dist callback) on a model with embeddings, whose
# sparse gradients go through Keras' own clipping and accumulators. BERT only: GPT-2's
# runs of these options repeated the same assertion (the token embedding's IndexedSlices
# through Keras' clipping and accumulators after the all-reduce) at ~40 CPU-seconds.
# They run on the 2 workers (the cross-process all-reduce); the virtual devices train only
# their one-device references (the same code path through one process's all-reduce was
# the devices' runs: ~10 CPU-seconds).
STOCK_MODELS = ("bert",)
# `clipvalue` shares a run with `gradient_accumulation_steps` (Keras clips the averaged
# gradient of the update step; keras_dist, after its all-reduce), and `stock_accumulate`
# alone equals one device with the k-times batch ("accumulate"'s reference).
STOCK_OPTIONS = ("stock_clipnorm", "stock_global_clipnorm", "stock_clipvalue_accumulate",
                 "stock_accumulate")
CLIPVALUE = 1e-3
GLOBAL_BATCH = 8
UPDATES = 3
SEQUENCE_LENGTH = 8
VOCABULARY = 300
CLIPNORM = 0.05
LEARNING_RATE = 0.1
# Tolerances against one device with the same global batch: exact arithmetic up to
# summation order (1e-5); float16 gradients of the mixed-precision conv net, rounded
# per replica's half batch (2e-3; measured 6e-4); gradients that travelled in 16 bits
# (2e-2; measured <= 1.1e-3).
EXACT, MIXED, COMPRESSED = 1e-5, 2e-3, 2e-2


# -- models and data (built from code, random init, no downloads) -----------------------
def _inputs(model_name, examples, seed=0):
    rng = np.random.default_rng(seed)
    if model_name == "convnet":
        x = rng.normal(size=(examples, 8, 8, 3)).astype("float32")
        return x, rng.integers(0, 4, size=(examples,)).astype("int32")
    tokens = rng.integers(1, VOCABULARY, size=(examples, SEQUENCE_LENGTH)).astype("int32")
    lengths = rng.integers(SEQUENCE_LENGTH // 2, SEQUENCE_LENGTH + 1, size=(examples, 1))
    mask = np.arange(SEQUENCE_LENGTH)[None, :] < lengths
    tokens = np.where(mask, tokens, 0).astype("int32")
    if model_name == "bert":
        x = {"token_ids": tokens, "segment_ids": np.zeros_like(tokens),
             "padding_mask": mask}
        return x, rng.integers(0, 2, size=(examples,)).astype("int32")
    x = {"token_ids": tokens, "padding_mask": mask}
    # Next-token targets; padded positions predict token 0.
    return x, np.concatenate([tokens[:, 1:], np.zeros((examples, 1), "int32")], axis=1)


def _build(model_name, dropout):
    import keras

    if model_name == "bert":
        import keras_hub

        backbone = keras_hub.models.BertBackbone(
            vocabulary_size=VOCABULARY, num_layers=1, num_heads=2, hidden_dim=16,
            intermediate_dim=32, dropout=dropout, max_sequence_length=16,
        )
        outputs = keras.layers.Dense(2)(backbone.output["pooled_output"])
        return keras.Model(backbone.input, outputs)
    if model_name == "gpt2":
        import keras_hub

        backbone = keras_hub.models.GPT2Backbone(
            vocabulary_size=VOCABULARY, num_layers=1, num_heads=2, hidden_dim=16,
            intermediate_dim=32, dropout=dropout, max_sequence_length=16,
        )
        outputs = keras.layers.Dense(VOCABULARY)(backbone.output)
        return keras.Model(backbone.input, outputs)
    mixed = "mixed_float16"
    return keras.Sequential([
        keras.Input((8, 8, 3)),
        keras.layers.Conv2D(8, 3, padding="same", use_bias=False, dtype=mixed),
        keras.layers.BatchNormalization(synchronized=True, dtype=mixed),
        keras.layers.Activation("relu", dtype=mixed),
        keras.layers.Dropout(dropout, seed=1, dtype=mixed),
        keras.layers.GlobalAveragePooling2D(dtype=mixed),
        keras.layers.Dense(4, dtype="float32"),
    ])


def _initial_weights(model_name):
    import keras

    keras.utils.set_random_seed(7)
    return _build(model_name, 0.0).get_weights()


def _dense_gradient_sgd(**kwargs):
    """SGD that densifies `IndexedSlices` first: the references' plain arithmetic.

    Keras alone squares `IndexedSlices` values without summing rows that share an
    index, so on sparse gradients its `global_clipnorm` clips by a larger norm than the
    dense gradient's; keras_dist's sparse_duplicates_summed fix sums them first
    (`test_keras_global_clipnorm_takes_the_dense_gradients_norm`).
    """
    import keras
    import tensorflow as tf

    class DenseGradientSGD(keras.optimizers.SGD):
        def apply(self, grads, trainable_variables=None):
            grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g
                     for g in grads]
            return super().apply(grads, trainable_variables)

    return DenseGradientSGD(LEARNING_RATE, **kwargs)


def _setup(model_name, option, reference):
    """(batch, optimizer kwargs, GradientAggregation kwargs or None) of one run.

    `reference=True` is the one-device run an option must match: Keras'
    `global_clipnorm` for "clipnorm" and a k-times larger batch for "accumulate" —
    except on the conv net, whose BatchNormalization normalises each micro-batch on
    its own, so there one device accumulating the same micro-batches is the reference.
    """
    steps = 2 if option == "accumulate" else 1
    if option in STOCK_OPTIONS:
        return GLOBAL_BATCH, _stock_kwargs(option), None
    if not reference:
        return GLOBAL_BATCH, {}, {
            "clipnorm": CLIPNORM if option == "clipnorm" else None,
            "compression": option if option in ("bf16", "fp16") else None,
            "accumulation_steps": steps,
        }
    clip = {"global_clipnorm": CLIPNORM} if option == "clipnorm" else {}
    if option == "accumulate" and model_name == "convnet":
        return GLOBAL_BATCH, clip, {"accumulation_steps": steps}
    return GLOBAL_BATCH * steps, clip, None


def _stock_kwargs(option):
    """The stock optimizer's own options of a `stock_*` run (the same on one device)."""
    return {
        "stock_clipnorm": {"clipnorm": CLIPNORM},
        "stock_global_clipnorm": {"global_clipnorm": CLIPNORM},
        "stock_clipvalue_accumulate": {"clipvalue": CLIPVALUE,
                                       "gradient_accumulation_steps": 2},
        "stock_accumulate": {"gradient_accumulation_steps": 2},
    }[option]


_MODELS = {}


def _model(strategy, model_name, dropout):
    """One model per (strategy, architecture, dropout), built once and reused.

    Every run sets the initial weights (BatchNormalization statistics included) and
    compiles a new optimizer, which also drops the previous run's traced train step.
    """
    import keras

    key = (id(strategy), model_name, dropout)
    if key not in _MODELS:
        with strategy.scope():
            keras.utils.set_random_seed(11)
            _MODELS[key] = _build(model_name, dropout)
    return _MODELS[key]


def _train(strategy, model_name, option, initial_weights, *, dropout=0.0, reference=False,
           stock_optimizer=False):
    """Trains `UPDATES` updates; returns the weights and the spread of replica copies."""
    import keras
    import tensorflow as tf

    from keras_dist.callbacks import GradientAggregation

    steps = 2 if "accumulate" in option else 1
    stock_optimizer = stock_optimizer or option in STOCK_OPTIONS
    batch, optimizer_kwargs, aggregation = _setup(model_name, option, reference)
    x, y = _inputs(model_name, GLOBAL_BATCH * steps * UPDATES)
    callbacks = [] if aggregation is None else [GradientAggregation(**aggregation)]
    model = _model(strategy, model_name, dropout)
    with strategy.scope():
        keras.utils.set_random_seed(11)
        model.set_weights(initial_weights)
        optimizer = (keras.optimizers.SGD(LEARNING_RATE, **optimizer_kwargs)
                     if stock_optimizer else _dense_gradient_sgd(**optimizer_kwargs))
        if model_name == "convnet":
            optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
        model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True))
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)
    model.fit(dataset, epochs=1, verbose=0, shuffle=False, callbacks=callbacks)
    spread = 0.0
    for variable in model.weights:
        copies = [c.numpy() for c in strategy.experimental_local_results(variable.value)]
        spread = max([spread] + [float(np.max(np.abs(c - copies[0]))) for c in copies])
    return {"weights": model.get_weights(), "replica_spread": spread}


def _matrix(strategy, with_references, options_of):
    """Every model under its options on `strategy` (+ one-device references)."""
    import time

    import keras_dist

    out = {"replicas": strategy.num_replicas_in_sync, "runs": {}, "references": {},
           "seconds": {}}
    one = None
    if with_references:
        one = keras_dist.strategy(kind="one_device",
                                  devices=keras_dist.local_devices("CPU")[:1])
    for model_name in MODELS:
        started = time.perf_counter()
        initial = _initial_weights(model_name)
        for option in options_of[model_name]:
            run = _train(strategy, model_name, option, initial)
            out["runs"][f"{model_name}/{option}"] = run
            if with_references and option in ("none", "clipnorm", "accumulate"):
                ref = _train(one, model_name, option, initial, reference=True)
                out["references"][f"{model_name}/{option}"] = ref["weights"]
        for option in STOCK_OPTIONS if model_name in STOCK_MODELS else ():
            if not with_references:  # the stock options' runs: on 2 workers only
                out["runs"][f"{model_name}/{option}"] = _train(strategy, model_name, option,
                                                               initial)
            elif option != "stock_accumulate":
                # Stock Keras on one device, same options and global batch. (Keras'
                # accumulation equals one device with the k-times batch: "accumulate".)
                ref = _train(one, model_name, option, initial, reference=True)
                out["references"][f"{model_name}/{option}"] = ref["weights"]
        dropout = _train(strategy, model_name, "none", initial, dropout=0.3)
        out["runs"][f"{model_name}/dropout"] = dropout
        out["seconds"][model_name] = time.perf_counter() - started
    return out


def _on_virtual_devices():
    import keras_dist

    return _matrix(keras_dist.strategy(), with_references=True, options_of=DEVICE_OPTIONS)


def _on_each_worker():
    import keras_dist

    out = _matrix(keras_dist.strategy(), with_references=False, options_of=WORKER_OPTIONS)
    out["rank"] = keras_dist.worker_index()
    return out


@pytest.fixture(scope="module")
def _launch(request):
    return start_workers_first(request, "workers", _on_each_worker, timeout=900)


@pytest.fixture(scope="module")
def mirrored(_launch):
    return run_in_subprocess(_on_virtual_devices, virtual_devices=2, timeout=900)


@pytest.fixture(scope="module")
def workers(_launch, mirrored):
    result = _launch.result()
    if os.environ.get("KERAS_DIST_MATRIX_TABLE"):  # the closing-note table
        with open(os.environ["KERAS_DIST_MATRIX_TABLE"], "w") as file:
            file.write(_table(mirrored, result))
    return result


def _table(mirrored, workers):
    """Markdown: model x option x mode -> max |w - w_one_device|, workers identical."""
    rows = ["| model | option | 2 virtual devices | 2 workers (chief) | workers identical "
            "| tolerance |", "|---|---|---|---|---|---|"]
    for model_name, option in _cases(DEVICE_OPTIONS):
        key, reference = f"{model_name}/{option}", _reference(mirrored, model_name, option)
        devices = (f'{max_diff(mirrored["runs"][key]["weights"], reference):.1e}'
                   if key in mirrored["runs"] else "—")
        chief, identical = "—", "—"
        if key in workers[0]["runs"]:
            chief = f'{max_diff(workers[0]["runs"][key]["weights"], reference):.1e}'
            identical = "yes" if max_diff(workers[0]["runs"][key]["weights"],
                                          workers[1]["runs"][key]["weights"]) == 0.0 else "NO"
        rows.append(f"| {model_name} | {option} | {devices} | {chief} | "
                    f"{identical} | {_tolerance(model_name, option):.0e} |")
    for model_name in MODELS:
        key = f"{model_name}/dropout"
        identical = max_diff(workers[0]["runs"][key]["weights"],
                              workers[1]["runs"][key]["weights"]) == 0.0
        spread = mirrored["runs"][key]["replica_spread"]
        rows.append(f"| {model_name} | dropout 0.3 (identity only) | replica spread {spread} "
                    f"| — | {'yes' if identical else 'NO'} | 0 |")
    seconds = {mode: {m: round(out["seconds"][m], 1) for m in MODELS}
               for mode, out in (("2 devices", mirrored), ("worker 0", workers[0]))}
    return "\n".join(rows) + f"\n\nSeconds per model (all its runs): {seconds}\n"


def _tolerance(model_name, option):
    # The conv net trains in mixed precision: its gradients are float16 before any
    # compression, so splitting the batch rounds them differently.
    if option in ("bf16", "fp16"):
        return COMPRESSED
    return MIXED if model_name == "convnet" else EXACT


def _reference(out, model_name, option):
    option = {"bf16": "none", "fp16": "none", "stock_accumulate": "accumulate"}.get(option, option)
    return out["references"][f"{model_name}/{option}"]


def _cases(options_of, stock=True):
    return [(m, o) for m in MODELS for o in options_of[m]] + [
        (m, o) for m in (STOCK_MODELS if stock else ()) for o in STOCK_OPTIONS]


# -- the pure pieces (this process, default strategy) ------------------------------------
def test_sparse_bf16_values_round_trip_through_a_gatherable_carrier():
    import tensorflow as tf

    from keras_dist.aggregation import ops

    values = tf.constant([[1.0 + 2**-12, -3.5e10], [1e-30, 2.0]])
    grads = [tf.IndexedSlices(values, tf.constant([3, 3]), tf.constant([5, 2]))]
    compressed = ops.compress(grads, "bf16")
    # CollectiveGatherV2 (MultiWorkerMirroredStrategy's sparse all-reduce) has no bf16.
    assert compressed[0].values.dtype == tf.float16
    restored = ops.decompress(compressed, ops.dtypes_of(grads), "bf16")
    expected = tf.cast(tf.cast(values, tf.bfloat16), tf.float32)
    np.testing.assert_array_equal(restored[0].values.numpy(), expected.numpy())
    assert restored[0].values.dtype == tf.float32
    fp16 = ops.compress(grads, "fp16")
    assert ops.decompress(fp16, ops.dtypes_of(grads), "fp16")[0].values.dtype == tf.float32


def test_sparse_gradients_are_all_reduced_densely_once_that_moves_less_data():
    import tensorflow as tf

    from keras_dist.aggregation import ops

    def slices(rows):
        return tf.IndexedSlices(tf.ones((rows, 2)), tf.zeros(rows, tf.int32),
                                tf.constant([10, 2]))

    few, many = ops.densify_if_smaller([slices(4), slices(5), None], num_replicas=2)[:2]
    assert isinstance(few, tf.IndexedSlices)  # 2 x 4 gathered rows < 10 table rows
    assert not isinstance(many, tf.IndexedSlices)
    np.testing.assert_array_equal(many.numpy()[0], [5.0, 5.0])


def test_sparse_and_dense_accumulation_agree_and_bad_inputs_are_rejected():
    import tensorflow as tf

    from keras_dist.aggregation import accumulation as _accumulation

    slices = tf.IndexedSlices(tf.constant([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]),
                              tf.constant([2, 0, 2]), tf.constant([4, 2]))
    expected = tf.convert_to_tensor(slices).numpy() * 2
    for mode in ("sparse", "dense"):
        (accumulator,) = [tf.Variable(tf.zeros((4, 2)),
                                      synchronization=tf.VariableSynchronization.ON_READ,
                                      aggregation=tf.VariableAggregation.SUM)]
        tf.function(lambda: _accumulation.accumulate([accumulator], [slices, None], mode))()
        tf.function(lambda: _accumulation.accumulate([accumulator], [slices], mode))()
        (average,) = _accumulation.read_and_reset([accumulator], 2)
        np.testing.assert_allclose(average.numpy(), expected / 2)
        assert float(tf.reduce_sum(tf.abs(accumulator))) == 0.0
    with pytest.raises(ValueError, match="`sparse`.*Received: sparse='rows'"):
        _accumulation.accumulate([accumulator], [slices], "rows")
    with pytest.raises(ValueError, match=r"shape \(3,\).*shape \(4, 2\)"):
        _accumulation.accumulate([accumulator], [tf.zeros(3)])
    with pytest.raises(ValueError, match=r"rows of shape \(3,\).*shape \(4, 2\)"):
        _accumulation.accumulate([accumulator], [tf.IndexedSlices(
            tf.zeros((1, 3)), tf.constant([0]), tf.constant([4, 3]))])


# -- the real-architecture matrix -------------------------------------------------------
@pytest.mark.parametrize("model_name,option", _cases(DEVICE_OPTIONS, stock=False))
def test_two_devices_equal_one_device(mirrored, model_name, option):
    assert mirrored["replicas"] == 2
    run = mirrored["runs"][f"{model_name}/{option}"]
    assert run["replica_spread"] == 0.0
    diff = max_diff(run["weights"], _reference(mirrored, model_name, option))
    assert diff < _tolerance(model_name, option), f"{model_name}/{option}: {diff}"


@pytest.mark.multiworker
@pytest.mark.parametrize("model_name,option", _cases(WORKER_OPTIONS))
def test_two_workers_identical_and_equal_one_device(workers, mirrored, model_name, option):
    key = f"{model_name}/{option}"
    chief, other = workers
    assert chief["replicas"] == other["replicas"] == 2
    assert max_diff(chief["runs"][key]["weights"], other["runs"][key]["weights"]) == 0.0
    diff = max_diff(chief["runs"][key]["weights"], _reference(mirrored, model_name, option))
    assert diff < _tolerance(model_name, option), f"{key}: {diff}"


@pytest.mark.parametrize("model_name", MODELS)
def test_dropout_keeps_replicas_identical(mirrored, model_name):
    assert mirrored["runs"][f"{model_name}/dropout"]["replica_spread"] == 0.0


@pytest.mark.multiworker
@pytest.mark.parametrize("model_name", MODELS)
def test_dropout_keeps_workers_identical(workers, model_name):
    key = f"{model_name}/dropout"
    assert max_diff(workers[0]["runs"][key]["weights"], workers[1]["runs"][key]["weights"]) \
        == 0.0


def test_keras_global_clipnorm_takes_the_dense_gradients_norm(mirrored):
    # Keras alone squares IndexedSlices values row by row, so repeated tokens inflate the
    # norm and it clips harder; under keras_dist the sparse_duplicates_summed fix sums
    # the rows first, so stock `global_clipnorm` clips by the dense gradient's norm, as
    # the GradientAggregation reference does (without the fix:
    # tests/test_sparse_optimizers.py).
    stock = mirrored["references"]["bert/stock_global_clipnorm"]
    assert max_diff(stock, mirrored["references"]["bert/clipnorm"]) < EXACT


@pytest.mark.parametrize("model_name", STOCK_MODELS)
@pytest.mark.parametrize("option", ["stock_clipnorm", "stock_global_clipnorm",
                                    "stock_clipvalue_accumulate"])
def test_stock_clipping_is_active(mirrored, model_name, option):
    # The stock clipping cases compare something: on one device, the clipped run differs
    # from the unclipped one by far more than the tolerance.
    references = mirrored["references"]
    unclipped = "accumulate" if "accumulate" in option else "none"
    clipped = references[f"{model_name}/{option}"]
    assert max_diff(clipped, references[f"{model_name}/{unclipped}"]) > 100 * EXACT


# -- benchmark smoke -----------------------------------------------------------------
@pytest.mark.timeout(180)
def test_sparse_accumulation_benchmark_smoke(tmp_path):
    import json
    import math
    import os
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if root not in sys.path:
        sys.path.insert(0, root)
    from benchmarks import sparse_accumulation

    output = tmp_path / "sparse.json"
    assert sparse_accumulation.main(["--smoke", "--output", str(output)]) == 0
    result = json.loads(output.read_text())["sparse_accumulation"]
    assert result["sums_agree"]
    for key in ("sparse_step_ms", "dense_step_ms", "speedup", "memory_ratio"):
        assert math.isfinite(result[key]) and result[key] > 0, key
    assert {v["replicas"] for v in result["variants"].values()} == {2}
