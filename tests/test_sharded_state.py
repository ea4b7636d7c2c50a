"""`keras_dist.checkpointing.save_state` / `restore_state` (issue 40): the sharded format.

One process with 4 virtual CPUs: an MLP trained with Adam on `ModelParallel` (2, 2) is
saved; its state is restored onto (1, 4), onto `FSDP`, and onto one device without a
distribution, each holding exactly the saved values (weights, slots, iterations); the
blocks written hold each value once (no replicated block twice); a state from another
model and a damaged block are refused, naming what is wrong. The format's block arithmetic
is checked on its own (no TensorFlow).
"""

from __future__ import annotations

import numpy as np
import pytest

from keras_dist.checkpointing import shards
from keras_dist.testing import run_in_subprocess


def test_blocks_are_owned_once_and_regions_read_back_across_layouts(tmp_path):
    # (4, 6) on a (2, 2) mesh: columns split on "model", replicated over "data".
    stored = shards.Placement((4, 6), ("data", "model"), (2, 2), (None, "model"))
    value = np.arange(24, dtype="float32").reshape(4, 6)
    # Devices 0, 1 hold columns 0-2 and 3-5; devices 2, 3 the same again: 2 owners.
    assert [stored.region(p) for p in range(4)] == [((0, 0), (4, 3)), ((0, 3), (4, 3))] * 2
    owned = [shards.owned_blocks(stored, positions) for positions in ([0, 1], [2, 3])]
    assert owned == [[(0, (0, 0)), (1, (0, 3))], []]
    blocks = [shards.Block("w", start, value[:, start[1]:start[1] + 3])
              for _, start in owned[0]]
    shards.write_fragment(str(tmp_path), 0, blocks)
    shards.write_fragment(str(tmp_path), 1, [])
    spec = {"w": {"shape": [4, 6], "dtype": "float32", "placement": stored.to_json()}}
    shards.merge_index(str(tmp_path), spec, 2, {"step": 7})
    reader = shards.StateReader(str(tmp_path))
    assert reader.index["step"] == 7
    np.testing.assert_array_equal(reader.read("w"), value)
    # Another layout: rows split in 4 (a (4,) mesh on dimension 0).
    target = shards.Placement((4, 6), ("batch",), (4,), ("batch",))
    for position in range(4):
        start, shape = target.region(position)
        np.testing.assert_array_equal(reader.read("w", start, shape),
                                      value[position:position + 1])


class _Died(Exception):
    """The training process "dies" here (raised from a callback)."""


