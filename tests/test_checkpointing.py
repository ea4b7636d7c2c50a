"""BackupAndRestore, chief_path, verbose, ModelCheckpoint, TensorBoard.

One-process behaviour (resume mid-epoch, atomic saves, damaged backups, SIGTERM) runs in
this process with TensorFlow's default strategy; the chief-only outputs and the check
that all workers see the same backup run once on 2 real workers. Launcher-level crash,
kill and restart tests are in test_fault_tolerance.py.
"""

import importlib.util
import json
import os
import signal
import tempfile

import keras
import numpy as np
import pytest

import keras_dist
from keras_dist.checkpointing import files as backup_files
from keras_dist.checkpointing import (
    PREEMPTION_EXIT_CODE,
    BackupAndRestore,
    BackupError,
    ModelCheckpoint,
    TensorBoard,
    chief_path,
    verbose,
)
from keras_dist.testing import run_on_workers

EPOCHS = 3
STEPS = 6  # batches per epoch
# Keras' TensorBoard callback needs the `tensorboard` package (tf.summary's backend);
# TensorFlow 2.21 does not install it. Without it only the file checks are skipped.
HAS_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None
pytestmark = pytest.mark.filterwarnings("ignore:`shuffle=True` was passed")


def _dataset():
    import tensorflow as tf

    rng = np.random.RandomState(0)
    x = rng.rand(STEPS * 8, 4).astype("float32")
    y = x @ np.array([[1.0], [-1.0], [2.0], [0.5]], dtype="float32")
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(8)


def _model(units=3, steps_per_execution=1):
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(units, activation="tanh"),
                              keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.05, momentum=0.9), "mse",
                  steps_per_execution=steps_per_execution)
    return model


class _At(keras.callbacks.Callback):
    """Calls `action()` at the end of batch `batch` of epoch `epoch`."""

    def __init__(self, epoch, batch, action):
        super().__init__()
        self.where, self.action, self.seen = (epoch, batch), action, []

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        self.seen.append((self.epoch, batch, bool(logs)))
        if (self.epoch, batch) == self.where:
            self.action()


def _crash():
    raise RuntimeError("simulated crash")


@pytest.fixture(scope="module")
def reference():
    """Final weights and optimizer step count of an uninterrupted run."""
    model = _model()
    model.fit(_dataset(), epochs=EPOCHS, verbose=0)
    return model.get_weights(), int(model.optimizer.iterations.numpy())


def _assert_same_weights(model, reference):
    weights, iterations = reference
    assert int(model.optimizer.iterations.numpy()) == iterations
    for got, want in zip(model.get_weights(), weights):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)


def _metadata(backup_dir):
    with open(os.path.join(backup_dir, "backup.json")) as file:
        return json.load(file)


# -- resume --------------------------------------------------------------------------
def test_resumes_mid_epoch_and_ends_with_uninterrupted_weights(tmp_path, reference):
    backup_dir = str(tmp_path / "backup")
    with pytest.raises(RuntimeError, match="simulated crash"):
        _model().fit(_dataset(), epochs=EPOCHS, verbose=0,
                     callbacks=[BackupAndRestore(backup_dir, save_freq=2), _At(1, 3, _crash)])
    saved = _metadata(backup_dir)
    assert (saved["epoch"], saved["step"]) == (1, 4)  # saves after batches 2 and 4
    assert sorted(os.listdir(backup_dir)) == sorted(saved["files"])

    model, log = _model(), _At(-1, -1, None)
    history = model.fit(_dataset(), epochs=EPOCHS, verbose=0,
                        callbacks=[BackupAndRestore(backup_dir, save_freq=2), log])
    assert history.epoch == [1, 2]
    # The first 4 batches of epoch 1 are read and dropped (empty logs), then training goes on.
    assert log.seen[:5] == [(1, 0, False), (1, 1, False), (1, 2, False), (1, 3, False),
                            (1, 4, True)]
    assert len(log.seen) == 2 * STEPS
    _assert_same_weights(model, reference)
    assert not os.path.exists(backup_dir)  # delete_checkpoint=True after success

    # Keras' initial epoch is not left behind for the next fit of the same model.
    assert len(model.fit(_dataset(), epochs=2, verbose=0).epoch) == 2


