"""Models with their own `train_step` under `keras_dist.strategy()` (issue 23).

The corpus (tests/custom_steps.py: the keras-io GAN, a fixed-noise GAN, the VAE, a
model with its own `test_step`, a two-headed model tracking a `Loss` object, a loss
function and `add_loss`, and TensorFlow's `compute_average_loss` idiom) trains in each
mode once, in one process per mode:

* plain Keras with no strategy, then `keras_dist.strategy()` on one device (one
  subprocess): the same weights and history, bit for bit;
* 2 virtual devices (one subprocess; slow lane) and 2 launched workers (the session's
  worker pool), with the same global batch: steps without random draws give the one-device
  weights (1e-5) and report the one-device losses (1e-5 relative) in `history` and
  `evaluate()`; steps with random draws keep the workers identical, report losses of
  the one-device size, finite and falling.
"""

import numpy as np
import pytest

import custom_steps as corpus
from helpers import max_diff
from keras_dist.testing import run_in_subprocess

pytestmark = pytest.mark.multiworker
TOLERANCE = 1e-5


def _plain(result):
    result = dict(result)
    result.pop("model", None)
    return result


def _saved_parts_round_trip(name, model, directory):
    """Saves the trained parts a user keeps (GAN generator, VAE decoder) and loads them."""
    import os

    import keras

    part = {"gan": "generator", "gan_fixed_noise": "generator", "vae": "decoder"}.get(name)
    if part is None:
        return None
    sub_model = getattr(model, part)
    path = os.path.join(directory, f"{name}_{part}.keras")
    sub_model.save(path)
    loaded = keras.saving.load_model(path)
    inputs = np.random.default_rng(3).normal(
        size=(4,) + tuple(sub_model.input_shape[1:])).astype("float32")
    return float(np.max(np.abs(loaded.predict(inputs, verbose=0)
                               - sub_model.predict(inputs, verbose=0))))


def _corpus_on(strategy, directory):
    out = {}
    for name in corpus.ALL:
        result = corpus.train(name, strategy)
        if directory is not None:
            result["saved_parts_diff"] = _saved_parts_round_trip(name, result["model"],
                                                                 directory)
        out[name] = _plain(result)
    return out


def _plain_then_one_device(directory):
    import keras_dist

    plain = _corpus_on(None, None)  # before keras_dist touches anything
    return {"plain": plain, "one_device": _corpus_on(keras_dist.strategy(), directory)}


def _on_this_strategy(directory):
    import keras_dist

    out = _corpus_on(keras_dist.strategy(), directory)
    out["replicas"] = keras_dist.strategy().num_replicas_in_sync
    return out


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    return run_in_subprocess(_plain_then_one_device,
                             args=(str(tmp_path_factory.mktemp("one")),), timeout=400)


@pytest.fixture(scope="module")
def two_devices(tmp_path_factory):
    return run_in_subprocess(_on_this_strategy, args=(str(tmp_path_factory.mktemp("two")),),
                             virtual_devices=2, timeout=400)


@pytest.fixture(scope="module")
def two_workers(worker_pool, tmp_path_factory):
    return worker_pool.run(_on_this_strategy, args=(str(tmp_path_factory.mktemp("w")),),
                           timeout=400)


def _close(actual, expected, what):
    for key in expected:
        a, e = np.asarray(actual[key], float), np.asarray(expected[key], float)
        assert np.allclose(a, e, rtol=TOLERANCE, atol=TOLERANCE), (
            f"{what} {key}: {a.tolist()} vs one device {e.tolist()}")


def _check_equals_one_device(result, reference):
    assert max_diff(result["weights"], reference["weights"]) <= TOLERANCE
    _close(result["history"], reference["history"], "history")
    if "evaluate" in reference:
        _close(result["evaluate"], reference["evaluate"], "evaluate")
        assert max_diff(result["predict"], reference["predict"]) <= TOLERANCE


def _check_random_step(result, reference, name):
    first_key = {"gan": "d_loss", "vae": "loss"}[name]
    for key, losses in result["history"].items():
        assert np.all(np.isfinite(losses)), f"{key}: {losses}"
        # The per-replica draws differ from one device's, but the reported loss is the
        # global mean: the one-device size, not 1/N of it.
        ratio = losses[0] / reference["history"][key][0]
        assert 0.8 < ratio < 1.25, f"{key}: {losses} vs one device {reference['history'][key]}"
    losses = result["history"][first_key]
    assert losses[-1] < losses[0], f"{first_key} does not fall: {losses}"


