"""distribute_dataset on one worker: sources, batching, shuffling, steps, errors; Mirrored.

The multi-worker behaviour (disjoint shards, 1/N reading, uneven data) is in
test_data_multiworker.py. This process keeps TensorFlow's default single CPU device;
the 4-device MirroredStrategy checks run in a fresh subprocess.
"""

import json

import numpy as np
import pytest
import tensorflow as tf

import keras_dist
from keras_dist.testing import run_in_subprocess
from helpers import write_tfrecords


# `distribute_dataset(strategy=None)` here means: no strategy made in this process.
pytestmark = pytest.mark.usefixtures("no_strategy_made")


def _ids(batches, key=None):
    """Flattens the example ids of a sequence of batches (ids are the first leaf)."""
    out = []
    for batch in batches:
        leaf = tf.nest.flatten(batch if key is None else batch[key])[0]
        out.extend(np.asarray(leaf).reshape(len(leaf), -1)[:, 0].astype(int).tolist())
    return out


def _parse_id(record):
    return tf.io.parse_single_example(record, {"id": tf.io.FixedLenFeature([], tf.int64)})["id"]


# -- sources ---------------------------------------------------------------------------
@pytest.mark.parametrize("structure", ["x", "xy", "xyw", "dict", "nested"])
def test_array_sources_keep_structure_order_and_steps(structure):
    ids = np.arange(21, dtype="float32")[:, None]
    source = {
        "x": ids,
        "xy": (ids, ids * 2),
        "xyw": (ids, ids * 2, np.ones(21)),
        "dict": {"a": ids, "b": ids + 100},
        "nested": ({"a": ids, "b": [ids, ids]}, ids * 2),
    }[structure]
    data = keras_dist.distribute_dataset(source, 4, shuffle=False)
    batches = list(data)
    assert data.steps_per_epoch == keras_dist.steps_per_epoch(data) == len(batches) == 6
    assert [len(tf.nest.flatten(b)[0]) for b in batches] == [4, 4, 4, 4, 4, 1]
    assert _ids(batches, "a" if structure == "dict" else None) == list(range(21))
    if structure == "xyw":
        assert len(batches[0]) == 3
    if structure == "nested":
        assert isinstance(batches[0][0]["b"], tuple)  # lists become tuples, not stacked


def test_dataset_source_with_map_fn_and_repeat():
    data = keras_dist.distribute_dataset(tf.data.Dataset.range(10), 3, shuffle=False,
                                         map_fn=lambda i: i * 10, repeat=True,
                                         drop_remainder=False)
    assert data.steps_per_epoch == 4
    assert [b.numpy().tolist() for b in data.take(5)] == [
        [0, 10, 20], [30, 40, 50], [60, 70, 80], [90], [0, 10, 20]]
    # repeat=True drops the partial batch by default, on any number of workers.
    assert keras_dist.distribute_dataset(tf.data.Dataset.range(10), 3,
                                         repeat=True).steps_per_epoch == 3


def test_tfrecord_glob_and_list_sources(tmp_path):
    paths = write_tfrecords(tmp_path, num_files=3, per_file=7)
    for source in (str(tmp_path / "*.tfrecord"), paths[::-1]):
        data = keras_dist.distribute_dataset(source, 5, map_fn=_parse_id, seed=2)
        assert sorted(_ids(data)) == list(range(21))
        assert data.steps_per_epoch is None  # record counts are not read ahead
    unshuffled = keras_dist.distribute_dataset(paths, 5, map_fn=_parse_id, shuffle=False)
    assert sorted(_ids(unshuffled)) == list(range(21))


def test_function_source_receives_input_context():
    contexts = []

    def dataset_fn(input_context):
        contexts.append((input_context.num_input_pipelines, input_context.input_pipeline_id,
                         input_context.num_replicas_in_sync))
        return tf.data.Dataset.range(7)

    data = keras_dist.distribute_dataset(dataset_fn, 3, shuffle=False)
    assert contexts == [(1, 0, 1)]
    assert [b.numpy().tolist() for b in data] == [[0, 1, 2], [3, 4, 5], [6]]
    assert data.steps_per_epoch == 3


