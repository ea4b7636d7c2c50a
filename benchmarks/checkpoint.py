"""checkpoint: backups of a sharded model -- the sharded format vs the whole-value file.

An MLP whose kernels and Adam slots make at least 50 MB of state (quick: 1024 -> 2048 ->
2048 -> 1024 -> 10, 8.4M params, 101 MB with Adam's two moments) trained with
`keras_dist.distribution.FSDP` on 4 devices (virtual CPUs here), a backup every 4 steps:

* `whole`: what `BackupAndRestore` did under a distribution before the sharded format:
  `model.save_weights` of the whole state (every sharded variable gathered) in the step,
  by every process (the chief into the backup, the others into a private directory);
* `sharded`: `BackupAndRestore` today: a snapshot of the blocks this process owns in the
  step (`checkpointing/sharded_state.snapshot`), written by a background thread.

Two settings, the same mesh of 4 devices: one process with 4 virtual CPUs, and 2 launched
workers x 2 virtual CPUs (the input a `tf.data.Dataset` of global batches); and a third,
`keras_dist.strategy()` (MirroredStrategy) on 4 virtual CPUs in one process, which asks
whether the same machinery would make `BackupAndRestore` faster there too: `whole` is its
`.weights.h5` file written in the step, `sharded` the snapshot and background writer
(every value is whole on each replica there: the chief writes each once). Per variant,
fresh processes: the steady-state step without a save and with one (the chief's wall time
from one batch's start to the next's), bytes written per backup by all processes, the
largest peak memory rise of a process while saving, and the time to restore the backup
into a fresh model on the same mesh.

    save_step_ratio = step with a save / step without (sharded; the goal is <= 1.5)
    blocking_ratio = sharded step-with-save overhead / whole's
    bytes_ratio = bytes written by sharded / by whole (all processes)
    written_per_state = bytes written by sharded (all processes) / the state (goal <= 1.3)
    restore_ratio = sharded restore time / whole's
"""

from __future__ import annotations

from benchmarks import common

NAME = "checkpoint"
VARIANTS = ("whole", "sharded")
DEVICES = 4
WORKERS = 2  # the second setting: 2 launched workers x 2 virtual CPUs, the same mesh
SAVE_EVERY = 4


def settings(mode: str) -> dict:
    return dict(
        features=common.pick(mode, smoke=16, quick=1024, full=1024),
        hidden=common.pick(mode, smoke=[64, 64], quick=[2048, 2048, 1024],
                           full=[2048, 2048, 1024]),
        batch=common.pick(mode, smoke=16, quick=64, full=64),
        saves=common.pick(mode, smoke=2, quick=6, full=16),
    )


