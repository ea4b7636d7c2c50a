"""Stock Keras/TensorFlow writers called by every worker with one path (issue 10).

One call on the session's 2 shared workers (tests/conftest.py's `worker_pool`) exercises
every writer, another saves one path again and again; the workers return what they saw
and the assertions run in the test process.
"""

import os

import pytest


WRITERS_TIMEOUT = 240


def _sha256(path):
    import hashlib

    with open(path, "rb") as file:
        return hashlib.sha256(file.read()).hexdigest()


def _tree(root):
    found = []
    for directory, dirs, files in os.walk(root):
        for name in dirs + files:
            found.append(os.path.relpath(os.path.join(directory, name), root))
    return sorted(found)


def _same_files(directory, other):
    names = sorted(os.listdir(directory))
    return names == sorted(os.listdir(other)) and all(
        _sha256(os.path.join(directory, n)) == _sha256(os.path.join(other, n)) for n in names)


def _watch_for_partial_zip(path, stop, seen_bad):
    import zipfile

    while not stop.is_set():
        if os.path.exists(path):
            try:
                with zipfile.ZipFile(path) as archive:
                    if archive.testzip() is not None:
                        seen_bad.append("bad member")
            except (zipfile.BadZipFile, OSError) as error:
                seen_bad.append(repr(error))