# -- shuffling -------------------------------------------------------------------------
def test_shuffle_is_reproducible_reshuffles_each_epoch_and_covers_once():
    ids = np.arange(50)
    first = keras_dist.distribute_dataset(ids, 8, seed=7)
    epoch_1, epoch_2 = _ids(first), _ids(first)
    again = _ids(keras_dist.distribute_dataset(ids, 8, seed=7))
    other_seed = _ids(keras_dist.distribute_dataset(ids, 8, seed=8))
    assert sorted(epoch_1) == sorted(epoch_2) == list(range(50))  # no duplicate, none missed
    assert epoch_1 == again  # same seed -> same order
    assert epoch_1 != epoch_2  # a new order each epoch
    assert epoch_1 != other_seed
    assert epoch_1 != list(range(50))


def _custom_loop_after_an_aborted_fit():
    import keras

    import keras_dist
    from keras_dist.data import order

    keras_dist.strategy()  # applies the compat fixes (input_epoch among them)
    ids = np.arange(32, dtype="float32")
    data = keras_dist.distribute_dataset((ids, ids), 8, seed=5)
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")

    class Boom(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            raise RuntimeError("boom")

    try:
        model.fit(data, epochs=5, initial_epoch=3, verbose=0, callbacks=[Boom()])
    except RuntimeError as error:
        raised = str(error)
    return raised, order.fit_position(), [int(v) for x, _ in data for v in x.numpy()]


@pytest.mark.multiworker
def test_a_fit_that_raises_leaves_no_epoch_behind_for_a_custom_loop():
    # An aborted fit never reaches on_train_end: a custom loop after it must count its
    # own epochs, not read the aborted fit's epoch 3 (which a stale fit position gave).
    raised, position, looped = run_in_subprocess(_custom_loop_after_an_aborted_fit)
    assert raised == "boom"
    assert position is None
    assert looped != np.random.default_rng([5, 3]).permutation(32).tolist()


def test_repeat_reshuffles_every_pass_deterministically():
    ids = np.arange(24)

    def passes():
        data = keras_dist.distribute_dataset(ids, 6, seed=3, repeat=True)
        flat = _ids(data.take(3 * data.steps_per_epoch))
        return [flat[i * 24:(i + 1) * 24] for i in range(3)]

    run_1, run_2 = passes(), passes()
    assert run_1 == run_2
    assert all(sorted(p) == list(range(24)) for p in run_1)
    assert len({tuple(p) for p in run_1}) == 3


def test_a_repeated_global_order_says_it_is_infinite():
    # With an unknown cardinality a multi-worker iterator all-reduces "has data" every
    # step (issue 36: 7x fewer examples/s on 2 workers, the iterator alone).
    data = keras_dist.distribute_dataset(np.arange(24), 6, repeat=True)
    assert data.cardinality() == tf.data.INFINITE_CARDINALITY
    data = keras_dist.distribute_dataset(np.arange(24), 6)
    assert data.cardinality() == 4


def test_shuffle_buffer_one_keeps_order():
    # A buffer applies to sources read in sequence; index-able ones are permuted whole.
    data = keras_dist.distribute_dataset(tf.data.Dataset.range(10), 5, shuffle_buffer=1)
    assert _ids(data) == list(range(10))


def test_cache_runs_map_fn_once_and_still_reshuffles():
    calls = []

    def count(i):
        return tf.numpy_function(lambda v: calls.append(int(v)) or v, [i], tf.int64)

    data = keras_dist.distribute_dataset(tf.data.Dataset.range(20), 4, map_fn=count,
                                         cache=True, seed=1)
    epoch_1, epoch_2 = _ids(data), _ids(data)
    assert sorted(calls) == list(range(20))  # the second epoch came from the cache
    assert sorted(epoch_1) == sorted(epoch_2) == list(range(20)) and epoch_1 != epoch_2


# -- remainder and steps ---------------------------------------------------------------
def test_drop_remainder():
    data = keras_dist.distribute_dataset(np.arange(23), 5, drop_remainder=True, seed=4)
    sizes = [len(b) for b in data]
    assert sizes == [5, 5, 5, 5] and data.steps_per_epoch == 4
    kept = keras_dist.distribute_dataset(np.arange(23), 5)  # default on one worker: keep
    assert kept.steps_per_epoch == 5 and sorted(_ids(kept)) == list(range(23))


def test_drop_remainder_without_a_full_batch_is_an_error():
    with pytest.raises(ValueError, match="fewer than one global batch"):
        keras_dist.distribute_dataset(np.arange(3), 5, drop_remainder=True)


def test_steps_per_epoch_of_other_datasets():
    assert keras_dist.steps_per_epoch(tf.data.Dataset.range(10).batch(4)) == 3
    assert keras_dist.steps_per_epoch(tf.data.Dataset.range(10).repeat()) is None
    with pytest.raises(TypeError, match="dataset"):
        keras_dist.steps_per_epoch([1, 2, 3])


# -- Keras ------------------------------------------------------------------------------
def test_fit_evaluate_predict_on_the_default_strategy():
    import keras

    rng = np.random.default_rng(0)
    x = rng.normal(size=(70, 3)).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    train = keras_dist.distribute_dataset((x, y), 16, repeat=True)
    history = model.fit(train, epochs=3, steps_per_epoch=train.steps_per_epoch, verbose=0)
    assert history.history["loss"][-1] < history.history["loss"][0]
    loss = model.evaluate(keras_dist.distribute_dataset((x, y), 16, shuffle=False), verbose=0)
    assert np.isfinite(loss)
    predictions = model.predict(keras_dist.distribute_dataset(x, 16, shuffle=False), verbose=0)
    np.testing.assert_allclose(predictions, model(x).numpy(), atol=1e-6)  # original order


# -- errors ----------------------------------------------------------------------------
_X = np.zeros((10, 2))


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(per_replica_batch_size=0), ValueError, "per_replica_batch_size"),
    (dict(per_replica_batch_size=2.5), ValueError, "per_replica_batch_size"),
    (dict(per_replica_batch_size=True), ValueError, "per_replica_batch_size"),
    (dict(per_replica_batch_size="8"), ValueError, "per_replica_batch_size"),
    (dict(shuffle_buffer=0), ValueError, "shuffle_buffer"),
    (dict(seed=-1), ValueError, "seed"),
    (dict(map_fn=5), TypeError, "map_fn"),
    (dict(shuffle="yes"), TypeError, "shuffle"),
    (dict(repeat=1), TypeError, "repeat"),
    (dict(cache=None), TypeError, "cache"),
    (dict(drop_remainder="no"), TypeError, "drop_remainder"),
    (dict(strategy="mirrored"), TypeError, "strategy"),
])
def test_bad_arguments_name_the_argument(kwargs, error, match):
    kwargs = {"per_replica_batch_size": 2, **kwargs}
    with pytest.raises(error, match=match):
        keras_dist.distribute_dataset(_X, **kwargs)