def test_resumes_mid_epoch_with_steps_per_execution(tmp_path, reference):
    backup_dir = str(tmp_path / "backup")
    with pytest.raises(RuntimeError):
        _model(steps_per_execution=2).fit(
            _dataset(), epochs=EPOCHS, verbose=0,
            callbacks=[BackupAndRestore(backup_dir, save_freq=2), _At(1, 3, _crash)])
    assert (_metadata(backup_dir)["epoch"], _metadata(backup_dir)["step"]) == (1, 4)
    model = _model(steps_per_execution=2)
    model.fit(_dataset(), epochs=EPOCHS, verbose=0,
              callbacks=[BackupAndRestore(backup_dir, save_freq=2)])
    _assert_same_weights(model, reference)


def test_epoch_backups_are_kept_when_asked_and_resume_at_the_next_epoch(tmp_path, reference):
    backup_dir = str(tmp_path / "backup")
    with pytest.raises(RuntimeError):
        _model().fit(_dataset(), epochs=EPOCHS, verbose=0,
                     callbacks=[BackupAndRestore(backup_dir), _At(2, 0, _crash)])
    assert (_metadata(backup_dir)["epoch"], _metadata(backup_dir)["step"]) == (2, 0)
    model = _model()
    history = model.fit(_dataset(), epochs=EPOCHS, verbose=0,
                        callbacks=[BackupAndRestore(backup_dir, delete_checkpoint=False)])
    assert history.epoch == [2]
    _assert_same_weights(model, reference)
    assert _metadata(backup_dir)["epoch"] == EPOCHS


def test_a_crash_during_a_save_leaves_the_previous_backup_loadable(tmp_path, monkeypatch,
                                                                   reference):
    backup_dir = str(tmp_path / "backup")
    model = _model()
    real_save = model.save_weights
    calls = []

    def save_weights_then_die(path, overwrite=True):
        calls.append(path)
        if len(calls) == 2:  # second save (end of epoch 1): half a file, then the crash
            with open(path, "wb") as file:
                file.write(b"\x89HDF\r\n half written")
            raise OSError("simulated crash while writing the weights")
        real_save(path, overwrite=overwrite)

    monkeypatch.setattr(model, "save_weights", save_weights_then_die)
    with pytest.raises(OSError, match="simulated crash"):
        model.fit(_dataset(), epochs=EPOCHS, verbose=0, callbacks=[BackupAndRestore(backup_dir)])
    assert _metadata(backup_dir)["epoch"] == 1
    assert sorted(os.listdir(backup_dir)) == ["backup-000001.weights.h5", "backup.json"]

    # Crash after the new weights file is in place but before backup.json is replaced.
    real_temporary_name = backup_files.temporary_name

    def die_before_metadata(directory, suffix):
        if suffix == ".json":
            raise OSError("simulated crash before the metadata")
        return real_temporary_name(directory, suffix)

    monkeypatch.setattr(backup_files, "temporary_name", die_before_metadata)
    with pytest.raises(OSError, match="before the metadata"):
        _model().fit(_dataset(), epochs=EPOCHS, verbose=0,
                     callbacks=[BackupAndRestore(backup_dir)])
    monkeypatch.undo()
    assert _metadata(backup_dir)["epoch"] == 1  # still the old, complete backup

    resumed = _model()
    history = resumed.fit(_dataset(), epochs=EPOCHS, verbose=0,
                          callbacks=[BackupAndRestore(backup_dir)])
    assert history.epoch == [1, 2]
    _assert_same_weights(resumed, reference)