def _dies_after(steps):
    """A callback raising `_Died` at the end of the `steps`-th batch of the fit it joins."""
    import keras

    class DiesAfter(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.batches = 0

        def on_train_batch_end(self, batch, logs=None):
            self.batches += 1
            if self.batches == steps:
                raise _Died()

    return DiesAfter()


def _scenarios(directory):
    import os

    import keras
    from keras import distribution as kd

    from keras_dist.checkpointing import BackupError, restore_state, save_state
    from keras_dist.distribution import FSDP

    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 16)).astype("float32")
    y = rng.normal(size=(32, 8)).astype("float32")
    devices = kd.list_devices("cpu")

    def build(units=64, optimizer_built=True):
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((16,)),
                                  keras.layers.Dense(units, activation="relu", name="up"),
                                  keras.layers.Dense(8, name="down")])
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
        if optimizer_built:
            model.optimizer.build(model.trainable_variables)
        return model

    def model_parallel(shape):
        mesh = kd.DeviceMesh(shape, ["data", "model"], devices)
        layouts = kd.LayoutMap(mesh)
        layouts["up/kernel"] = (None, "model")
        layouts["down/kernel"] = ("model", None)
        return kd.ModelParallel(layout_map=layouts, batch_dim_name="data")

    def values(model):
        from keras_dist.checkpointing.sharded_state import state_variables

        return {name: np.asarray(keras.ops.convert_to_numpy(variable))
                for name, variable in state_variables(model).items()}

    out = {}
    # A model with its own train_step and two optimizers (the keras-io GAN, fixed noise,
    # SGD with momentum): both optimizers' slots are in the backup.
    import custom_steps as corpus

    def gan(**kwargs):
        return corpus.train("gan_fixed_noise", epochs=2, evaluate=False, momentum=0.9,
                            **kwargs)["weights"]

    from keras_dist.callbacks import BackupAndRestore

    gan_dir = os.path.join(directory, "gan")
    backup = BackupAndRestore(gan_dir, save_freq=2)
    try:
        gan(strategy=FSDP(min_elements=64), callbacks=[_dies_after(3), backup])
    except _Died:
        backup._writing.wait()
    out["gan parts"] = sorted({name.split("/")[0] for name in shards.StateReader(
        os.path.join(gan_dir, "backup-000001.state")).variables})
    resumed = gan(strategy=FSDP(min_elements=64),
                  callbacks=[BackupAndRestore(gan_dir, save_freq=2)])
    out["gan"] = max(float(np.abs(a - b).max()) for a, b in zip(resumed, gan()))
    with model_parallel((2, 2)).scope():
        saved = build()
        saved.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    save_state(saved, os.path.join(directory, "state"))
    expected = values(saved)
    total = sum(value.nbytes for value in expected.values())
    written = sum(os.path.getsize(os.path.join(directory, "state", name))
                  for name in os.listdir(os.path.join(directory, "state"))
                  if name.endswith(".blocks"))
    out["written/state"] = written / total
    out["iterations"] = int(expected["optimizer/0"])

    def difference(model):
        got = values(model)
        assert got.keys() == expected.keys()
        return max(float(np.abs(got[name] - expected[name]).max()) for name in expected)

    # A snapshot is the state as of the call: training on before it is written (as the
    # background writer does) changes nothing in it.
    from keras_dist.checkpointing import sharded_state

    state = sharded_state.snapshot(saved)
    saved.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    sharded_state.write_snapshot(state, os.path.join(directory, "snapshot"))
    later = build()
    restore_state(later, os.path.join(directory, "snapshot"))
    out["snapshot"] = difference(later)
    out["moved since"] = max(float(np.abs(values(saved)[name] - expected[name]).max())
                             for name in expected)

    for name, distribution in (("(1, 4)", model_parallel((1, 4))),
                               ("fsdp", FSDP(min_elements=64))):
        with distribution.scope():
            model = build()
        restore_state(model, os.path.join(directory, "state"))
        out[name] = difference(model)
    one = build()
    restore_state(one, os.path.join(directory, "state"))
    out["one device"] = difference(one)
    with FSDP(min_elements=64).scope():  # compiled, optimizer not built yet: built here
        unbuilt = build(optimizer_built=False)
    restore_state(unbuilt, os.path.join(directory, "state"))
    out["fsdp, optimizer built by restore_state"] = difference(unbuilt)

    def error(call):
        try:
            call()
        except BackupError as raised:
            return str(raised)
        return None

    out["other model"] = error(lambda: restore_state(build(units=32),
                                                     os.path.join(directory, "state")))
    blocks = os.path.join(directory, "state", "process-00000.blocks")
    with open(blocks, "r+b") as file:
        file.seek(5)
        byte = file.read(1)
        file.seek(5)
        file.write(bytes([byte[0] ^ 0xFF]))
    out["damaged"] = error(lambda: restore_state(build(), os.path.join(directory, "state")))

    # BackupAndRestore under a distribution: a backup every 3 steps, written in the
    # background; the run dies after step 6 (1 step into epoch 1 of 4-step epochs,
    # its backup complete) and resumes on another mesh or on one device.
    from keras_dist.callbacks import BackupAndRestore

    reference = build()
    reference.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)

    for name, before, after in (("(2, 2) -> one device", model_parallel((2, 2)), None),
                                ("fsdp -> (1, 4)", FSDP(min_elements=64),
                                 model_parallel((1, 4)))):
        backup_dir = os.path.join(directory, name.replace(" ", "_"))
        with before.scope():
            first = build()
        backup = BackupAndRestore(backup_dir, save_freq=3)
        with pytest.raises(_Died):  # the write of the step-6 backup is still going
            first.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0,
                      callbacks=[backup, _dies_after(6)])
        if after is None:
            backup.wait_until_finished()
            second = build()
        else:  # no wait: the next fit's BackupAndRestore joins the write itself
            with after.scope():
                second = build()
        files_seen = keras.callbacks.LambdaCallback(on_train_begin=lambda logs: out.update(
            {f"{name} files": sorted(os.listdir(backup_dir))}))
        second.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0,
                   callbacks=[BackupAndRestore(backup_dir, save_freq=3), files_seen])
        out[name] = max(float(np.abs(np.asarray(a) - np.asarray(b)).max())
                        for a, b in zip(second.get_weights(), reference.get_weights()))
        out[f"{name} left"] = os.path.exists(backup_dir)

    return out


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory):
    return run_in_subprocess(_scenarios, args=(str(tmp_path_factory.mktemp("state")),),
                             virtual_devices=4, timeout=300)


@pytest.mark.multiworker
@pytest.mark.parametrize("target", ["(1, 4)", "fsdp", "one device",
                                    "fsdp, optimizer built by restore_state"])
