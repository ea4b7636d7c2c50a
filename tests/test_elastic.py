"""Elastic training: one global data order, backups that resume on another count.

The reference is one device, uninterrupted, shuffling on (`tests/elastic_run.py`). Two
workers must equal it, and so must every run interrupted mid-epoch and resumed on another
number of workers or replicas: 2 -> 1 (fast lane), 1 -> 2 (the shared worker pool) and
2 -> 4 replicas (virtual devices) in the slow lane. The launcher's shrink and the chaos run are
in `tests/test_elastic_launch.py`.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest

import keras_dist
from elastic_run import GLOBAL_BATCH, NUM_EXAMPLES, SEED, data_arrays, train
from helpers import max_diff
from keras_dist.checkpointing.elastic import check_resume
from keras_dist.checkpointing.files import Backup, BackupError
from keras_dist.data.order import InputOrder, array_shard_indices, epoch_order, worker_indices

TOLERANCE = 1e-5
STOP_AFTER = 22  # 13 steps per epoch, a backup every 5: the last one at epoch 1, batch 7


# -- the order itself ---------------------------------------------------------------------
@pytest.mark.parametrize("workers", [1, 2, 4])
def test_every_worker_count_reads_one_devices_global_batches(workers):
    n, batch = 203, 16
    for epoch in range(3):
        parts = [worker_indices(n, workers, w, batch // workers, epoch, SEED)
                 for w in range(workers)]
        full = n // batch
        steps = [np.concatenate([p[t * (batch // workers):(t + 1) * (batch // workers)]
                                 for p in parts]) for t in range(full)]
        tail = np.concatenate([p[full * (batch // workers):] for p in parts])
        order = epoch_order(n, epoch, SEED)
        assert np.array_equal(np.concatenate(steps + [tail]), order)
        assert sorted(order.tolist()) == list(range(n))
    assert not np.array_equal(epoch_order(n, 0, SEED), epoch_order(n, 1, SEED))
    assert np.array_equal(epoch_order(n, 1, SEED), epoch_order(n, 1, SEED))
    assert np.array_equal(array_shard_indices(n, 1, 0, batch), np.arange(n))


class _MapStyle:
    """A map-style dataset: `len()` and `[i]` -> (features, label)."""

    def __len__(self):
        return 30

    def __getitem__(self, index):
        return [np.full(2, index, "float32"), index]


def _labels(data):
    return [int(v) for batch in data for v in np.asarray(batch[1])]


def test_index_able_objects_and_pandas_frames_are_read_in_the_global_order():
    pandas = pytest.importorskip("pandas")

    data = keras_dist.distribute_dataset(_MapStyle(), 8, seed=SEED)
    assert data.keras_dist_input.global_order and data.steps_per_epoch == 4
    assert _labels(data) == epoch_order(30, 0, SEED).tolist()
    assert _labels(data) == epoch_order(30, 1, SEED).tolist()  # the next epoch
    frame = pandas.DataFrame({"a": np.arange(10.0), "b": np.arange(10.0) * 2})
    data = keras_dist.distribute_dataset((frame, pandas.Series(np.arange(10))), 5, seed=SEED)
    assert _labels(data) == epoch_order(10, 0, SEED).tolist()


def test_sources_that_are_not_one_example_per_index_are_refused_clearly():
    import keras

    class Batches(keras.utils.PyDataset):
        def __len__(self):
            return 2

        def __getitem__(self, index):
            return np.zeros((4, 2)), np.zeros(4)

    class Broken:
        def __len__(self):
            return 3

        def __getitem__(self, index):
            raise KeyError(index)

    with pytest.raises(TypeError, match="PyDataset, whose items are whole batches"):
        keras_dist.distribute_dataset(Batches(), 4)
    with pytest.raises(TypeError, match=r"`source\[0\]` failed with KeyError"):
        keras_dist.distribute_dataset(Broken(), 4)


# -- in fit, on one device ----------------------------------------------------------------
def _plain_keras_epoch(epoch, initial):
    """Plain Keras, no strategy: one epoch on `epoch_order(epoch)` in order."""
    import keras

    x, y = data_arrays()
    order = epoch_order(NUM_EXAMPLES, epoch, SEED)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, "tanh"),
                              keras.layers.Dense(4)])
    model.set_weights(initial)
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    model.fit(x[order], y[order], batch_size=GLOBAL_BATCH, shuffle=False, epochs=1,
              verbose=0)
    return model.get_weights()


def _keras_dist_epoch(epoch, initial, repeat=False):
    """keras_dist, one device: fit's epoch `epoch` only (`initial_epoch`)."""
    import keras

    x, y = data_arrays()
    with keras_dist.strategy().scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, "tanh"),
                                  keras.layers.Dense(4)])
        model.set_weights(initial)
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    # drop_remainder=False: the partial last batch too, as one pass per epoch has it.
    data = keras_dist.distribute_dataset((x, y), GLOBAL_BATCH, seed=SEED, repeat=repeat,
                                         drop_remainder=False)
    steps = {"steps_per_epoch": data.steps_per_epoch} if repeat else {}
    model.fit(data, initial_epoch=epoch, epochs=epoch + 1, verbose=0, **steps)
    return model.get_weights()


