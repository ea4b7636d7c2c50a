"""The official tf.distribute tutorials run unchanged but for the strategy line (issue 10).

tests/tutorials/ holds one plain script per tutorial (TensorFlow docs: keras,
multi_worker_with_keras, custom_training, input, save_and_load, the distributed training
guide; keras-io's distributed_training_with_tensorflow), each transcribed cell by cell with
`keras_dist.strategy()` in place of `tf.distribute.MirroredStrategy()` /
`MultiWorkerMirroredStrategy()`, offline data of the same shapes, and smaller sizes (each
script's docstring lists its changes). Every tutorial runs in three modes:

* `one_device`: one process, one CPU device; the scripts' batch multiplier is 2, so its
  global batch equals the one of the two modes below: it is the numeric reference;
* `two_devices`: one process with 2 virtual CPU devices (MirroredStrategy);
* `two_workers`: `launch_script(..., num_workers=2, preload=True)`, the launcher of
  `keras-dist launch --workers 2 --preload` (MultiWorkerMirroredStrategy).

The selected tutorials of a mode run in one process (one worker group), through
tests/tutorials/run_tutorials.py. Per tutorial and mode the tests check: it ran; the
losses fall; launched workers end with identical weights and results; the files left are
those of one process (stock writers called from every worker must not collide or leave
temporary files); and weights, losses and metrics equal the one-device run (1e-5) where
the tutorial's arithmetic makes them equal.
"""

import io
import json
import os
import re
import sys
import time

import numpy as np
import pytest

from keras_dist.launching.local import launch_script
from keras_dist.testing import WorkerError, run_in_subprocess

TUTORIALS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tutorials")
DRIVER = os.path.join(TUTORIALS_DIR, "run_tutorials.py")
MULTIPLIER_ENV = "KERAS_DIST_TUTORIAL_BATCH_MULTIPLIER"
# The driver's watchdog: a tutorial running longer is a hang (each takes ~5-30 s alone;
# on a shared, loaded 2-core machine two_devices' custom_training took up to ~130 s).
HANG_TIMEOUT_ENV = ("KERAS_DIST_TUTORIAL_TIMEOUT", "150")
TUTORIALS = [
    "keras_tutorial",
    "multi_worker_with_keras",
    "custom_training",
    "input_tutorial",
    "save_and_load",
    "distributed_training_guide",
    "keras_io_guide",
]
MODE_TIMEOUT = 540  # seconds for all tutorials of one mode; measured: ~60-150 s idle
TOLERANCE = 1e-5

# Loss series that must fall (last < first) in every mode.
FALLING = {
    "keras_tutorial": ["fit"],
    "multi_worker_with_keras": ["single_worker", "main", "backup_1", "backup_2", "backup_3"],
    "custom_training": ["train", "epoch_function"],
    "input_tutorial": [],
    "save_and_load": ["model", "restored_keras_model", "restored_keras_model_ds",
                      "tfsm_layer_model", "my_model"],
    "distributed_training_guide": ["fit_dataset", "fit_numpy", "custom_loop",
                                   "custom_loop_iterator"],
    "keras_io_guide": ["fit", "val", "run_training"],
}

# What equals the one-device run with the same global batch, by mode: (weights labels,
# loss labels, metric labels). `None` means all of them.
_ALL = (None, None, None)
COMPARABLE = {
    "two_devices": {
        "keras_tutorial": _ALL,
        # main.py's global batch is per-worker batch x workers: 1 worker here, so only the
        # single-worker part has the reference's batch.
        "multi_worker_with_keras": (["single_worker_model"], ["single_worker"], []),
        "custom_training": _ALL,
        "save_and_load": _ALL,
        "distributed_training_guide": _ALL,
        "keras_io_guide": _ALL,
    },
    "two_workers": {
        "keras_tutorial": _ALL,
        "multi_worker_with_keras": _ALL,
        "custom_training": _ALL,
        "save_and_load": _ALL,
        "distributed_training_guide": _ALL,
        "keras_io_guide": _ALL,
    },
}


# Open bugs (issue 10 stays open on them); strict, so a fix turns these tests red until
# the mark is removed.
KNOWN_OPEN: dict = {}


