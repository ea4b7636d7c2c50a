"""A model's and optimizer's state in the sharded format (`checkpointing/shards.py`):
`save_state` and `restore_state`, on any `keras.distribution` mesh or on one device.

Under a distribution every variable is a DTensor whose per-device components this process
holds; saving copies the blocks this process owns to host memory (the snapshot: the only
part that holds up training) and writes them; no process gathers a sharded variable.
Restoring reads, for each local device, the region the *target* layout puts there, from
whatever blocks the saving job wrote: another mesh, another process count, or one device
without a distribution.

Example:
    >>> keras.distribution.set_distribution(keras_dist.distribution.FSDP())
    >>> model = build(); model.compile(...); model.fit(...)
    >>> keras_dist.checkpointing.save_state(model, "/shared/run1/final")
    >>> # later, anywhere: one device, another mesh or process count
    >>> keras_dist.checkpointing.restore_state(model, "/shared/run1/final")
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time

import numpy as np

from keras_dist.checkpointing import files, shards
from keras_dist.checkpointing.files import BackupError

__all__ = ["Snapshot", "is_sharded", "restore_state", "save_state", "snapshot",
           "state_variables", "write_snapshot"]

_FRAGMENT_WAIT = 600.0  # seconds the committing process waits for the others' fragments


def state_variables(model) -> dict[str, object]:
    """The variables a backup holds, by place: `model/<i>` for `model.variables` (weights,
    seed states), `optimizer/<i>` for the optimizer's (iterations, slots) and `<attribute>/<i>`
    for the other optimizers of a model with its own `train_step`, in their (deterministic)
    order. By place, not path, as Keras's own weights files: the same
    model built again in one process gets other automatic names (`dense_1`, `adam_1`)."""
    from keras_dist.checkpointing import step_state

    found = {f"model/{i}": variable for i, variable in enumerate(model.variables)}
    optimizers = {"optimizer": getattr(model, "optimizer", None)}
    # A model with its own train_step may keep more (a GAN's d_optimizer, g_optimizer).
    optimizers.update(step_state.step_optimizers(model))
    for attribute, optimizer in optimizers.items():
        if optimizer is not None and getattr(optimizer, "built", False):
            found.update({f"{attribute}/{i}": variable
                          for i, variable in enumerate(optimizer.variables)})
    return found


def _storage(variable):
    return getattr(variable, "_value", variable)


def is_sharded(model) -> bool:
    """True when `model`'s variables live on a `keras.distribution` mesh (DTensors)."""
    from keras_dist.distribution import backend

    weights = getattr(model, "weights", None) or []
    return bool(weights) and backend.is_dtensor(_storage(weights[0]))


def _placement(variable):
    """(Placement, local positions, the stored value: a DTensor read, or an array)."""
    from keras_dist.distribution import backend

    shape = tuple(int(d) for d in variable.shape)
    storage = _storage(variable)
    if not backend.is_dtensor(storage):
        return shards.Placement(shape), [0], np.array(variable.numpy())
    import tensorflow as tf
    from tensorflow.experimental import dtensor

    # A read of the stored value: its layout is the stored one (a variable read gathered
    # for compute, FSDP's, reports its compute layout), and its buffers are the
    # variable's as of now: the next update of the variable copies before it writes.
    value = tf.raw_ops.ReadVariableOp(resource=storage.handle, dtype=storage.dtype)
    layout = dtensor.fetch_layout(value)
    mesh = layout.mesh
    order = [int(i) for i in np.asarray(mesh.global_device_ids()).reshape(-1)]
    positions = [order.index(int(i)) for i in mesh.local_device_ids()]
    specs = tuple(None if spec == dtensor.UNSHARDED else spec
                  for spec in layout.sharding_specs)
    placement = shards.Placement(shape, tuple(mesh.dim_names), tuple(mesh.shape()), specs)
    return placement, positions, value


def _components(value) -> list:
    """A stored value's per-device pieces in this process (one for an array)."""
    if isinstance(value, np.ndarray):
        return [value]
    from tensorflow.experimental import dtensor

    return dtensor.unpack(value)