def test_fit_at_epoch_e_reads_epoch_e_order_in_both_fit_forms():
    from helpers import initial_weights

    expected = _plain_keras_epoch(2, initial_weights())
    assert max_diff(_keras_dist_epoch(2, initial_weights()), expected) < 1e-6
    assert max_diff(_keras_dist_epoch(2, initial_weights(), repeat=True), expected) < 1e-6


def test_without_the_epoch_fix_a_resumed_epoch_reads_another_order(monkeypatch):
    from helpers import initial_weights
    from keras_dist import compat

    expected = _plain_keras_epoch(2, initial_weights())
    # Disabled, not only reverted: `keras_dist.strategy()` puts reverted fixes back.
    monkeypatch.setenv("KERAS_DIST_DISABLE_COMPAT", "input_epoch")
    compat.revert("input_epoch")
    try:
        assert max_diff(_keras_dist_epoch(2, initial_weights()), expected) > 1e-3
    finally:
        monkeypatch.delenv("KERAS_DIST_DISABLE_COMPAT")
        compat.revert("input_epoch")
        compat.apply()
    assert compat.applied()["input_epoch"] is True


# -- what a backup may resume on (pure Python) --------------------------------------------
def _backup(step=7, workers=2, replicas=2, global_order=True, global_batch=16):
    order = InputOrder(global_order, global_batch, "arrays" if global_order else
                       "TFRecord files")
    return Backup(1, step, 3, "/b/backup-000003.weights.h5", workers, replicas,
                  order.to_json())


def test_another_global_batch_is_refused_naming_the_folder_and_both_batches():
    now = InputOrder(True, 32, "arrays")
    with pytest.raises(BackupError, match=r"'/runs/b'.*global batch 16.*is 32.*"
                       r"per_replica_batch_size\(16\)"):
        check_resume(_backup(), "/runs/b", now, 1, 1)


def test_a_worker_count_dependent_order_is_refused_mid_epoch_and_warned_at_epoch_end():
    now = InputOrder(False, 16, "TFRecord files")
    with pytest.raises(BackupError, match=r"7 batch\(es\) into epoch 1.*TFRecord files.*"
                       r"save_freq='epoch'"):
        check_resume(_backup(global_order=False), "/runs/b", now, 1, 1)
    note, warning = check_resume(_backup(step=0, global_order=False), "/runs/b", now, 1, 1)
    assert note is None and "differs from the uninterrupted run" in warning
    with pytest.raises(BackupError, match="does not come from keras_dist"):
        check_resume(_backup(), "/runs/b", None, 1, 1)


def test_the_global_order_resumes_on_any_count_and_says_so():
    now = InputOrder(True, 16, "arrays")
    note, warning = check_resume(_backup(), "/runs/b", now, 1, 4)
    assert warning is None and "2 workers (2 replicas)" in note and "1 worker (4 " in note
    assert check_resume(_backup(), "/runs/b", now, 2, 2) == (None, None)


# -- N workers, and resuming across counts ------------------------------------------------
@pytest.fixture(scope="module")
def reference():
    """One device, uninterrupted."""
    return train()