def measure(config: dict, variant: str, directory: str, workers: int = 1,
            engine: str = "fsdp") -> dict:
    """One variant in this process (on `workers` launched processes: this one's part);
    `engine` "fsdp" (keras.distribution) or "strategy" (`keras_dist.strategy()`)."""
    import contextlib
    import dataclasses

    import os
    import shutil
    import tempfile
    import time

    import keras
    import numpy as np
    import tensorflow as tf
    from keras import distribution as kd

    import keras_dist
    from keras_dist.checkpointing import restore_state, sharded_state
    from keras_dist.checkpointing.background import BackgroundWrite
    from keras_dist.distribution import backend

    if workers > 1:
        kd.initialize()  # the job from TF_CONFIG
    process = backend.process_id() if engine == "fsdp" else 0
    if engine == "fsdp":
        kd.set_distribution(keras_dist.distribution.FSDP(min_elements=1024))
        scope = contextlib.nullcontext
    else:
        scope = keras_dist.strategy().scope
    steps = SAVE_EVERY * (config["saves"] + 1)
    x, y = common.synthetic_classification(config["batch"] * steps, config["features"])
    # Global batches (keras.distribution splits each between the processes).
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(config["batch"],
                                                             drop_remainder=True)

    def build():
        with scope():
            return _build()

    def _build():
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [keras.Input((config["features"],))]
            + [keras.layers.Dense(units, activation="relu") for units in config["hidden"]]
            + [keras.layers.Dense(10)])
        model.compile(optimizer=keras.optimizers.Adam(1e-3),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.optimizer.build(model.trainable_variables)
        return model

    model = build()
    state_bytes = sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize
                      for v in sharded_state.state_variables(model).values())
    backup_dir = os.path.join(directory, f"{variant}-{workers}")
    # The whole-value path as BackupAndRestore had it: the chief writes the backup, the
    # others the same whole file into a private directory (gathering every variable).
    whole_dir = backup_dir if process == 0 else tempfile.mkdtemp(dir=directory)
    starts: list[float] = []
    saving: list[bool] = []

    class Clock(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            starts.append(time.perf_counter())
            saving.append((batch + 1) % SAVE_EVERY == 0)

    class WholeEvery(keras.callbacks.Callback):  # the whole-value path, in the step
        def on_train_batch_end(self, batch, logs=None):
            if (batch + 1) % SAVE_EVERY == 0:
                os.makedirs(whole_dir, exist_ok=True)
                self.model.save_weights(os.path.join(whole_dir, "backup.weights.h5"))

    class AsyncEvery(keras.callbacks.Callback):  # the sharded machinery, under a strategy
        def __init__(self):
            super().__init__()
            self.writer, self.saves = BackgroundWrite(), 0

        def on_train_batch_end(self, batch, logs=None):
            if (batch + 1) % SAVE_EVERY == 0:
                state = dataclasses.replace(sharded_state.snapshot(self.model), process=0,
                                            num_processes=1)
                self.saves += 1
                target = os.path.join(backup_dir, f"backup-{self.saves:06d}.state")
                self.writer.submit(target, lambda: sharded_state.write_snapshot(state, target))

        def on_train_end(self, logs=None):
            self.writer.wait()

    if variant == "whole":
        saver = WholeEvery()
    elif engine == "strategy":
        saver = AsyncEvery()
    else:
        saver = keras_dist.callbacks.BackupAndRestore(backup_dir, save_freq=SAVE_EVERY,
                                                      delete_checkpoint=False)
    with common.RssSampler() as memory:
        model.fit(data, epochs=1, verbose=0, callbacks=[Clock(), saver])
    steps_s = np.diff(starts)
    with_save = [s for s, saved in zip(steps_s[SAVE_EVERY:], saving[SAVE_EVERY:-1]) if saved]
    without = [s for s, saved in zip(steps_s[SAVE_EVERY:], saving[SAVE_EVERY:-1]) if not saved]
    fresh = build()
    started = time.perf_counter()
    if variant == "whole":
        written = os.path.getsize(os.path.join(whole_dir, "backup.weights.h5"))
        fresh.load_weights(os.path.join(backup_dir, "backup.weights.h5"))
    else:
        state = os.path.join(backup_dir, next(name for name in os.listdir(backup_dir)
                                              if name.endswith(".state")))
        written = os.path.getsize(os.path.join(state, f"process-{process:05d}.blocks"))
        restore_state(fresh, state)
    restore_s = time.perf_counter() - started
    if workers > 1:
        keras_dist.barrier("checkpoint_benchmark")  # all restored before the chief cleans up
    if process == 0:
        shutil.rmtree(backup_dir, ignore_errors=True)
    if whole_dir != backup_dir:
        shutil.rmtree(whole_dir, ignore_errors=True)
    if engine == "fsdp":
        kd.set_distribution(None)
    return {"variant": variant, "state_bytes": state_bytes, "bytes_written": written,
            "step_s": common.median(without), "save_step_s": common.median(with_save),
            "save_peak_mb": (memory.peak - memory.start) / (1 << 20),
            "restore_s": restore_s}


def _variant(config: dict, variant: str, directory: str, workers: int,
             engine: str = "fsdp") -> dict:
    """A variant's figures: the chief's steps, the bytes of every process together, the
    largest memory rise and restore time of a process."""
    kwargs = {"config": config, "variant": variant, "directory": directory,
              "workers": workers, "engine": engine}
    if workers == 1:
        return common.run_isolated(measure, kwargs=kwargs, virtual_devices=DEVICES)
    parts = common.run_workers(measure, workers, kwargs=kwargs,
                               virtual_devices=DEVICES // workers)
    return dict(parts[0], bytes_written=sum(p["bytes_written"] for p in parts),
                save_peak_mb=max(p["save_peak_mb"] for p in parts),
                restore_s=max(p["restore_s"] for p in parts))


def _ratios(whole: dict, sharded: dict) -> dict:
    return {
        "save_step_ratio": common.ratio(sharded["save_step_s"], sharded["step_s"]),
        "whole_save_step_ratio": common.ratio(whole["save_step_s"], whole["step_s"]),
        "blocking_ratio": common.ratio(max(sharded["save_step_s"] - sharded["step_s"], 0.0),
                                       max(whole["save_step_s"] - whole["step_s"], 1e-9)),
        "bytes_ratio": common.ratio(sharded["bytes_written"], whole["bytes_written"]),
        "written_per_state": common.ratio(sharded["bytes_written"], sharded["state_bytes"]),
        "restore_ratio": common.ratio(sharded["restore_s"], whole["restore_s"]),
    }


def run(mode: str) -> dict:
    import tempfile

    config = settings(mode)
    directory = tempfile.mkdtemp(prefix="keras_dist_bench_checkpoint_")
    out = {"config": config}
    for workers in (1, WORKERS):
        results = {name: _variant(config, name, directory, workers) for name in VARIANTS}
        ratios = _ratios(results["whole"], results["sharded"])
        if workers == 1:
            out.update(ratios, variants=results,
                       state_mb=results["sharded"]["state_bytes"] / (1 << 20))
        else:
            out["workers"] = dict(ratios, variants=results)
    results = {name: _variant(config, name, directory, 1, "strategy") for name in VARIANTS}
    out["strategy"] = dict(_ratios(results["whole"], results["sharded"]), variants=results)
    return out


def report(result: dict) -> None:
    config = result["config"]
    settings_ = [(f"{DEVICES} CPUs, 1 process", result)]
    if "workers" in result:
        settings_.append((f"{WORKERS} workers x {DEVICES // WORKERS} CPUs", result["workers"]))
    if "strategy" in result:
        settings_.append((f"keras_dist.strategy(), {DEVICES} CPUs", result["strategy"]))
    rows = [(where, name, common.format_bytes(v["state_bytes"]),
             common.format_bytes(v["bytes_written"]), v["step_s"] * 1000,
             v["save_step_s"] * 1000, v["save_peak_mb"], v["restore_s"] * 1000)
            for where, figures in settings_ for name, v in figures["variants"].items()]
    common.print_table(
        f"checkpoint: MLP {config['features']}->{config['hidden']}->10, Adam, FSDP (or a "
        f"strategy) on {DEVICES} devices, a backup every {SAVE_EVERY} steps",
        ["setting", "variant", "state", "written / backup (all processes)", "step (ms)",
         "step with save (ms)", "memory rise (MB, a process)", "restore (ms)"], rows)
    for where, figures in settings_:
        print(f"{where}: sharded step with a save / without "
              f"{figures['save_step_ratio']:.3f} (whole: "
              f"{figures['whole_save_step_ratio']:.3f}); bytes written sharded / whole "
              f"{figures['bytes_ratio']:.3f} (/ state {figures['written_per_state']:.3f}); "
              f"restore sharded / whole {figures['restore_ratio']:.3f}", flush=True)
