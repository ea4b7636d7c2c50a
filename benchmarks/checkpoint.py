"""checkpoint: backups of a sharded model -- the sharded format vs the whole-value file.

An MLP whose kernels and Adam slots make at least 50 MB of state (quick: 1024 -> 2048 ->
2048 -> 1024 -> 10, 8.4M params, 101 MB with Adam's two moments) trained with
`keras_dist.distribution.FSDP` on 4 devices (virtual CPUs here), a backup every 4 steps:

* `whole`: what `BackupAndRestore` did under a distribution before the sharded format:
  `model.save_weights` of the whole state (every sharded variable gathered) in the step;
* `sharded`: `BackupAndRestore` today: this process's blocks copied to host memory in the
  step (`checkpointing/sharded_state.snapshot`), written by a background thread.

Per variant, one fresh process: the steady-state step without a save and with one (the
step's wall time, from one batch's start to the next's), bytes written per backup, the
process's peak memory rise while saving, and the time to restore the backup into a fresh
model on the same mesh.

    save_step_ratio = step with a save / step without (sharded; the goal is <= 1.5)
    blocking_ratio = sharded step-with-save overhead / whole's
    bytes_ratio = bytes written by sharded / by whole
    restore_ratio = sharded restore time / whole's
"""

from __future__ import annotations

from benchmarks import common

NAME = "checkpoint"
VARIANTS = ("whole", "sharded")
DEVICES = 4
SAVE_EVERY = 4


def settings(mode: str) -> dict:
    return dict(
        features=common.pick(mode, smoke=16, quick=1024, full=1024),
        hidden=common.pick(mode, smoke=[64, 64], quick=[2048, 2048, 1024],
                           full=[2048, 2048, 1024]),
        batch=common.pick(mode, smoke=16, quick=64, full=64),
        saves=common.pick(mode, smoke=2, quick=6, full=16),
    )


def measure(config: dict, variant: str, directory: str) -> dict:
    import os
    import shutil
    import time

    import keras
    import numpy as np
    from keras import distribution as kd

    import keras_dist
    from keras_dist.checkpointing import restore_state, sharded_state

    kd.set_distribution(keras_dist.distribution.FSDP(min_elements=1024))
    steps = SAVE_EVERY * (config["saves"] + 1)
    x, y = common.synthetic_classification(config["batch"] * steps, config["features"])

    def build():
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
    state_bytes = sum(value.nbytes for value in (
        np.asarray(keras.ops.convert_to_numpy(v)) for v in
        sharded_state.state_variables(model).values()))
    backup_dir = os.path.join(directory, variant)
    starts: list[float] = []
    saving: list[bool] = []

    class Clock(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            starts.append(time.perf_counter())
            saving.append((batch + 1) % SAVE_EVERY == 0)

    class WholeEvery(keras.callbacks.Callback):  # the whole-value path, in the step
        def on_train_batch_end(self, batch, logs=None):
            if (batch + 1) % SAVE_EVERY == 0:
                os.makedirs(backup_dir, exist_ok=True)
                self.model.save_weights(os.path.join(backup_dir, "backup.weights.h5"))

    saver = (WholeEvery() if variant == "whole" else
             keras_dist.callbacks.BackupAndRestore(backup_dir, save_freq=SAVE_EVERY,
                                                   delete_checkpoint=False))
    with common.RssSampler() as memory:
        model.fit(x, y, batch_size=config["batch"], epochs=1, steps_per_epoch=steps,
                  verbose=0, callbacks=[Clock(), saver])
    steps_s = np.diff(starts)
    with_save = [s for s, saved in zip(steps_s[SAVE_EVERY:], saving[SAVE_EVERY:-1]) if saved]
    without = [s for s, saved in zip(steps_s[SAVE_EVERY:], saving[SAVE_EVERY:-1]) if not saved]
    written = sum(os.path.getsize(os.path.join(root, name))
                  for root, _, names in os.walk(backup_dir) for name in names
                  if name.endswith((".blocks", ".h5")))
    fresh = build()
    started = time.perf_counter()
    if variant == "whole":
        fresh.load_weights(os.path.join(backup_dir, "backup.weights.h5"))
    else:
        state = next(name for name in os.listdir(backup_dir) if name.endswith(".state"))
        restore_state(fresh, os.path.join(backup_dir, state))
    restore_s = time.perf_counter() - started
    shutil.rmtree(backup_dir, ignore_errors=True)
    kd.set_distribution(None)
    return {"variant": variant, "state_bytes": state_bytes, "bytes_written": written,
            "step_s": common.median(without), "save_step_s": common.median(with_save),
            "save_peak_mb": (memory.peak - memory.start) / (1 << 20),
            "restore_s": restore_s}


def run(mode: str) -> dict:
    import tempfile

    config = settings(mode)
    directory = tempfile.mkdtemp(prefix="keras_dist_bench_checkpoint_")
    results = {name: common.run_isolated(measure, kwargs={"config": config, "variant": name,
                                                          "directory": directory},
                                         virtual_devices=DEVICES)
               for name in VARIANTS}
    whole, sharded = results["whole"], results["sharded"]
    return {
        "save_step_ratio": common.ratio(sharded["save_step_s"], sharded["step_s"]),
        "whole_save_step_ratio": common.ratio(whole["save_step_s"], whole["step_s"]),
        "blocking_ratio": common.ratio(max(sharded["save_step_s"] - sharded["step_s"], 0.0),
                                       max(whole["save_step_s"] - whole["step_s"], 1e-9)),
        "bytes_ratio": common.ratio(sharded["bytes_written"], whole["bytes_written"]),
        "restore_ratio": common.ratio(sharded["restore_s"], whole["restore_s"]),
        "state_mb": sharded["state_bytes"] / (1 << 20),
        "variants": results,
        "config": config,
    }


def report(result: dict) -> None:
    config = result["config"]
    rows = [(name, common.format_bytes(v["state_bytes"]), common.format_bytes(
        v["bytes_written"]), v["step_s"] * 1000, v["save_step_s"] * 1000, v["save_peak_mb"],
        v["restore_s"] * 1000) for name, v in result["variants"].items()]
    common.print_table(
        f"checkpoint: MLP {config['features']}->{config['hidden']}->10, Adam, FSDP on "
        f"{DEVICES} devices, a backup every {SAVE_EVERY} steps",
        ["variant", "state", "written / backup", "step (ms)", "step with save (ms)",
         "memory rise (MB)", "restore (ms)"], rows)
    print(f"sharded: step with a save / without {result['save_step_ratio']:.3f} (whole: "
          f"{result['whole_save_step_ratio']:.3f}); bytes written sharded / whole "
          f"{result['bytes_ratio']:.3f}; restore sharded / whole "
          f"{result['restore_ratio']:.3f}", flush=True)