@pytest.fixture(scope="module")
def two_worker_runs(worker_pool, tmp_path_factory):
    """On the pool: an uninterrupted run, then one stopped after STOP_AFTER batches."""
    backup = str(tmp_path_factory.mktemp("from_two") / "backup")

    def both(backup):
        from elastic_run import train

        return train(), train(backup, stop_after=STOP_AFTER, keep_backup=True)

    results = worker_pool.run(both, args=(backup,), timeout=300)
    return results, backup


@pytest.mark.multiworker
def test_two_workers_with_shuffling_equal_one_device(two_worker_runs, reference):
    results, _ = two_worker_runs
    (full, _), (full_1, _) = results
    assert max_diff(full["weights"], full_1["weights"]) == 0.0
    diff = max_diff(full["weights"], reference["weights"])
    print(f"2 workers vs one device, shuffled: {diff:.2e}")
    assert max_diff(full["weights"], reference["weights"]) < TOLERANCE
    assert full["iterations"] == reference["iterations"] == 39


@pytest.mark.multiworker
def test_a_two_worker_backup_resumes_exactly_on_one_device(two_worker_runs, reference,
                                                            tmp_path):
    results, backup = two_worker_runs
    assert results[0][1]["backup_step"] == (1, 7)  # mid-epoch
    copy = shutil.copytree(backup, tmp_path / "backup")
    resumed = train(str(copy))
    diff = max_diff(resumed["weights"], reference["weights"])
    print(f"2 workers -> 1 device, mid-epoch: {diff:.2e}")
    assert max_diff(resumed["weights"], reference["weights"]) < TOLERANCE
    assert resumed["iterations"] == 39


@pytest.mark.slow
@pytest.mark.multiworker
def test_a_one_device_backup_resumes_exactly_on_two_workers(worker_pool, reference,
                                                             tmp_path):
    backup = str(tmp_path / "backup")
    interrupted = train(backup, stop_after=STOP_AFTER, keep_backup=True)
    assert interrupted["backup_step"] == (1, 7)

    def resume(backup):
        from elastic_run import train

        return train(backup)

    resumed = worker_pool.run(resume, args=(backup,), timeout=300)
    print(f"1 device -> 2 workers, mid-epoch: "
          f"{max_diff(resumed[0]['weights'], reference['weights']):.2e}")
    assert max_diff(resumed[0]["weights"], reference["weights"]) < TOLERANCE
    assert max_diff(resumed[1]["weights"], reference["weights"]) < TOLERANCE


@pytest.mark.slow
@pytest.mark.multiworker
def test_a_two_worker_backup_resumes_exactly_on_four_replicas(two_worker_runs, reference,
                                                               tmp_path):
    from keras_dist.testing import run_in_subprocess

    _, backup = two_worker_runs
    copy = str(shutil.copytree(backup, tmp_path / "backup"))

    def resume(backup):
        from elastic_run import train

        import keras_dist

        return train(backup), keras_dist.strategy().num_replicas_in_sync

    resumed, replicas = run_in_subprocess(resume, args=(copy,), virtual_devices=4,
                                          timeout=300)
    assert replicas == 4
    print(f"2 workers -> 4 replicas, mid-epoch: "
          f"{max_diff(resumed['weights'], reference['weights']):.2e}")
    assert max_diff(resumed["weights"], reference["weights"]) < TOLERANCE


@pytest.mark.multiworker
def test_another_global_batch_is_refused_when_resuming(two_worker_runs, tmp_path):
    import keras

    _, backup = two_worker_runs
    copy = str(shutil.copytree(backup, tmp_path / "backup"))
    x, y = data_arrays()
    with keras_dist.strategy().scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, "tanh"),
                                  keras.layers.Dense(4)])
        model.compile(optimizer=keras.optimizers.Adam(), loss="mse")
    data = keras_dist.distribute_dataset((x, y), GLOBAL_BATCH * 2, seed=SEED)
    with pytest.raises(BackupError, match=r"global batch 16 .*global batch is 32"):
        model.fit(data, epochs=3, verbose=0,
                  callbacks=[keras_dist.callbacks.BackupAndRestore(copy, save_freq=5)])
    assert sorted(p.name for p in (tmp_path / "backup").iterdir()) == sorted(
        p.name for p in __import__("pathlib").Path(backup).iterdir())