def _every_writer(root, temp):
    import shutil
    import sys
    import tempfile
    import threading

    import keras
    import numpy as np
    import tensorflow as tf

    import keras_dist
    from keras_dist.checkpointing import stock_writers as _writers
    from keras_dist.compat import _patch

    os.environ["TMPDIR"] = temp  # this call's own (the pool restores it afterwards)
    tempfile.tempdir = None
    strategy = keras_dist.strategy()
    index = keras_dist.worker_index()
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(256),
                                  keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
    x = np.linspace(0, 1, 64, dtype="float32").reshape(16, 4)
    y = x.sum(axis=1, keepdims=True)
    model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[
        keras.callbacks.ModelCheckpoint(f"{root}/ckpt/w-{{epoch}}.weights.h5",
                                        save_weights_only=True),
        keras.callbacks.ModelCheckpoint(f"{root}/ckpt/m-{{epoch}}.keras"),
        keras.callbacks.BackupAndRestore(f"{root}/backup", delete_checkpoint=False),
        keras.callbacks.TensorBoard(f"{root}/tb"),
        keras.callbacks.CSVLogger(f"{root}/log.csv"),
        # keras_dist's own chief-only callbacks: not redirected a second time.
        keras_dist.callbacks.ModelCheckpoint(f"{root}/kd/w-{{epoch}}.weights.h5",
                                             save_weights_only=True),
        keras_dist.callbacks.BackupAndRestore(f"{root}/kd_backup", delete_checkpoint=False),
        keras_dist.callbacks.TensorBoard(f"{root}/kd_tb"),
    ])
    expected = model.get_weights()

    def same(weights):
        return all(np.array_equal(a, b) for a, b in zip(weights, expected))

    out = {"index": index}
    # model.save (.keras), while the chief watches its own path for a partial zip.
    stop, seen_bad = threading.Event(), []
    watcher = threading.Thread(target=_watch_for_partial_zip,
                               args=(f"{root}/final.keras", stop, seen_bad))
    watcher.start()
    model.save(f"{root}/final.keras")
    stop.set()
    watcher.join()
    out["partial_zip_seen"] = seen_bad
    out["keras_loads"] = same(keras.models.load_model(f"{root}/final.keras").get_weights())
    # model.save_weights, twice (the second overwrites), against one upstream write.
    model.save_weights(f"{root}/final.weights.h5")
    model.save_weights(f"{root}/final.weights.h5")
    clone = keras.models.clone_model(model)
    clone.load_weights(f"{root}/final.weights.h5")
    out["weights_load"] = same(clone.get_weights())
    reference = os.path.join(os.environ["TMPDIR"], f"reference-{index}.weights.h5")
    _patch.original(keras.Model, "save_weights")(model, reference)
    out["weights_equal_single_writer"] = _sha256(reference) == _sha256(
        f"{root}/final.weights.h5")
    os.remove(reference)
    # tf.train.Checkpoint: save (numbered, "checkpoint" state file) and write.
    checkpoint = tf.train.Checkpoint(model=model)
    saved = [checkpoint.save(f"{root}/tf_ckpt/ckpt") for _ in range(2)]
    out["checkpoint_paths"] = [os.path.relpath(p, root) for p in saved]
    out["latest_checkpoint"] = os.path.relpath(tf.train.latest_checkpoint(f"{root}/tf_ckpt"),
                                               root)
    restored = keras.models.clone_model(model)
    tf.train.Checkpoint(model=restored).restore(saved[-1]).expect_partial()
    out["checkpoint_restores"] = same(restored.get_weights())
    written = checkpoint.write(f"{root}/tf_write/state")
    tf.train.Checkpoint(model=restored).read(written).expect_partial()
    out["checkpoint_write_reads"] = same(restored.get_weights())
    single = os.path.join(os.environ["TMPDIR"], f"single-{index}")
    _patch.original(type(checkpoint), "_write")(checkpoint, f"{single}/state")
    out["checkpoint_equal_single_writer"] = _same_files(f"{root}/tf_write", single)
    # tf.saved_model.save (twice: the directory is replaced) and model.export.
    module = tf.Module()
    module.value = tf.Variable([1.0, 2.0, 3.0])
    for _ in range(2):
        tf.saved_model.save(module, f"{root}/saved_model")
    _patch.original(tf.saved_model, "save")(module, f"{single}/saved_model")
    out["saved_model_files_equal"] = {
        name: _sha256(f"{root}/saved_model/{name}")
        == _sha256(f"{single}/saved_model/{name}")
        for name in ("saved_model.pb", "variables/variables.index",
                     "variables/variables.data-00000-of-00001")}
    shutil.rmtree(single)
    loaded_module = tf.saved_model.load(f"{root}/saved_model")
    out["saved_model_value"] = loaded_module.value.numpy().tolist()
    model.export(f"{root}/export", verbose=False)
    exported = tf.saved_model.load(f"{root}/export")  # kept: serve() needs its variables
    served = exported.serve(x).numpy()
    out["export_matches"] = bool(np.allclose(served, model.predict(x, verbose=0), atol=1e-6))
    # The save_and_load tutorial's bug: model.export loads a fresh `tf.saved_model`
    # module (Keras imports tensorflow.saved_model.experimental); the stock writers must
    # stay patched after it, else both workers write the next SavedModel into one
    # directory and a load mixes the two saves' files.
    out["saved_model_patched_after_export"] = [
        getattr(function, "_keras_dist_fix", None) for function in (
            tf.saved_model.save, tf.saved_model.load,
            sys.modules["tensorflow.saved_model"].save)]
    tf.saved_model.save(module, f"{root}/export")  # replaces the export just loaded
    out["saved_model_over_export"] = tf.saved_model.load(
        f"{root}/export").value.numpy().tolist()
    # Ray's documented pattern: every worker saves into its own mkdtemp(). Paired with
    # the chief's save of the same file name: no wait for a path the chief never saves;
    # the other workers' files are temporaries, removed (the chief's file is the one).
    own = tempfile.mkdtemp(dir=f"{root}/per_worker")
    model.save(os.path.join(own, "model.keras"))
    model.save_weights(os.path.join(own, "model.weights.h5"))
    out["own_dir"] = (own, sorted(os.listdir(own)))
    if index == 0:
        out["own_keras_loads"] = same(
            keras.models.load_model(os.path.join(own, "model.keras")).get_weights())
    # A save the chief never makes: a clear error after the timeout, not an hour's wait.
    if index == 1:
        os.environ[_writers.ENV_TIMEOUT] = "2"
        try:
            model.save_weights(f"{root}/only_worker1.weights.h5")
            out["unpaired_error"] = None
        except _writers.StockWriterError as error:
            out["unpaired_error"] = str(error)
        finally:
            del os.environ[_writers.ENV_TIMEOUT]
    keras_dist.barrier("writers-done")
    out["tree"] = _tree(root) if index == 0 else None
    out["csv_lines"] = open(f"{root}/log.csv").read().splitlines() if index == 0 else None
    out["private_left"] = sorted(
        name for name in os.listdir(os.environ["TMPDIR"]) if name.startswith("keras_dist-"))
    return out


