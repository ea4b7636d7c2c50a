"""Tensor-parallel layers: one kernel or table split across devices (Megatron-style).

`ShardedDense(mode="column")` splits the kernel's output columns (each device computes its
slice of the output, the slices are concatenated); `mode="row"` splits the input rows
(each device multiplies its slice of the input, the partial products are summed: the
all-reduce). `ShardedEmbedding` splits the vocabulary rows (each device looks up the ids
in its range, zeros the rest, the results are summed). `get_weights`/`set_weights` use the
unsharded layout of `keras.layers.Dense` / `keras.layers.Embedding`.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from keras_dist import _validation
from keras_dist.parallel import placement

__all__ = ["ShardedDense", "ShardedEmbedding"]


def _sizes(total: int, parts: int) -> list[int]:
    return [len(chunk) for chunk in np.array_split(np.arange(total), parts)]


class _Sharded(keras.layers.Layer):
    def __init__(self, devices=None, **kwargs):
        super().__init__(**kwargs)
        self._requested_devices = None if devices is None else list(devices)
        self.devices = None

    def _resolve(self, limit: int) -> list[str]:
        if self._requested_devices is None:
            devices = placement.available_devices()[:limit]
        else:
            devices = self._requested_devices
        return placement.resolve_devices(devices, len(devices))

    def get_config(self):
        return {**super().get_config(), "devices": self._requested_devices}


@keras.saving.register_keras_serializable(package="keras_dist")
class ShardedDense(_Sharded):
    """`keras.layers.Dense` with its kernel split across devices.

    Use it for a layer whose kernel is too large for one device, or to spread its matmul.
    Pair a `"column"` layer with a following `"row"` layer (Megatron's MLP) to keep the
    hidden activations split.

    Args:
        units: Output size.
        devices: Device names (`None`: the local GPUs, else logical CPUs).
        mode: `"column"` (split outputs) or `"row"` (split inputs, sum partial products).
        activation: Applied to the gathered output, as in `Dense`.
        use_bias: Whether to add a bias.

    Example:
        >>> import numpy as np
        >>> from keras_dist.parallel import ShardedDense
        >>> layer = ShardedDense(4, devices=["/device:CPU:0", "/device:CPU:0"])
        >>> layer(np.ones((2, 3), "float32")).shape
        TensorShape([2, 4])
    """

    def __init__(self, units, devices=None, mode="column", activation=None, use_bias=True,
                 kernel_initializer="glorot_uniform", **kwargs):
        super().__init__(devices=devices, **kwargs)
        self.units = _validation.check_int("units", units, 1)
        self.mode = _validation.check_choice("mode", mode, ["column", "row"])
        self.activation = keras.activations.get(activation)
        self.use_bias = _validation.check_bool("use_bias", use_bias)
        self.kernel_initializer = keras.initializers.get(kernel_initializer)

    def build(self, input_shape):
        input_dim = int(input_shape[-1])
        split = self.units if self.mode == "column" else input_dim
        self.devices = self._resolve(split)
        self._splits = _sizes(split, len(self.devices))
        self.kernels = []
        for index, (device, size) in enumerate(zip(self.devices, self._splits)):
            shape = (input_dim, size) if self.mode == "column" else (size, self.units)
            with tf.device(device):
                self.kernels.append(self.add_weight(
                    shape=shape, initializer=self.kernel_initializer, name=f"kernel_{index}"))
        bias_sizes = self._splits if self.mode == "column" else [self.units]
        self.biases = []
        for index, (device, size) in enumerate(zip(self.devices, bias_sizes)):
            if self.use_bias:
                with tf.device(device):
                    self.biases.append(self.add_weight(shape=(size,), initializer="zeros",
                                                       name=f"bias_{index}"))

    def call(self, inputs):
        if self.mode == "column":
            parts = []
            for index, (device, kernel) in enumerate(zip(self.devices, self.kernels)):
                with tf.device(device):
                    part = tf.matmul(inputs, kernel)
                    parts.append(part + self.biases[index] if self.use_bias else part)
            outputs = tf.concat(parts, axis=-1)
        else:
            pieces = tf.split(inputs, self._splits, axis=-1)
            partial = []
            for device, kernel, piece in zip(self.devices, self.kernels, pieces):
                with tf.device(device):
                    partial.append(tf.matmul(piece, kernel))
            outputs = tf.add_n(partial)
            if self.use_bias:
                outputs = outputs + self.biases[0]
        return self.activation(outputs) if self.activation else outputs

    def compute_output_shape(self, input_shape):
        return tuple(input_shape[:-1]) + (self.units,)

    def get_weights(self):
        axis = 1 if self.mode == "column" else 0
        weights = [np.concatenate([k.numpy() for k in self.kernels], axis=axis)]
        if self.use_bias:
            weights.append(np.concatenate([b.numpy() for b in self.biases]))
        return weights

    def set_weights(self, weights):
        axis = 1 if self.mode == "column" else 0
        kernels = np.split(weights[0], np.cumsum(self._splits)[:-1], axis=axis)
        for variable, value in zip(self.kernels, kernels):
            variable.assign(value)
        if self.use_bias:
            biases = (np.split(weights[1], np.cumsum(self._splits)[:-1])
                      if self.mode == "column" else [weights[1]])
            for variable, value in zip(self.biases, biases):
                variable.assign(value)

    def get_config(self):
        return {**super().get_config(), "units": self.units, "mode": self.mode,
                "activation": keras.activations.serialize(self.activation),
                "use_bias": self.use_bias,
                "kernel_initializer": keras.initializers.serialize(self.kernel_initializer)}


@keras.saving.register_keras_serializable(package="keras_dist")
class ShardedEmbedding(_Sharded):
    """`keras.layers.Embedding` with its table's rows (the vocabulary) split across devices.

    Use it for a vocabulary table too large for one device. Each device looks up the ids in
    its row range; the others contribute zeros; the results are summed.

    Args:
        input_dim: Vocabulary size.
        output_dim: Embedding size.
        devices: Device names (`None`: the local GPUs, else logical CPUs).

    Example:
        >>> import numpy as np
        >>> from keras_dist.parallel import ShardedEmbedding
        >>> layer = ShardedEmbedding(10, 4, devices=["/device:CPU:0", "/device:CPU:0"])
        >>> layer(np.array([[1, 9]])).shape
        TensorShape([1, 2, 4])
    """

    def __init__(self, input_dim, output_dim, devices=None,
                 embeddings_initializer="uniform", **kwargs):
        super().__init__(devices=devices, **kwargs)
        self.input_dim = _validation.check_int("input_dim", input_dim, 1)
        self.output_dim = _validation.check_int("output_dim", output_dim, 1)
        self.embeddings_initializer = keras.initializers.get(embeddings_initializer)

    def build(self, input_shape=None):
        self.devices = self._resolve(self.input_dim)
        self._splits = _sizes(self.input_dim, len(self.devices))
        self._starts = [int(s) for s in np.cumsum([0] + self._splits[:-1])]
        self.tables = []
        for index, (device, size) in enumerate(zip(self.devices, self._splits)):
            with tf.device(device):
                self.tables.append(self.add_weight(
                    shape=(size, self.output_dim), initializer=self.embeddings_initializer,
                    name=f"embeddings_{index}"))

    def call(self, inputs):
        ids = tf.cast(inputs, "int32")
        parts = []
        for device, table, start, size in zip(self.devices, self.tables, self._starts,
                                              self._splits):
            with tf.device(device):
                local = ids - start
                inside = tf.logical_and(local >= 0, local < size)
                rows = tf.gather(table, tf.where(inside, local, tf.zeros_like(local)))
                parts.append(rows * tf.cast(inside, rows.dtype)[..., None])
        return tf.add_n(parts)

    def compute_output_shape(self, input_shape):
        return tuple(input_shape) + (self.output_dim,)

    def get_weights(self):
        return [np.concatenate([t.numpy() for t in self.tables], axis=0)]

    def set_weights(self, weights):
        tables = np.split(weights[0], np.cumsum(self._splits)[:-1], axis=0)
        for variable, value in zip(self.tables, tables):
            variable.assign(value)

    def get_config(self):
        return {**super().get_config(), "input_dim": self.input_dim,
                "output_dim": self.output_dim,
                "embeddings_initializer": keras.initializers.serialize(
                    self.embeddings_initializer)}