def test_damaged_or_foreign_backups_are_refused_clearly(tmp_path):
    backup_dir = str(tmp_path / "backup")
    _model().fit(_dataset(), epochs=1, verbose=0,
                 callbacks=[BackupAndRestore(backup_dir, delete_checkpoint=False)])
    weights = os.path.join(backup_dir, _metadata(backup_dir)["weights"])

    with pytest.raises(BackupError, match="does not fit this model"):
        _model(units=5).fit(_dataset(), epochs=2, verbose=0,
                            callbacks=[BackupAndRestore(backup_dir)])

    with open(weights, "r+b") as file:
        file.seek(-1, os.SEEK_END)
        last = file.read(1)
        file.seek(-1, os.SEEK_END)
        file.write(bytes([last[0] ^ 0xFF]))
    with pytest.raises(BackupError, match="checksum"):
        _model().fit(_dataset(), epochs=2, verbose=0, callbacks=[BackupAndRestore(backup_dir)])

    os.remove(weights)
    with pytest.raises(BackupError, match="missing"):
        _model().fit(_dataset(), epochs=2, verbose=0, callbacks=[BackupAndRestore(backup_dir)])

    with open(os.path.join(backup_dir, "backup.json"), "w") as file:
        file.write("{not json")
    with pytest.raises(BackupError, match="damaged"):
        _model().fit(_dataset(), epochs=2, verbose=0, callbacks=[BackupAndRestore(backup_dir)])


def test_deleting_a_backup_keeps_other_files(tmp_path):
    backup_dir = tmp_path / "backup"
    backup_dir.mkdir()
    (backup_dir / "notes.txt").write_text("mine")
    _model().fit(_dataset(), epochs=1, verbose=0, callbacks=[BackupAndRestore(backup_dir)])
    assert os.listdir(backup_dir) == ["notes.txt"]


# -- SIGTERM -------------------------------------------------------------------------
def _sigterm_self():
    os.kill(os.getpid(), signal.SIGTERM)


def test_sigterm_saves_and_stops_then_resumes(tmp_path, reference):
    backup_dir = str(tmp_path / "backup")
    before = signal.getsignal(signal.SIGTERM)
    callback = BackupAndRestore(backup_dir, preemption_exit_code=None)
    history = _model().fit(_dataset(), epochs=EPOCHS, verbose=0,
                           callbacks=[_At(1, 2, _sigterm_self), callback])
    assert callback.preempted
    assert history.epoch == [0, 1]  # stopped inside epoch 1 ...
    assert (_metadata(backup_dir)["epoch"], _metadata(backup_dir)["step"]) == (1, 3)
    assert signal.getsignal(signal.SIGTERM) == before  # ... and put the old handler back

    model = _model()
    callback = BackupAndRestore(backup_dir)
    model.fit(_dataset(), epochs=EPOCHS, verbose=0, callbacks=[callback])
    assert not callback.preempted
    _assert_same_weights(model, reference)


def test_sigterm_exits_with_the_preemption_code(tmp_path, capsys):
    backup_dir = str(tmp_path / "backup")
    callback = BackupAndRestore(backup_dir)
    try:
        with pytest.raises(SystemExit) as exit_info:
            _model().fit(_dataset(), epochs=EPOCHS, verbose=0,
                         callbacks=[_At(0, STEPS - 1, _sigterm_self), callback])
    finally:
        callback._sigterm.uninstall()  # the exit path keeps it for the process's last moments
    assert exit_info.value.code == PREEMPTION_EXIT_CODE == 143
    # Stopped at the last batch of epoch 0: the backup points at the start of epoch 1.
    assert (_metadata(backup_dir)["epoch"], _metadata(backup_dir)["step"]) == (1, 0)
    assert "backup saved at epoch 1 (0-based), 0 batch(es) into it" in capsys.readouterr().out


# -- chief-only outputs, one process ----------------------------------------------------
def test_alone_everything_is_the_chief(tmp_path):
    assert chief_path(tmp_path / "model.keras") == str(tmp_path / "model.keras")
    assert verbose() == "auto" and verbose(2) == 2
    assert keras_dist.chief_path is chief_path and keras_dist.verbose is verbose
    callbacks = [ModelCheckpoint(str(tmp_path / "ckpt-{epoch}.weights.h5"),
                                 save_weights_only=True)]
    if HAS_TENSORBOARD:
        callbacks.append(TensorBoard(tmp_path / "logs"))
    _model().fit(_dataset(), epochs=1, verbose=0, callbacks=callbacks)
    assert os.path.exists(tmp_path / "ckpt-1.weights.h5")
    if HAS_TENSORBOARD:
        assert os.listdir(tmp_path / "logs" / "train")


