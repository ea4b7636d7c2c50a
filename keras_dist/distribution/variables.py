"""Keras variables created under a distribution: `DVariable`s stored with their layout.

Each device keeps only its slice of a sharded variable (DTensor's per-device components);
a variable no layout matches is replicated. Optimizer slots follow their variable: Keras
passes the reference variable's `_layout` when it creates them.
"""

from __future__ import annotations

import numpy as np

from keras_dist.compat._distribution_internals import creating_optimizer_variable
from keras_dist.distribution import backend


def check_layout(path: str, shape, layout, mesh) -> None:
    """A clear `ValueError` for a layout that cannot store a variable of `shape`."""
    shape = tuple(int(d) for d in shape)
    axes = tuple(layout.axes)
    where = (f"variable {path!r} of shape {shape} with layout {axes} on mesh "
             f"{dict(zip(mesh.axis_names, mesh.shape))}")
    if len(axes) > len(shape):
        raise ValueError(f"{where}: the layout has {len(axes)} dimensions, the variable "
                         f"{len(shape)}. Give one mesh axis (or None) per dimension.")
    sizes = dict(zip(mesh.axis_names, mesh.shape))
    for dim, axis in enumerate(axes):
        if axis is None:
            continue
        if axis not in sizes:
            raise ValueError(f"{where}: mesh axis {axis!r} is not in the mesh (axes: "
                             f"{list(mesh.axis_names)}).")
        if shape[dim] % sizes[axis]:
            raise ValueError(f"{where}: dimension {dim} ({shape[dim]}) is not divisible by "
                             f"mesh axis {axis!r} ({sizes[axis]}). Pick an axis that "
                             "divides it, or None to replicate that dimension.")


def _full_rank(layout, rank: int):
    """`layout` padded with None to `rank` dimensions (a shorter layout shards the first)."""
    from keras.src.distribution.distribution_lib import TensorLayout

    axes = tuple(layout.axes) + (None,) * (rank - len(layout.axes))
    return TensorLayout(axes, layout.device_mesh)


# Set once a variable is stored on a mesh in this process: until then, nothing else in
# Keras needs to look for one (eager layer calls stay as they are).
created = False


def check_distribution(distribution) -> None:
    """A clear error for a distribution this engine cannot run (or mixed with a strategy)."""
    import tensorflow as tf

    mesh = distribution.device_mesh
    if distribution.batch_dim_name not in mesh.axis_names:
        raise ValueError(
            f"{type(distribution).__name__}: batch_dim_name={distribution.batch_dim_name!r} "
            f"is not an axis of the mesh {dict(zip(mesh.axis_names, mesh.shape))}. Pass one "
            f"of {list(mesh.axis_names)}.")
    if tf.distribute.has_strategy():
        raise ValueError(
            f"A keras.distribution {type(distribution).__name__} and a tf.distribute "
            f"strategy scope ({type(tf.distribute.get_strategy()).__name__}, e.g. from "
            "keras_dist.strategy().scope()) are both active while this model is created. "
            "Use one: drop the `with strategy.scope():` block to shard with "
            "keras.distribution, or drop keras.distribution.set_distribution / "
            "`distribution.scope()` to train with keras_dist.strategy().")


def initialize(variable, value, distribution) -> None:
    """Stores `variable` (a Keras TF `Variable` being created) as a `DVariable`."""
    import tensorflow as tf
    from tensorflow.experimental import dtensor

    global created
    check_distribution(distribution)
    # No device scope: Keras's TF optimizer creates slots colocated with their variable,
    # a DVariable, and an initializer run there would run on DTensor's device, on whatever
    # mesh it used last (a slot of a (2, 2) model made after a (4,) one got a (4,) value).
    with tf.init_scope(), tf.device(None):
        full = value() if callable(value) else value
        full = tf.cast(tf.convert_to_tensor(full), variable._dtype)
        if variable._shape is None:
            variable._shape = tuple(full.shape)
        layout = getattr(variable, "_layout", None) or distribution.get_variable_layout(variable)
        check_layout(variable.path, full.shape, layout, distribution.device_mesh)
        layout = _full_rank(layout, full.shape.rank)
        variable._layout = layout
        variable._keras_dist_distribution = distribution
        created = True
        variable._value = dtensor.DVariable(
            backend.distribute_tensor(full, layout), trainable=variable.trainable,
            name=variable.name)
        # Read for compute with the batch axis gathered (FSDP: a weight sharded along the
        # data axis is all-gathered where it is used; its gradient is reduce-scattered).
        # An optimizer's own variables (slots, counters) are only used by its update, which
        # runs on the shards: they are read as stored.
        batch = distribution.batch_dim_name
        if batch in layout.axes and not creating_optimizer_variable():
            stored = variable._value.layout
            specs = [dtensor.UNSHARDED if spec == batch else spec
                     for spec in stored.sharding_specs]
            variable._value._keras_dist_compute_layout = dtensor.Layout(specs, stored.mesh)


def full_value(storage) -> np.ndarray:
    """The whole value of a DTensor (relayouted to replicated, one local copy)."""
    if hasattr(storage, "read_value"):
        storage = storage.read_value()
    return backend.whole(storage).numpy()


def shards(variable) -> list[tuple[str, np.ndarray]]:
    """`(device_name, value)` for each device holding part of `variable` (this process).

    The TensorFlow counterpart of JAX's `variable.value.addressable_shards`.

    Example (4 virtual CPUs, a (2, 2) mesh, a (4, 8) kernel on `(None, "model")`)::

        >>> [(device, value.shape) for device, value in shards(kernel)]  # doctest: +SKIP
        [('/job:localhost/replica:0/task:0/device:CPU:0', (4, 4)),
         ('/job:localhost/replica:0/task:0/device:CPU:1', (4, 4)),
         ('/job:localhost/replica:0/task:0/device:CPU:2', (4, 4)),
         ('/job:localhost/replica:0/task:0/device:CPU:3', (4, 4))]
    """
    from tensorflow.experimental import dtensor

    value = getattr(variable, "value", variable)
    storage = getattr(variable, "_value", value)
    if not backend.is_dtensor(storage):
        device = getattr(storage, "device", "") or ""
        return [(device, np.asarray(value))]
    import tensorflow as tf

    layout = dtensor.fetch_layout(storage)
    stored = tf.raw_ops.ReadVariableOp(resource=storage.handle, dtype=storage.dtype)
    parts = dtensor.unpack(stored)
    return [(device, part.numpy()) for device, part in zip(layout.mesh.local_devices(), parts)]