@pytest.mark.parametrize("source, error, match", [
    (5, TypeError, "Received: int"),
    ({1, 2}, TypeError, "Received: set"),
    ([1, 2], TypeError, "list"),
    ([_X, _X], TypeError, "tuple"),
    ((), ValueError, "empty tuple"),
    ({}, ValueError, "empty dict"),
    ((_X, np.zeros(7)), ValueError, r"lengths.*10.*7"),
    ((_X, "labels"), TypeError, "str"),
    (np.float32(3.0), ValueError, "scalar"),
    (np.zeros((0, 2)), ValueError, "0 examples"),
    (tf.data.Dataset.range(0), ValueError, "no elements"),
    ("/nonexistent/dir/*.tfrecord", ValueError, "matches no file"),
    (["/nonexistent/a.tfrecord"], ValueError, "do not exist"),
])
def test_bad_sources_are_explained(source, error, match):
    with pytest.raises(error, match=match):
        keras_dist.distribute_dataset(source, 2)


def test_multi_worker_environment_without_its_strategy_is_an_error(monkeypatch):
    cluster = {"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]},
               "task": {"type": "worker", "index": 0}}
    monkeypatch.setenv("TF_CONFIG", json.dumps(cluster))
    with pytest.raises(RuntimeError, match="keras_dist.strategy()"):
        keras_dist.distribute_dataset(_X, 2)
    # An explicit strategy is the user's choice.
    data = keras_dist.distribute_dataset(_X, 2, strategy=tf.distribute.get_strategy())
    assert data.steps_per_epoch == 5