def _known_open(mode, name):
    reason = KNOWN_OPEN.get((mode, name))
    return [pytest.mark.xfail(strict=True, reason=reason)] if reason else []


# Every tutorial runs in the slow lane, each mode's tutorials in one process (one worker
# group). save_and_load ran in the fast lane in processes of its own (~40 CPU-seconds of
# it); the stock writers' fast-lane check is tests/test_stock_writers.py (every writer on
# one path from 2 workers). Every mode starts processes.
LANE = [pytest.mark.multiworker, pytest.mark.slow]


# ---------------------------------------------------------------------------------------
# Running one mode


def _run_driver_here(out_dir, names):
    """Runs the driver in this (fresh) process; used through run_in_subprocess."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("run_tutorials", DRIVER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main([out_dir, *names])


def _read_json(path):
    try:
        with open(path) as file:
            return json.load(file)
    except (OSError, ValueError):
        return None


def _read_text(path, limit=8000):
    try:
        with open(path) as file:
            text = file.read()
    except OSError:
        return ""
    return text if len(text) <= limit else text[:limit] + "\n[...]"


def _files(workdir):
    """Files under a tutorial's working directory, names made comparable across runs."""
    found = []
    for root, _, names in os.walk(workdir):
        for name in names:
            relative = os.path.relpath(os.path.join(root, name), workdir)
            # TensorBoard event files carry host, pid and time in their names.
            found.append(re.sub(r"events\.out\.tfevents\..*", "events.out.tfevents",
                                relative))
    return sorted(found)


def _collect(out_dir, names, num_workers, log):
    """Per tutorial: status, errors, per-worker results and files."""
    statuses = [_read_json(os.path.join(out_dir, f"status.worker{i}.json")) or {}
                for i in range(num_workers)]
    collected = {}
    for name in names:
        per_worker = [status.get(name) for status in statuses]
        if not any(per_worker):
            continue  # not reached
        errors = [entry["error"] for entry in per_worker if entry and "error" in entry]
        if not all(per_worker):
            missing = [i for i, entry in enumerate(per_worker) if not entry]
            errors.append(f"worker(s) {missing} stopped before finishing {name} "
                          f"(log tail):\n{log[-3000:]}")
        collected[name] = {
            "ok": not errors,
            "errors": errors,
            "seconds": max(entry["seconds"] for entry in per_worker if entry),
            "results": [_read_json(os.path.join(out_dir, f"{name}.worker{i}.json"))
                        for i in range(num_workers)],
            "files": _files(os.path.join(out_dir, "work", name)),
        }
    return collected


def _run_attempt(mode, attempt_dir, names, env, timeout):
    """Runs the driver once; returns (succeeded, log)."""
    if mode == "two_workers":
        output = io.StringIO()
        result = launch_script(DRIVER, [attempt_dir, *names], num_workers=2, env=env,
                               stdout=output, timeout=timeout, preload=True)
        return result.returncode == 0, f"{result.message}\n{output.getvalue()}"
    try:
        run_in_subprocess(_run_driver_here, args=(attempt_dir, names), env=env,
                          timeout=timeout,
                          virtual_devices=2 if mode == "two_devices" else None)
        return True, ""
    except (WorkerError, TimeoutError) as error:
        return False, str(error)