@pytest.mark.parametrize("name", corpus.ALL)
def test_one_device_trains_exactly_as_plain_keras(one_device, name):
    plain, ours = one_device["plain"][name], one_device["one_device"][name]
    assert max_diff(ours["weights"], plain["weights"]) == 0.0
    # Metrics: the same to float32 rounding (a one-replica strategy reads its trackers
    # through an on-read sum: the VAE's mean differed by 1 ulp in one epoch).
    for key, losses in plain["history"].items():
        assert np.allclose(ours["history"][key], losses, rtol=1e-6, atol=0), key
    for key, value in plain.get("evaluate", {}).items():
        assert np.isclose(ours["evaluate"][key], value, rtol=1e-6, atol=0), key
    if ours["saved_parts_diff"] is not None:
        assert ours["saved_parts_diff"] <= 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("name", corpus.DETERMINISTIC)
def test_two_devices_equal_one_device(two_devices, one_device, name):
    assert two_devices["replicas"] == 2
    _check_equals_one_device(two_devices[name], one_device["one_device"][name])


@pytest.mark.parametrize("name", corpus.DETERMINISTIC)
def test_two_workers_equal_one_device_and_each_other(two_workers, one_device, name):
    chief, other = two_workers
    assert chief["replicas"] == other["replicas"] == 2
    assert max_diff(chief[name]["weights"], other[name]["weights"]) == 0.0
    assert chief[name]["history"] == other[name]["history"]
    _check_equals_one_device(chief[name], one_device["one_device"][name])


@pytest.mark.slow
@pytest.mark.parametrize("name", corpus.RANDOM)
def test_random_draws_train_on_two_devices(two_devices, one_device, name):
    _check_random_step(two_devices[name], one_device["one_device"][name], name)


@pytest.mark.parametrize("name", corpus.RANDOM)
def test_random_draws_keep_two_workers_identical(two_workers, one_device, name):
    chief, other = two_workers
    assert max_diff(chief[name]["weights"], other[name]["weights"]) == 0.0
    assert chief[name]["history"] == other[name]["history"]
    _check_random_step(chief[name], one_device["one_device"][name], name)


@pytest.mark.parametrize("mode", [pytest.param("two_devices", marks=pytest.mark.slow),
                                  "two_workers"])
def test_trained_parts_save_and_load(request, mode):
    results = request.getfixturevalue(mode)
    for result in results if isinstance(results, list) else [results]:
        for name in ("gan", "gan_fixed_noise", "vae"):
            assert result[name]["saved_parts_diff"] <= 1e-6, name


# -- each fix is needed (keras_dist.compat: build_models_without_call, custom_step_loss_scale)
def _train_one(name):
    import keras_dist

    return _plain(corpus.train(name, keras_dist.strategy(), evaluate=False))


@pytest.mark.slow
def test_without_the_build_fix_a_model_without_call_fails_on_one_device():
    from keras_dist.testing import WorkerError

    with pytest.raises(WorkerError, match=r"does not have a `call\(\)` method"):
        run_in_subprocess(_train_one, args=("gan",), timeout=300,
                          env={"KERAS_DIST_DISABLE_COMPAT": "build_models_without_call"})


@pytest.mark.slow
def test_without_the_loss_fix_two_replicas_report_half_the_loss(one_device):
    result = run_in_subprocess(_train_one, args=("own_test_step",), virtual_devices=2,
                               timeout=300,
                               env={"KERAS_DIST_DISABLE_COMPAT": "custom_step_loss_scale"})
    reference = one_device["one_device"]["own_test_step"]
    # The weights are right either way; only what the step tracks is off.
    assert max_diff(result["weights"], reference["weights"]) <= TOLERANCE
    assert np.allclose(result["history"]["loss"],
                       np.asarray(reference["history"]["loss"]) / 2, rtol=1e-5)