def test_a_model_parallel_state_restores_exactly_onto(scenarios, target):
    assert scenarios["iterations"] == 4
    assert scenarios[target] == 0.0


@pytest.mark.multiworker
def test_a_snapshot_is_the_state_when_it_was_taken(scenarios):
    assert scenarios["moved since"] > 1e-3  # training went on before the write
    assert scenarios["snapshot"] == 0.0


@pytest.mark.multiworker
@pytest.mark.parametrize("case", ["(2, 2) -> one device", "fsdp -> (1, 4)"])
def test_backup_and_restore_resumes_mid_epoch_on_another_mesh_exactly(scenarios, case):
    # The run died with a sharded backup of step 6 on disk (blocks and index).
    assert scenarios[f"{case} files"] == ["backup-000002.state", "backup.json"]
    assert scenarios[case] < 1e-5
    assert not scenarios[f"{case} left"]  # deleted after the successful run


@pytest.mark.multiworker
def test_a_model_with_its_own_step_resumes_with_every_optimizers_state(scenarios):
    assert scenarios["gan parts"] == ["d_optimizer", "g_optimizer", "model"]
    assert scenarios["gan"] < 1e-5


@pytest.mark.multiworker
def test_each_value_is_written_once_and_bad_states_are_named(scenarios):
    assert scenarios["written/state"] == pytest.approx(1.0)
    assert "is not this model's" in scenarios["other model"]
    assert "up/kernel is (16, 32) here, (16, 64) (sequential/up/kernel) in the state" in (
        scenarios["other model"])
    assert "does not match its checksum (crc32)" in scenarios["damaged"]
    assert "process-00000.blocks" in scenarios["damaged"]


# ---------------------------------------------------------------------------------------
# 2 launched workers x 2 CPUs with FSDP -> one process, ModelParallel (2, 2)

_STEPS_PER_EPOCH = 8  # 64 rows, global batch 8


def _mlp_and_data():
    """The MLP (Adam) and its input: a tf.data.Dataset of global batches of 8."""
    import keras
    import tensorflow as tf

    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 16)).astype("float32")
    y = rng.normal(size=(64, 8)).astype("float32")
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((16,)),
                              keras.layers.Dense(64, activation="relu", name="up"),
                              keras.layers.Dense(8, name="down")])
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    return model, tf.data.Dataset.from_tensor_slices((x, y)).batch(8, drop_remainder=True)


def _fsdp_workers_die_after_step_6(backup_dir):
    """One launched worker: FSDP over 2 x 2 CPUs, a backup every 4 steps; dies at step 6."""
    import os

    from keras import distribution as kd

    import keras_dist
    from keras_dist.callbacks import BackupAndRestore
    from keras_dist.checkpointing.sharded_state import state_variables

    kd.initialize()  # the job from TF_CONFIG, as keras-dist launch sets it
    kd.set_distribution(keras_dist.distribution.FSDP(min_elements=64))
    model, data = _mlp_and_data()
    backup = BackupAndRestore(backup_dir, save_freq=4)
    try:
        model.fit(data, epochs=2, verbose=0, callbacks=[backup, _dies_after(6)])
    except _Died:
        backup._writing.wait()  # the process dies with its last backup on disk
    state = os.path.join(backup_dir, "backup-000001.state")
    written = sorted(name for name in os.listdir(state) if name.endswith(".blocks"))
    return {"files": sorted(os.listdir(backup_dir)),
            "state bytes": sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize
                               for v in state_variables(model).values()),
            "written": {name: os.path.getsize(os.path.join(state, name))
                        for name in written}}


def _resume_on_one_process(backup_dir):
    import io
    from contextlib import redirect_stdout

    from keras import distribution as kd

    from keras_dist.callbacks import BackupAndRestore

    reference, data = _mlp_and_data()
    reference.fit(data, epochs=2, verbose=0)
    mesh = kd.DeviceMesh((2, 2), ["batch", "model"], kd.list_devices("cpu"))
    layouts = kd.LayoutMap(mesh)
    layouts["up/kernel"] = (None, "model")
    layouts["down/kernel"] = ("model", None)
    kd.set_distribution(kd.ModelParallel(layout_map=layouts, batch_dim_name="batch"))
    model, data = _mlp_and_data()
    printed = io.StringIO()
    with redirect_stdout(printed):
        model.fit(data, epochs=2, verbose=0, callbacks=[BackupAndRestore(backup_dir,
                                                                         save_freq=4)])
    return {"printed": printed.getvalue(), "iterations": int(model.optimizer.iterations),
            "difference": max(float(np.abs(np.asarray(a) - np.asarray(b)).max())
                              for a, b in zip(model.get_weights(), reference.get_weights()))}