@pytest.mark.multiworker
def test_every_stock_writer_on_one_path(tmp_path, worker_pool):
    root, temp = tmp_path / "shared", tmp_path / "tmp"
    root.mkdir()
    temp.mkdir()
    (root / "per_worker").mkdir()
    results = worker_pool.run(_every_writer, args=(str(root), str(temp)),
                              timeout=WRITERS_TIMEOUT)
    for out in results:
        assert out["partial_zip_seen"] == [], out
        assert out["keras_loads"] and out["weights_load"], out
        assert out["weights_equal_single_writer"], out
        assert out["checkpoint_paths"] == ["tf_ckpt/ckpt-1", "tf_ckpt/ckpt-2"], out
        assert out["latest_checkpoint"] == "tf_ckpt/ckpt-2", out
        assert out["checkpoint_restores"] and out["checkpoint_write_reads"], out
        assert out["checkpoint_equal_single_writer"], out
        # saved_model.pb differs between two saves by one writer too (TF's function
        # names); the variables are byte-for-byte a single writer's.
        assert out["saved_model_files_equal"] == {
            "saved_model.pb": False, "variables/variables.index": True,
            "variables/variables.data-00000-of-00001": True}, out
        assert out["saved_model_value"] == [1.0, 2.0, 3.0], out
        assert out["export_matches"], out
        assert out["saved_model_patched_after_export"] == [
            "stock_writers_multi_worker"] * 3, out
        assert out["saved_model_over_export"] == [1.0, 2.0, 3.0], out
        assert out["private_left"] == [], out  # other workers' temporaries are gone
    own_dirs = [out["own_dir"] for out in results]
    assert own_dirs[0][0] != own_dirs[1][0], own_dirs
    assert own_dirs[0][1] == ["model.keras", "model.weights.h5"], own_dirs
    assert own_dirs[1][1] == [], own_dirs  # worker 1's own save: a removed temporary
    assert results[0]["own_keras_loads"], results[0]
    error = results[1]["unpaired_error"]
    assert error is not None and "only_worker1.weights.h5" in error, error
    assert "KERAS_DIST_STOCK_WRITERS_TIMEOUT" in error and "within 2 s" in error, error
    tree = results[0]["tree"]
    assert not [p for p in tree if ".tmp-keras-dist-" in p], tree  # no half-written files
    for expected in ("ckpt/w-1.weights.h5", "ckpt/w-2.weights.h5", "ckpt/m-1.keras",
                     "ckpt/m-2.keras", "backup/latest.weights.h5",
                     "backup/training_metadata.json", "final.keras", "final.weights.h5",
                     "tf_ckpt/checkpoint", "tf_write/state.index",
                     "saved_model/saved_model.pb", "export/saved_model.pb",
                     "kd/w-1.weights.h5", "kd/w-2.weights.h5", "kd_backup/backup.json"):
        assert expected in tree, (expected, tree)
    for log_dir in ("tb", "kd_tb"):  # one run in TensorBoard: the chief's
        events = [p for p in tree if p.startswith(f"{log_dir}/train/events.out")]
        assert len(events) == 1, tree
    assert len(results[0]["csv_lines"]) == 3, results[0]["csv_lines"]  # header + 2 epochs


def _single_process_unchanged(path):
    import keras

    import keras_dist

    keras_dist.strategy()
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.save_weights(path)
    return sorted(os.listdir(os.path.dirname(path)))