# -- two workers ----------------------------------------------------------------------
def _two_worker_outputs(base):
    import glob

    import keras_dist

    strategy = keras_dist.strategy()
    import keras
    import numpy as np
    import tensorflow as tf

    from keras_dist.checkpointing import (BackupAndRestore, ModelCheckpoint, TensorBoard,
                                          chief_path, verbose)

    index = keras_dist.worker_index()
    prefix = os.path.join(tempfile.gettempdir(), f"keras_dist-worker{index}-")
    temp_before = set(glob.glob(prefix + "*"))
    x = np.random.RandomState(0).rand(64, 4).astype("float32")
    dataset = tf.data.Dataset.from_tensor_slices((x, x[:, :1])).batch(16)
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse")

    checkpoint = ModelCheckpoint(os.path.join(base, "ckpt", "e{epoch}.weights.h5"),
                                 save_weights_only=True)
    during = {}

    class Probe(keras.callbacks.Callback):
        """Where this worker's checkpoint of the epoch is: under `base`, in its temp dir."""

        def on_epoch_end(self, epoch, logs=None):
            name = f"e{epoch + 1}.weights.h5"
            private = glob.glob(os.path.join(prefix + "checkpoint-*", "**", name),
                                recursive=True)
            during[epoch] = (os.path.exists(os.path.join(base, "ckpt", name)), len(private))

    callbacks = [checkpoint, Probe(),
                 BackupAndRestore(os.path.join(base, "backup"), delete_checkpoint=False)]
    if HAS_TENSORBOARD:
        callbacks.append(TensorBoard(os.path.join(base, "tb")))
    model.fit(dataset, epochs=2, verbose=verbose(), callbacks=callbacks)
    final = chief_path(os.path.join(base, "final", "model.keras"))
    model.save(final)
    temp_after = set(glob.glob(prefix + "*")) - temp_before

    # A backup_dir that is not shared: worker 1 looks elsewhere and finds nothing.
    elsewhere = os.path.join(base, "backup" if index == 0 else f"not-shared-{index}")
    try:
        model.fit(dataset, epochs=3, verbose=0, callbacks=[BackupAndRestore(elsewhere)])
        mismatch = None
    except RuntimeError as error:
        mismatch = str(error)
    return {
        "verbose": [verbose(), verbose(1), verbose(0)],
        "final": final, "final_exists": os.path.exists(final),
        "during": during,
        "temp_left": sorted(os.path.basename(p) for p in temp_after),
        "mismatch": mismatch,
    }


@pytest.mark.multiworker
@pytest.mark.timeout(240)
def test_only_the_chief_keeps_files_and_shows_progress(tmp_path):
    base = str(tmp_path)
    chief, worker = run_on_workers(_two_worker_outputs, 2, args=(base,), timeout=200)
    assert chief["verbose"] == ["auto", 1, 0] and worker["verbose"] == [0, 0, 0]
    assert chief["final"] == os.path.join(base, "final", "model.keras")
    assert not worker["final"].startswith(base) and worker["final_exists"]
    # During training the chief's checkpoint is under `base` and worker 1's in its own
    # temporary directory (which is gone afterwards).
    assert chief["during"] == {0: (True, 0), 1: (True, 0)}
    assert [count for _, count in worker["during"].values()] == [1, 1]
    assert sorted(os.listdir(os.path.join(base, "ckpt"))) == ["e1.weights.h5", "e2.weights.h5"]
    if HAS_TENSORBOARD:
        assert len(os.listdir(os.path.join(base, "tb", "train"))) == 1  # one events file
    assert chief["temp_left"] == []
    assert [name.split("-")[2] for name in worker["temp_left"]] == ["outputs"]  # chief_path's
    assert _metadata(os.path.join(base, "backup"))["epoch"] == 2
    for result in (chief, worker):
        assert "do not see the same backup" in result["mismatch"]
        assert "worker 1: no backup" in result["mismatch"]
        assert "shared by all workers" in result["mismatch"]