@pytest.mark.multiworker
@pytest.mark.slow
def test_two_fsdp_workers_write_the_state_once_and_one_process_resumes_exactly(tmp_path):
    from keras_dist.testing import run_on_workers

    backup_dir = str(tmp_path / "backup")
    workers = run_on_workers(_fsdp_workers_die_after_step_6, 2, args=(backup_dir,),
                             virtual_devices=2, timeout=300)
    # Both died after step 6 with the backup of step 4 complete: each wrote its blocks.
    assert workers[0]["files"] == ["backup-000001.state", "backup.json"]
    written = workers[0]["written"]
    print(f"state {workers[0]['state bytes']} bytes; written per process {written}")
    assert sorted(written) == ["process-00000.blocks", "process-00001.blocks"]
    assert sum(written.values()) == workers[0]["state bytes"]  # each value once (<= 1.3)
    assert min(written.values()) > 0.3 * workers[0]["state bytes"]  # each holds its part
    resumed = run_in_subprocess(_resume_on_one_process, args=(backup_dir,),
                                virtual_devices=4, timeout=300)
    assert "BackupAndRestore: resuming at epoch 0 (0-based), 4 batch(es) into it" in (
        resumed["printed"])
    assert "split between the processes by keras.distribution" in resumed["printed"]
    assert resumed["iterations"] == 2 * _STEPS_PER_EPOCH
    assert resumed["difference"] < 1e-5


# ---------------------------------------------------------------------------------------
# Chaos: the process is killed while its background writer is half-way through a backup


def _fsdp_fit_with_backups(backup_dir, die_in_backup=None):
    """FSDP on 4 CPUs, a backup every 2 steps, 2 epochs of 8 steps. With `die_in_backup`
    the process is killed (`os._exit`: no cleanup, as SIGKILL) once the background
    writer has written 2 blocks of that backup; otherwise it trains to the end and
    returns its weights and the one-device reference's."""
    import os

    from keras import distribution as kd

    import keras_dist
    from keras_dist.callbacks import BackupAndRestore
    from keras_dist.checkpointing import shards

    if die_in_backup is not None:
        write_fragment = shards.write_fragment

        def dying(directory, process, blocks):
            def two_then_killed(given):
                for index, block in enumerate(given):
                    if index == 2:
                        os._exit(137)
                    yield block

            if directory.endswith(f"backup-{die_in_backup:06d}.state"):
                return write_fragment(directory, process, two_then_killed(blocks))
            return write_fragment(directory, process, blocks)

        shards.write_fragment = dying
    reference = None
    if die_in_backup is None:
        reference, data = _mlp_and_data()
        reference.fit(data, epochs=2, verbose=0)
    kd.set_distribution(keras_dist.distribution.FSDP(min_elements=64))
    model, data = _mlp_and_data()
    model.fit(data, epochs=2, verbose=0,
              callbacks=[BackupAndRestore(backup_dir, save_freq=2, delete_checkpoint=False)])
    return {"files": sorted(os.listdir(backup_dir)),
            "difference": max(float(np.abs(np.asarray(a) - np.asarray(b)).max())
                              for a, b in zip(model.get_weights(), reference.get_weights()))}


@pytest.mark.multiworker
@pytest.mark.slow
def test_a_kill_during_a_background_write_leaves_the_previous_backup_and_resumes_exactly(
        tmp_path):
    import os

    from keras_dist.checkpointing import files
    from keras_dist.testing import WorkerError

    backup_dir = str(tmp_path / "backup")
    with pytest.raises(WorkerError):  # killed in the write of backup 3 (step 6)
        run_in_subprocess(_fsdp_fit_with_backups, args=(backup_dir, 3), virtual_devices=4,
                          timeout=300)
    backup = files.read_backup(backup_dir)  # verifies the index's checksum
    assert (backup.seq, backup.epoch, backup.step) == (2, 0, 4)
    unfinished = os.path.join(backup_dir, files.state_name(3))
    assert os.path.isdir(unfinished) and "index.json" not in os.listdir(unfinished)
    resumed = run_in_subprocess(_fsdp_fit_with_backups, args=(backup_dir,),
                                virtual_devices=4, timeout=300)
    assert resumed["difference"] < 1e-5
    # The unfinished write is gone once a newer backup is complete.
    # (Resumed at step 4: backups 4 to 9 at steps 6, 8, ..., 16.)
    assert resumed["files"] == ["backup-000009.state", "backup.json"]
