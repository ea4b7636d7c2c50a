"""`FSDP`: a `keras.distribution.Distribution` that shards any model, with no layout map.

Fully sharded data parallelism (ZeRO-3): the batch is split over the mesh's one axis, and
every variable of at least `min_elements` elements is split over the same axis along one of
its dimensions, chosen from its shape (the largest one the axis size divides; the first of
equal ones). Optimizer slots take their variable's layout, so each device stores 1/N of
every large variable and of its slots; small variables (biases, norms, counters) are
replicated. On the TensorFlow backend (keras_dist's DTensor engine) a sharded weight is
all-gathered where it is used and its gradient reduce-scattered, so training computes what
one device computes with the global batch.
"""

from __future__ import annotations

import math

import keras
from keras.distribution import DeviceMesh, TensorLayout, list_devices

from keras_dist.compat._distribution_internals import distribution_base

Distribution = distribution_base()

DEFAULT_MIN_ELEMENTS = 1024


def _check_min_elements(min_elements) -> int:
    if isinstance(min_elements, bool) or not isinstance(min_elements, int) or min_elements < 0:
        raise ValueError(
            "FSDP: min_elements must be a non-negative integer (the size from which a "
            "variable is sharded; 0 shards every variable a mesh axis size divides). "
            f"Received: min_elements={min_elements!r}.")
    return min_elements


def _mesh(device_mesh, devices, batch_dim_name) -> DeviceMesh:
    if device_mesh is not None and devices is not None:
        raise ValueError("FSDP: pass device_mesh or devices, not both (devices builds a "
                         "one-axis mesh named batch_dim_name).")
    if device_mesh is None:
        devices = list(list_devices() if devices is None else devices)
        if not devices:
            raise ValueError("FSDP: devices is empty; pass device names from "
                             "keras.distribution.list_devices(), or leave it out.")
        return DeviceMesh((len(devices),), [batch_dim_name], devices)
    if not isinstance(device_mesh, DeviceMesh):
        raise ValueError(f"FSDP: device_mesh must be a keras.distribution.DeviceMesh. "
                         f"Received: {device_mesh!r} (of type {type(device_mesh).__name__}).")
    if len(device_mesh.shape) != 1:
        raise ValueError(
            f"FSDP: device_mesh must have one axis (the batch and the variables are "
            f"sharded over the same devices). Received a mesh of shape "
            f"{tuple(device_mesh.shape)} with axes {list(device_mesh.axis_names)}. Use "
            f"DeviceMesh(({math.prod(device_mesh.shape)},), ['{batch_dim_name}'], devices), "
            "or keras.distribution.ModelParallel with a LayoutMap for a 2-D mesh.")
    if device_mesh.axis_names[0] != batch_dim_name:
        raise ValueError(
            f"FSDP: batch_dim_name={batch_dim_name!r} is not the axis of device_mesh "
            f"(axes: {list(device_mesh.axis_names)}). Pass "
            f"batch_dim_name={device_mesh.axis_names[0]!r}.")
    return device_mesh


class FSDP(Distribution):
    """Fully sharded data parallelism for any Keras model, without a layout map.

    Used like `keras.distribution.DataParallel`: `keras.distribution.set_distribution(...)`
    or `with FSDP(...).scope():` around the model's creation (and its `compile`, so that the
    optimizer's slots are sharded too).

    Args:
        device_mesh: a one-axis `keras.distribution.DeviceMesh` whose axis is
            `batch_dim_name`. Default: all of `keras.distribution.list_devices()` (every
            process's devices in a multi-process job).
        devices: device names (`"cpu:0"`, `"gpu:3"`) to build the mesh from instead.
        batch_dim_name: the mesh axis the batch and the variables are split over.
        min_elements: variables with fewer elements are replicated (a gather per step
            would cost more than they weigh); the others are sharded. Default 1024.

    A variable of at least `min_elements` elements must have a dimension the number of
    devices divides; otherwise creating it raises a `ValueError` naming it (raise
    `min_elements` above its size to replicate it, or use `ModelParallel` with a layout
    for it). A variable created with a layout of its own keeps it.

    Example (4 virtual CPUs)::

        import keras_dist
        keras_dist.virtual_devices(4, "CPU")       # before TensorFlow starts
        import keras

        with keras_dist.distribution.FSDP(min_elements=1024).scope():
            model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(256),
                                      keras.layers.Dense(10)])
            model.compile(optimizer="adam", loss="mse")
        model.fit(x, y, batch_size=32)             # the global batch, 8 rows per device
        keras_dist.parallel.shards(model.layers[0].kernel)  # 4 x (device, (64, 64))
    """

    def __init__(self, device_mesh=None, *, devices=None, batch_dim_name="batch",
                 min_elements=DEFAULT_MIN_ELEMENTS, auto_shard_dataset=True):
        if not isinstance(batch_dim_name, str) or not batch_dim_name:
            raise ValueError(f"FSDP: batch_dim_name must be a mesh axis name (a non-empty "
                             f"string). Received: {batch_dim_name!r}.")
        self._min_elements = _check_min_elements(min_elements)
        _refuse_strategy_scope()
        super().__init__(_mesh(device_mesh, devices, batch_dim_name), batch_dim_name,
                         auto_shard_dataset)

    @property
    def min_elements(self) -> int:
        return self._min_elements

    @property
    def num_model_replicas(self) -> int:
        return int(self.device_mesh.devices.size)

    def get_data_layout(self, data_shape):
        axes = [None] * len(data_shape)
        if axes:
            axes[0] = self.batch_dim_name
        return TensorLayout(axes, self.device_mesh)

    def get_variable_layout(self, variable):
        if getattr(variable, "_layout", None) is not None:
            return variable._layout
        shape = tuple(int(d) for d in variable.shape)
        return TensorLayout(self.variable_axes(getattr(variable, "path", "?"), shape),
                            self.device_mesh)

    def variable_axes(self, path: str, shape) -> tuple:
        """The layout FSDP gives a variable `path` of `shape`: one axis name or None each."""
        shape = tuple(int(d) for d in shape)
        axes = [None] * len(shape)
        if math.prod(shape) < self._min_elements or not shape:
            return tuple(axes)
        size = int(self.device_mesh.shape[0])
        divisible = [dim for dim in range(len(shape)) if shape[dim] % size == 0]
        if not divisible:
            raise ValueError(
                f"FSDP: variable {path!r} of shape {shape} ({math.prod(shape)} elements, "
                f"min_elements={self._min_elements}) has no dimension divisible by the "
                f"{size} devices of axis {self.batch_dim_name!r}, so it cannot be sharded. "
                f"Use min_elements={math.prod(shape) + 1} or more to replicate it, a mesh "
                "whose size divides one of its dimensions, or a shape that does.")
        dim = max(divisible, key=lambda d: (shape[d], -d))
        axes[dim] = self.batch_dim_name
        return tuple(axes)

    def get_tensor_layout(self, path):
        return None

    def __repr__(self):
        return (f"<FSDP device_mesh={self.device_mesh}, batch_dim_name="
                f"{self.batch_dim_name!r}, min_elements={self._min_elements}>")


def _refuse_strategy_scope() -> None:
    if keras.backend.backend() != "tensorflow":
        return
    import tensorflow as tf

    if tf.distribute.has_strategy():
        raise ValueError(
            f"FSDP is created inside a tf.distribute strategy scope "
            f"({type(tf.distribute.get_strategy()).__name__}, e.g. keras_dist.strategy()"
            ".scope()). Use one: FSDP shards with keras.distribution (create it, and the "
            "model, outside the strategy's scope), or keras_dist.strategy() replicates.")