def _run_mode(mode, out_dir, names):
    """Runs the tutorials `names` in one mode; per tutorial what `_collect` returns.

    A launched worker stops the group at its first failing tutorial (its peer may be
    blocked in a collective), and any run stops at a hang (the driver's watchdog): the
    tutorials after it run in a new attempt.
    """
    start = time.monotonic()
    env = {MULTIPLIER_ENV: "2" if mode == "one_device" else "1",
           HANG_TIMEOUT_ENV[0]: HANG_TIMEOUT_ENV[1]}
    num_workers = 2 if mode == "two_workers" else 1
    collected, remaining, attempt = {}, list(names), 0
    while remaining and time.monotonic() - start < MODE_TIMEOUT:
        attempt_dir = os.path.join(out_dir, f"attempt{attempt}")
        os.makedirs(attempt_dir)
        succeeded, log = _run_attempt(
            mode, attempt_dir, remaining, env,
            timeout=max(30.0, MODE_TIMEOUT - (time.monotonic() - start)))
        with open(os.path.join(out_dir, f"attempt{attempt}.log"), "w") as file:
            file.write(log)
        done = _collect(attempt_dir, remaining, num_workers, log)
        if not succeeded and all(entry["ok"] for entry in done.values()):
            # Died, hung or timed out before recording a failure: blame the first not done.
            stuck = next((name for name in remaining if name not in done), remaining[0])
            hangs = [_read_text(os.path.join(attempt_dir, f"hang.worker{i}.txt"))
                     for i in range(num_workers)]
            done[stuck] = {"ok": False, "seconds": None, "results": [None] * num_workers,
                           "files": [], "errors": [text for text in hangs if text]
                           + [f"log tail:\n{log[-3000:]}"]}
        collected.update(done)
        remaining = [name for name in remaining if name not in collected]
        attempt += 1
    print(f"{mode}: {time.monotonic() - start:.0f} s; per tutorial: "
          f"{ {name: entry['seconds'] for name, entry in collected.items()} }")
    return collected


def _selected(session):
    """{mode: the tutorials this session's selected tests read in that mode}."""
    needed: dict = {}
    for item in session.items:
        if item.module.__name__ != __name__ or not hasattr(item, "callspec"):
            continue
        params = item.callspec.params
        mode = params.get("mode") or {"test_one_device": "one_device",
                                      "test_two_virtual_devices": "two_devices",
                                      "test_two_launched_workers": "two_workers"}[
                                          item.originalname]
        needed.setdefault(mode, set()).add(params["name"])
        if "mode" in params:  # compared with the one-device run
            needed.setdefault("one_device", set()).add(params["name"])
    return needed


@pytest.fixture(scope="module")
def mode_runs(tmp_path_factory, request):
    """Runs each mode once, on first use, and keeps its results for all tests."""
    runs, needed = {}, _selected(request.session)

    def get(mode):
        if mode not in runs:
            names = [name for name in TUTORIALS if name in needed.get(mode, ())]
            runs[mode] = _run_mode(mode, str(tmp_path_factory.mktemp(mode)), names)
        return runs[mode]

    return get


def _succeeded(mode_runs, mode, name):
    entry = mode_runs(mode).get(name)
    assert entry is not None, f"{name} was not reached in mode {mode}"
    assert entry["ok"], f"{name} failed in mode {mode}:\n" + "\n".join(entry["errors"])
    assert all(entry["results"]), f"{name} wrote no result in mode {mode}"
    return entry


# ---------------------------------------------------------------------------------------
# Checks


def _flatten(nested):
    if isinstance(nested, (list, tuple)):
        return [number for item in nested for number in _flatten(item)]
    return [nested]


def _check_tutorial_values(name, results):
    """What each tutorial computes, checked on the union of the workers' results."""
    values = [result["values"] for result in results]
    if name == "input_tutorial":
        predictions = {}
        for value in values:
            predictions.update(value["predict"])
        assert predictions == {str(i): 2 * i for i in range(24)}
        for value in values:
            for label in ("before_strategy", "for_loop", "iterator"):
                numbers = _flatten(value[label])
                assert numbers and np.allclose(numbers, 0.7), f"{label}: {value[label]}"
        replica_ids = sorted({replica for value in values
                              for step in value["values_from_function"] for replica in step})
        assert replica_ids == list(range(results[0]["replicas"]))
    if name == "keras_tutorial":
        assert values[0]["latest_checkpoint"] == "ckpt_0004.weights.h5"
    if name == "custom_training":
        assert values[0]["checkpoints"] == [
            "checkpoint", "ckpt-1.data-00000-of-00001", "ckpt-1.index",
            "ckpt-2.data-00000-of-00001", "ckpt-2.index"]
    if name == "keras_io_guide":
        assert values[0]["checkpoints"] == ["ckpt-1.keras"]