@dataclasses.dataclass
class Snapshot:
    """This process's part of the state as of `snapshot()`, and what the index needs.

    `parts` hold, per variable, the pieces this process owns as they were: its local
    devices' components of one read of the variable (buffers that a later update copies
    before it writes); `blocks()` hands them to the background writer as host arrays.
    """

    parts: list  # [(name, [(start, component), ...])]
    variables: dict
    process: int
    num_processes: int

    def blocks(self):
        for index, (name, pieces) in enumerate(self.parts):
            # Written once: let the pieces go, so the variable's next update need not copy
            # a buffer the snapshot still holds.
            self.parts[index] = (name, [])
            for start, component in pieces:
                yield shards.Block(name, start, np.asarray(component))


def _processes() -> tuple[int, int]:
    try:
        from keras_dist.distribution import backend

        return backend.process_id(), backend.num_processes()
    except Exception:  # no distribution machinery: one process
        return 0, 1


def snapshot(model) -> Snapshot:
    """This process's state as of now; costs one read per variable and no copy.

    The reads are split into their per-device components here, between steps: in the
    background writer, a DTensor op would queue behind the training steps on the mesh
    (measured: a 96 MB write took 1.2 s instead of 0.25 s, so the next save waited)."""
    parts, variables = [], {}
    for name, variable in state_variables(model).items():
        placement, positions, value = _placement(variable)
        variables[name] = {"shape": list(placement.shape),
                           "dtype": str(shards.numpy_dtype(variable.dtype)),
                           "path": variable.path, "placement": placement.to_json()}
        owned = shards.owned_blocks(placement, positions)
        if owned:
            components = _components(value)
            parts.append((name, [(start, components[local]) for local, start in owned]))
    process, count = _processes()
    return Snapshot(parts, variables, process, count)


def write_snapshot(state: Snapshot, directory: str, extra: dict | None = None,
                   commit: bool | None = None) -> None:
    """Writes `state` into `directory`; the committing process (process 0 by default)
    then waits for every fragment and writes the index."""
    os.makedirs(directory, exist_ok=True)
    shards.write_fragment(directory, state.process, state.blocks())
    if commit if commit is not None else state.process == 0:
        deadline = time.monotonic() + _FRAGMENT_WAIT
        names = [shards.fragment_name(p) for p in range(state.num_processes)]
        while not all(os.path.exists(os.path.join(directory, n)) for n in names):
            if time.monotonic() > deadline:
                missing = [n for n in names if not os.path.exists(os.path.join(directory, n))]
                raise BackupError(f"The sharded save in {directory!r} is missing {missing} "
                                  f"after {_FRAGMENT_WAIT:g} s: a process did not write its "
                                  "blocks (is the directory on a filesystem all share?).")
            time.sleep(0.05)
        shards.merge_index(directory, state.variables, state.num_processes, extra or {})


def _checked(model, directory, function: str) -> str:
    """`directory` as a str, or a clear error for a bad model or directory argument."""
    import keras

    if not isinstance(model, keras.Model):
        raise TypeError(f"{function}: argument `model` must be a keras.Model. Received: "
                        f"{type(model).__name__}.")
    if not model.variables:
        raise ValueError(f"{function}: the model {model.name!r} has no variables yet. Build "
                         "it first (call it on a batch, `model.build(input_shape)`, or fit).")
    directory = files.check_directory(directory, "directory", caller=function)
    return directory.rstrip(os.sep) or os.sep


def save_state(model, directory: str | os.PathLike) -> None:
    """Saves `model`'s and its optimizer's state to `directory` in the sharded format.

    Every process of the job calls it with the same directory (on a filesystem all of
    them see); each writes only the blocks it holds (one copy of each replicated block
    across the job), and process 0 writes the index last. An existing state there is
    replaced only once the new one is complete.

    Args:
        model: A built Keras model (under a `keras.distribution` distribution or not).
        directory: Where to write it.
    """
    from keras_dist.barriers import barrier

    directory = _checked(model, directory, "save_state")
    state = snapshot(model)
    staging = directory + ".saving"
    if state.process == 0:
        shutil.rmtree(staging, ignore_errors=True)
    if state.num_processes > 1:
        barrier("keras_dist_save_state")  # nobody writes into a staging being cleared
    write_snapshot(state, staging)
    if state.process == 0:
        # The old state stays whole until the new one is: a kill in between leaves one of
        # `directory` and `directory.saving` complete (restore_state reads either).
        old = directory + ".old"
        shutil.rmtree(old, ignore_errors=True)
        if os.path.exists(directory):
            os.replace(directory, old)
        os.replace(staging, directory)
        shutil.rmtree(old, ignore_errors=True)
    if state.num_processes > 1:
        barrier("keras_dist_save_state")  # every process returns once it is complete