# -- the options keras_dist makes exact, on each optimizer of a two-optimizer GAN --------
OPTIONS = {
    # name: (train() arguments, the one-device run it must equal, tolerance)
    "global_clipnorm": (dict(global_clipnorm=0.05), "global_clipnorm", TOLERANCE),
    "clipnorm": (dict(clipnorm=0.02), "clipnorm", TOLERANCE),
    "gradient_accumulation_steps": (dict(gradient_accumulation_steps=2),
                                    "gradient_accumulation_steps", TOLERANCE),
    # keras_dist's clipnorm is Keras' global_clipnorm on the aggregated gradient: each
    # optimizer clips its own gradients by their own norm.
    "GradientAggregation": ("aggregation", "global_clipnorm", TOLERANCE),
    # keras_dist's accumulation (the optimizers the step builds lazily are built on the
    # first step) averages k micro-batches like Keras' own: equal with constant-rate SGD.
    "GradientAggregation_accumulation": ("aggregation_accumulation",
                                         "gradient_accumulation_steps", TOLERANCE),
    # LossScaleOptimizer around each optimizer, mixed_float16 (measured 3.4e-6).
    "mixed_precision": (dict(optimizer="sgd_loss_scale"), "mixed_precision", 1e-4),
}


def _options_on(strategy, directory):
    import os

    import keras_dist

    out = {}
    for option, (arguments, _, _) in OPTIONS.items():
        if arguments == "aggregation":
            arguments = dict(callbacks=[keras_dist.callbacks.GradientAggregation(
                clipnorm=0.05)])
        elif arguments == "aggregation_accumulation":
            arguments = dict(callbacks=[keras_dist.callbacks.GradientAggregation(
                accumulation_steps=2)])
        arguments = {"optimizer": "sgd", **arguments}
        out[option] = _plain(corpus.train("gan_fixed_noise", strategy, evaluate=False,
                                          **arguments))
    # BackupAndRestore with Adam (both optimizers' moments): an interrupted run (its last
    # backup mid-epoch 1) resumed to 3 epochs equals the uninterrupted run.
    backup_dir = os.path.join(directory, "backup")

    def backup(**kwargs):
        return [keras_dist.callbacks.BackupAndRestore(backup_dir, save_freq=3, **kwargs)]

    out["uninterrupted"] = _plain(corpus.train("gan_fixed_noise", strategy, optimizer="adam",
                                               evaluate=False))
    corpus.train("gan_fixed_noise", strategy, optimizer="adam", evaluate=False, epochs=2,
                 callbacks=backup(delete_checkpoint=False))
    out["resumed"] = _plain(corpus.train("gan_fixed_noise", strategy, optimizer="adam",
                                         evaluate=False, callbacks=backup()))
    return out


def _options_here(directory):
    import keras_dist

    return _options_on(keras_dist.strategy(), directory)


@pytest.fixture(scope="module")
def options_one_device(tmp_path_factory):
    return run_in_subprocess(_options_here, args=(str(tmp_path_factory.mktemp("o1")),),
                             timeout=400)


@pytest.fixture(scope="module")
def options_two_workers(worker_pool, tmp_path_factory):
    return worker_pool.run(_options_here, args=(str(tmp_path_factory.mktemp("ow")),),
                           timeout=400)


# The options run on one device and on 2 launched workers only: which optimizer gets an
# option is decided by keras_dist's step code, the same for every strategy; each option's
# all-reduce on 2 virtual devices is test_aggregation's (a 2-device run of this matrix
# cost ~50 CPU-seconds of the slow lane and asserted nothing the two others do not).
@pytest.mark.slow
@pytest.mark.parametrize("option", OPTIONS)
def test_each_optimizer_of_a_gan_gets_the_option(options_one_device, options_two_workers,
                                                  option):
    _, reference_name, tolerance = OPTIONS[option]
    reference = options_one_device[reference_name]["weights"]
    for result in options_two_workers:  # one result per worker
        assert max_diff(result[option]["weights"], reference) <= tolerance
    # The option acts: its one-device result differs from plain SGD's (whose float32
    # run equals mixed precision's to 1e-4).
    if option != "mixed_precision":
        assert max_diff(reference, options_one_device["mixed_precision"]["weights"]) > 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["options_one_device", "options_two_workers"])
def test_a_gan_resumes_from_a_mid_epoch_backup_exactly(request, mode):
    results = request.getfixturevalue(mode)
    for result in results if isinstance(results, list) else [results]:
        assert max_diff(result["resumed"]["weights"], result["uninterrupted"]["weights"]) \
            <= TOLERANCE