@pytest.mark.multiworker
@pytest.mark.slow
def test_one_process_writes_in_place(tmp_path):
    from keras_dist.testing import run_in_subprocess

    path = str(tmp_path / "model.weights.h5")
    assert run_in_subprocess(_single_process_unchanged, args=(path,),
                             timeout=120) == ["model.weights.h5"]


@pytest.mark.parametrize("switch", ["0"])
def test_opt_out_switch_is_read(monkeypatch, switch):
    from keras_dist.checkpointing import stock_writers as _writers

    monkeypatch.setenv(_writers.ENV_SWITCH, switch)
    assert not _writers.active()


# -- the same path saved again and again, loaded back at once on every worker ---------
STRESS_FORMATS = ("tf.saved_model.save(model)", "model.export", "tf.saved_model.save(module)",
                  "model.save(.keras)")


def _saved_values(loaded):
    """Every value of every variable a loaded SavedModel holds."""
    import numpy as np
    import tensorflow as tf

    return sorted({float(v) for trackable in tf.train.TrackableView(loaded).descendants()
                   if isinstance(trackable, tf.Variable)
                   for v in np.ravel(trackable.numpy())})


def _save_and_load_repeatedly(root, saves):
    """Save number i writes value i+1 everywhere; each worker loads it back at once."""
    import keras
    import numpy as np
    import tensorflow as tf

    import keras_dist
    from keras_dist.checkpointing import stock_writers

    keras_dist.strategy()
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dense(1)])
    module = tf.Module()
    module.value = tf.Variable(np.zeros(3, "float32"))
    directory, keras_file = f"{root}/model", f"{root}/model.keras"
    outcomes = []
    for number in range(saves):
        value, kind = float(number + 1), STRESS_FORMATS[number % len(STRESS_FORMATS)]
        model.set_weights([np.full(w.shape, value, w.dtype) for w in model.get_weights()])
        module.value.assign(np.full(3, value, "float32"))
        try:
            if kind == "model.save(.keras)":
                model.save(keras_file)
                got = sorted({float(v) for w in keras.models.load_model(keras_file)
                              .get_weights() for v in np.ravel(w)})
            else:
                if kind == "model.export":
                    model.export(directory, verbose=False)
                else:
                    tf.saved_model.save(module if "module" in kind else model, directory)
                got = _saved_values(tf.saved_model.load(directory))
            outcomes.append(("ok" if got == [value] else f"other save's values {got}", kind))
        except Exception as error:  # a mixed or partial load; counted, not raised
            outcomes.append((f"load failed: {type(error).__name__}: {error}"[:300], kind))
    # Saves of one name made on the chief only: no wait for the others after the first
    # pairing (the chief finds out once, within the grace period capped by the timeout).
    if keras_dist.is_chief():
        os.environ[stock_writers.ENV_TIMEOUT] = "3"
        for _ in range(3):
            model.save_weights(f"{root}/chief_only.weights.h5")
        del os.environ[stock_writers.ENV_TIMEOUT]
    keras_dist.barrier("stress-done")
    return {"outcomes": outcomes,
            "left": sorted(p for p in os.listdir(root) if p.startswith(".tmp-keras-dist-"))}


@pytest.mark.multiworker
@pytest.mark.slow  # a stress test (~60 CPU-s on 2 cores): the fast lane keeps one save per
# writer (test_every_stock_writer_on_one_path)
def test_repeated_saves_of_one_path_load_back_what_each_save_wrote(tmp_path, worker_pool):
    saves = 12
    results = worker_pool.run(_save_and_load_repeatedly, args=(str(tmp_path), saves),
                              timeout=WRITERS_TIMEOUT)
    for worker, result in enumerate(results):
        bad = [(number, outcome) for number, outcome in enumerate(result["outcomes"])
               if outcome[0] != "ok"]
        assert len(result["outcomes"]) == saves and bad == [], (worker, bad)
        assert result["left"] == [], result
    assert sorted(os.listdir(tmp_path)) == ["chief_only.weights.h5", "model", "model.keras"]