def test_function_source_must_return_a_dataset():
    with pytest.raises(TypeError, match="must return a tf.data.Dataset"):
        keras_dist.distribute_dataset(lambda ctx: [1, 2, 3], 2)


def test_batched_dataset_warns():
    with pytest.warns(UserWarning, match="already batched"):
        keras_dist.distribute_dataset(tf.data.Dataset.range(10).batch(2).prefetch(1), 2)


# -- MirroredStrategy on 4 virtual CPU devices (fresh process) -------------------------
def _mirrored_checks():
    import keras
    import numpy as np
    import tensorflow as tf

    import keras_dist

    strategy = keras_dist.strategy()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(128, 5)).astype("float32")
    y = (x @ rng.normal(size=(5, 1))).astype("float32")

    def train(data, under):
        with under.scope():
            keras.utils.set_random_seed(3)
            model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, "tanh"),
                                      keras.layers.Dense(1)])
            model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
        initial = model.get_weights()
        model.fit(data, epochs=2, verbose=0)
        model.moved = max(float(np.abs(a - b).max()) for a, b in
                          zip(initial, model.get_weights()))
        return model

    mirrored = train(keras_dist.distribute_dataset((x, y), 8, shuffle=False), strategy)
    one_device = tf.distribute.OneDeviceStrategy("/cpu:0")
    reference = train(keras_dist.distribute_dataset((x, y), 32, strategy=one_device,
                                                    shuffle=False), one_device)
    uneven = keras_dist.distribute_dataset(x[:100], 8, shuffle=False)
    first = next(iter(uneven))
    shuffled = keras_dist.distribute_dataset(np.arange(100), 8, seed=1)
    seen = [int(v) for batch in shuffled
            for local in strategy.experimental_local_results(batch) for v in local.numpy()]
    return {
        "replicas": strategy.num_replicas_in_sync,
        "max_weight_diff": max(float(np.abs(a - b).max()) for a, b in
                               zip(mirrored.get_weights(), reference.get_weights())),
        "moved": mirrored.moved,
        "uneven_steps": uneven.steps_per_epoch,
        "first_local_shapes": [t.shape[0] for t in strategy.experimental_local_results(first)],
        "predict_in_order": bool(np.allclose(mirrored.predict(uneven, verbose=0),
                                             mirrored(x[:100]).numpy(), atol=1e-6)),
        "predict_rows": int(mirrored.predict(uneven, verbose=0).shape[0]),
        "seen": sorted(seen),
    }


@pytest.mark.timeout(300)
@pytest.mark.multiworker
@pytest.mark.slow
def test_mirrored_four_devices_matches_single_device_training():
    result = run_in_subprocess(_mirrored_checks, virtual_devices=4, timeout=240)
    assert result["replicas"] == 4
    # Same global batch (4 x 8 = 32) in the same order: the same SGD steps.
    assert result["max_weight_diff"] < 1e-5 and result["moved"] > 1e-3
    assert result["uneven_steps"] == 4  # ceil(100 / 32)
    assert result["first_local_shapes"] == [8, 8, 8, 8]
    assert result["predict_in_order"] and result["predict_rows"] == 100
    assert result["seen"] == list(range(100))