def _check_losses_fall(name, result):
    for label in FALLING[name]:
        losses = result["losses"][label]
        assert all(np.isfinite(losses)), f"{label}: {losses}"
        assert losses[-1] < losses[0], f"{label} did not fall: {losses}"


@pytest.mark.timeout(MODE_TIMEOUT + 60)
@pytest.mark.parametrize("name", [
    pytest.param(name, marks=LANE) for name in TUTORIALS])
def test_one_device(mode_runs, name):
    entry = _succeeded(mode_runs, "one_device", name)
    (result,) = entry["results"]
    assert result["replicas"] == 1
    _check_losses_fall(name, result)
    _check_tutorial_values(name, [result])


@pytest.mark.timeout(MODE_TIMEOUT + 60)
@pytest.mark.parametrize("name", [
    pytest.param(name, marks=LANE) for name in TUTORIALS])
def test_two_virtual_devices(mode_runs, name):
    entry = _succeeded(mode_runs, "two_devices", name)
    (result,) = entry["results"]
    assert result["replicas"] == 2
    _check_losses_fall(name, result)
    _check_tutorial_values(name, [result])


@pytest.mark.timeout(MODE_TIMEOUT + 60)
@pytest.mark.parametrize("name", [
    pytest.param(name, marks=LANE + _known_open("two_workers", name))
    for name in TUTORIALS])
def test_two_launched_workers(mode_runs, name):
    entry = _succeeded(mode_runs, "two_workers", name)
    first, second = entry["results"]
    assert [first["task"], second["task"]] == [["worker", 0], ["worker", 1]]
    assert first["replicas"] == second["replicas"] == 2
    for result in (first, second):
        _check_losses_fall(name, result)
    _check_tutorial_values(name, entry["results"])
    # Synchronous training: both workers end with the same weights, losses and metrics.
    assert first["weights"].keys() == second["weights"].keys()
    for label in first["weights"]:
        assert first["weights"][label] == second["weights"][label], f"weights {label}"
    assert first["losses"] == second["losses"]
    assert first["metrics"] == second["metrics"]


def _mode_params():
    params = []
    for mode in ("two_devices", "two_workers"):
        params += [pytest.param(mode, name, marks=LANE + _known_open(mode, name),
                                id=f"{mode}-{name}")
                   for name in TUTORIALS]
    return params


@pytest.mark.timeout(2 * MODE_TIMEOUT + 60)
@pytest.mark.parametrize("mode,name", _mode_params())
def test_leaves_the_files_of_one_process(mode_runs, mode, name):
    # Stock writers called from every worker: the chief's files, no temporary leftovers.
    reference = _succeeded(mode_runs, "one_device", name)["files"]
    assert _succeeded(mode_runs, mode, name)["files"] == reference


def _compare(kind, label, actual, expected):
    actual, expected = np.asarray(actual, dtype=float), np.asarray(expected, dtype=float)
    assert actual.shape == expected.shape, f"{kind} {label}: shapes differ"
    difference = float(np.max(np.abs(actual - expected))) if actual.size else 0.0
    assert np.allclose(actual, expected, rtol=TOLERANCE, atol=TOLERANCE), (
        f"{kind} {label} differs from one device by up to {difference:.3g}")


def _numeric_params():
    params = []
    for mode, tutorials in COMPARABLE.items():
        params += [pytest.param(mode, name, id=f"{mode}-{name}", marks=LANE + (
                       _known_open(mode, name) or _known_open(f"{mode}-numerics", name)))
                   for name in tutorials]
    return params


@pytest.mark.timeout(2 * MODE_TIMEOUT + 60)
@pytest.mark.parametrize("mode,name", _numeric_params())
def test_numerics_equal_one_device(mode_runs, mode, name):
    (reference,) = _succeeded(mode_runs, "one_device", name)["results"]
    result = _succeeded(mode_runs, mode, name)["results"][0]
    weight_labels, loss_labels, metric_labels = COMPARABLE[mode][name]
    for kind, labels in (("weights", weight_labels), ("losses", loss_labels),
                         ("metrics", metric_labels)):
        for label in reference[kind] if labels is None else labels:
            _compare(kind, label, result[kind][label], reference[kind][label])