# -- what a strategy cannot run gets an error naming the step ---------------------------
def test_gradient_aggregation_accumulation_builds_a_gans_optimizers_on_the_first_step():
    import keras_dist

    callback = keras_dist.callbacks.GradientAggregation(accumulation_steps=2)
    accumulated = corpus.train("gan_fixed_noise", None, evaluate=False, epochs=1,
                               callbacks=[callback])
    stock = corpus.train("gan_fixed_noise", None, evaluate=False, epochs=1,
                         gradient_accumulation_steps=2)
    assert set(callback.aggregators) == {"optimizer", "d_optimizer", "g_optimizer"}
    # 4 batches, 2 per update, for each of the two optimizers that the step uses.
    assert callback.aggregators["d_optimizer"].all_reduce_count == 2
    assert callback.aggregators["g_optimizer"].all_reduce_count == 2
    assert max_diff(accumulated["weights"], stock["weights"]) <= 1e-6


def _eager_habits_in_steps():
    """{habit: the error message fit raises} for steps written as eager code."""
    import keras
    import keras_dist
    import tensorflow as tf

    class EagerHabits(keras.Model):
        habit = None

        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                loss = keras.ops.mean((self(x) - y) ** 2)
                if self.habit == "variable":
                    loss = loss * tf.Variable(1.0)
            if self.habit == "numpy":
                print("loss", loss.numpy())
            grads = tape.gradient(loss, self.trainable_variables)
            self.optimizer.apply(grads, self.trainable_variables)
            return {"loss": loss}

    messages = {}
    for habit in ("numpy", "variable"):
        with keras_dist.strategy().scope():
            inputs = keras.Input((4,))
            model = EagerHabits(inputs, keras.layers.Dense(1)(inputs))
            model.habit = habit
            model.compile(optimizer="sgd")
        try:
            model.fit(np.ones((8, 4)), np.ones((8, 1)), batch_size=4, verbose=0)
        except (AttributeError, ValueError) as error:
            messages[habit] = str(error)
    return messages


def test_eager_habits_inside_a_step_are_errors_naming_the_step():
    messages = run_in_subprocess(_eager_habits_in_steps, virtual_devices=2, timeout=300)
    assert "EagerHabits.train_step calls `.numpy()`" in messages["numpy"]
    assert "tf.print" in messages["numpy"]
    assert "EagerHabits.train_step creates a variable" in messages["variable"]
    assert "`__init__` or `build()`" in messages["variable"]


# -- the closing-note table (written to KERAS_DIST_CUSTOM_STEPS_TABLE if set) --
@pytest.mark.slow
def test_the_corpus_table_has_every_model_and_mode(one_device, two_devices, two_workers,
                                                  tmp_path):
    import os

    rows = ["| model | mode | max weight diff vs one device | first reported loss vs one "
            "device (rel.) | workers identical |", "|---|---|---|---|---|"]
    for name in corpus.ALL:
        reference = one_device["one_device"][name]
        key = sorted(reference["history"])[0]
        plain = one_device["plain"][name]
        rows.append(f"| {name} | one device vs plain Keras | "
                    f"{max_diff(reference['weights'], plain['weights']):.1e} | "
                    f"{abs(reference['history'][key][0] / plain['history'][key][0] - 1):.1e}"
                    f" ({key}) | - |")
        for mode, result, identical in (
                ("2 virtual devices", two_devices[name], "-"),
                ("2 workers", two_workers[0][name],
                 "yes" if max_diff(two_workers[0][name]["weights"],
                                   two_workers[1][name]["weights"]) == 0 else "NO")):
            ratio = result["history"][key][0] / reference["history"][key][0]
            rows.append(f"| {name} | {mode} | "
                        f"{max_diff(result['weights'], reference['weights']):.1e} | "
                        f"{abs(ratio - 1):.1e} ({key}) | {identical} |")
    path = os.environ.get("KERAS_DIST_CUSTOM_STEPS_TABLE") or str(tmp_path / "table.md")
    with open(path, "w") as file:
        file.write("\n".join(rows) + "\n")
    assert len(rows) == 2 + 3 * len(corpus.ALL)
    assert all(not row.endswith("| NO |") for row in rows)