def restore_state(model, directory: str | os.PathLike, *, reader=None) -> dict:
    """Loads a sharded state into `model` (and its optimizer), whatever mesh, distribution,
    device or process count wrote it. Each process reads only the blocks its devices need.

    Returns:
        The index's extra fields (epoch, step, ...).

    Raises:
        BackupError: No complete state there, a variable is missing or of another shape
            (a state from another model), or a block fails its checksum.
    """
    directory = _checked(model, directory, "restore_state")
    if reader is None and not os.path.exists(os.path.join(directory, shards.INDEX_NAME)):
        # save_state was stopped between its two renames: the new state is complete in
        # `.saving` (it has its index), else the old one is in `.old`.
        for candidate in (directory + ".saving", directory + ".old"):
            if os.path.exists(os.path.join(candidate, shards.INDEX_NAME)):
                directory = candidate
                break
    try:
        reader = reader or shards.StateReader(directory)
    except (OSError, ValueError) as error:
        raise BackupError(f"No complete keras_dist sharded state in {directory!r} ({error})."
                          ) from None
    _build_optimizer(model, reader)
    variables = state_variables(model)
    _check_same_model(reader, variables, directory)
    for name, variable in variables.items():
        placement, positions, stored = _placement(variable)
        try:
            parts = [reader.read(name, *placement.region(p)) for p in positions]
        except ValueError as error:
            raise BackupError(f"The sharded state in {directory!r} is damaged: {error}. "
                              "Delete it to start from scratch.") from None
        _assign(variable, parts, stored)
    return {key: value for key, value in reader.index.items()
            if key not in ("format", "variables")}


def _build_optimizer(model, reader) -> None:
    """Builds a compiled model's optimizer when the state holds one (its slots are created
    on the model's distribution, as its first step would)."""
    import contextlib

    from keras_dist.distribution.training import distribution_of

    optimizer = getattr(model, "optimizer", None)
    if optimizer is None or getattr(optimizer, "built", True) or not any(
            name.startswith("optimizer/") for name in reader.variables):
        return
    distribution = distribution_of(model)
    with distribution.scope() if distribution is not None else contextlib.nullcontext():
        optimizer.build(model.trainable_variables)


def _check_same_model(reader, variables, directory) -> None:
    stored = reader.variables
    problems = []
    for part in sorted({name.split("/")[0] for name in (*variables, *stored)}):
        ours = [name for name in variables if name.startswith(part + "/")]
        theirs = [name for name in stored if name.startswith(part + "/")]
        if len(ours) != len(theirs):
            problems.append(f"this {part} has {len(ours)} variables, the state "
                            f"{len(theirs)}")
    for name, variable in variables.items():
        shape = tuple(int(d) for d in variable.shape)
        if name in stored and tuple(stored[name]["shape"]) != shape:
            problems.append(f"{variable.path} is {shape} here, "
                            f"{tuple(stored[name]['shape'])} ({stored[name].get('path')}) "
                            "in the state")
    if problems:
        raise BackupError(
            f"The sharded state in {directory!r} is not this model's: "
            + "; ".join(problems[:4]) + ". A backup directory belongs to one model: use "
            "another directory or delete it to start from scratch.")


def _assign(variable, parts, stored) -> None:
    """`parts` (this process's pieces) into `variable`, laid out as `stored` (its read)."""
    if isinstance(stored, np.ndarray):
        variable.assign(parts[0])
        return
    import tensorflow as tf
    from tensorflow.experimental import dtensor

    storage = _storage(variable)
    layout = dtensor.fetch_layout(stored)
    tensors = [tf.constant(part, dtype=storage.dtype) for part in parts]
    storage.assign(dtensor.pack(tensors, layout))
