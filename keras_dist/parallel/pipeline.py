"""Pipeline parallelism: `split_sequential` cuts a model into stages, `PipelineModel` runs them.

Use it when a model's parameters and optimizer slots do not fit one device: stage s lives on
`devices[s]`, so each device holds about 1/K of them. `PipelineModel.train_step` is a GPipe
schedule inside the one `tf.function` Keras traces: the batch is cut into M micro-batches,
each goes forward through the stages (activations copied between devices), back, and each
stage's gradients are summed over the micro-batches on its own device and applied once. The
micro-batches have no data dependence on each other, so TensorFlow's executor runs stage k
of micro-batch m while stage k+1 runs micro-batch m-1: the idle "bubble" is (K-1)/(M+K-1).

Across workers, tf.distribute cannot host a pipeline as a replica: a
`MultiWorkerMirroredStrategy` replica is one device per worker and every variable created in
its scope is mirrored onto that device, so variables pinned with `tf.device` to other
devices are refused or replicated whole. The working form is a pipeline per worker with an
explicit all-reduce of each stage's gradients across workers (see README, "Model
parallelism").
"""

from __future__ import annotations

from typing import Sequence

import keras
import tensorflow as tf

from keras_dist import _validation
from keras_dist.parallel import placement

__all__ = ["split_sequential", "PipelineModel"]


def _layer_params(layer) -> int:
    return int(sum(int(tf.size(w)) if None not in w.shape else 0 for w in layer.weights))


def split_sequential(model, num_stages: int, balance="params", device_map=None) -> list:
    """Cuts a `keras.Sequential` into `num_stages` consecutive `keras.Sequential` stages.

    Use it to feed `PipelineModel`. The stages hold the model's own layers, in order.

    Args:
        model: A `keras.Sequential`.
        num_stages: Number of stages (>= 1, at most the number of layers).
        balance: `"params"` (equal parameter counts) or a list of layer counts per stage.
        device_map: `None`, or `"auto"` to size stages by each device's free memory
            (GPUs) or equally (CPU logical devices).

    Returns:
        A list of `keras.Sequential`, built when `model` is built.

    Raises:
        ValueError: `model` is not sequential, more stages than layers, or a bad `balance`.

    Example:
        >>> import keras
        >>> from keras_dist.parallel import split_sequential
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8),
        ...                           keras.layers.Dense(8), keras.layers.Dense(1)])
        >>> [len(s.layers) for s in split_sequential(model, 2, balance=[1, 2])]
        [1, 2]
    """
    if not isinstance(model, keras.Sequential):
        raise ValueError(_validation.message(
            "model", "a keras.Sequential", type(model).__name__,
            "For other models, build the stages yourself as keras.Sequential models (each "
            "taking the previous one's output) and pass them to PipelineModel"))
    layers = list(model.layers)
    num_stages = _validation.check_int("num_stages", num_stages, 1)
    if num_stages > len(layers):
        raise ValueError(_validation.message(
            "num_stages", f"at most the number of layers ({len(layers)})", num_stages))
    counts = _stage_counts(layers, num_stages, balance, device_map)
    return _build_stages(model, layers, counts)


def _stage_counts(layers, num_stages, balance, device_map) -> list[int]:
    if isinstance(balance, str):
        _validation.check_choice("balance", balance, ["params"])
        capacities = [1.0] * num_stages
        if device_map == "auto":
            devices = placement.resolve_devices(None, num_stages)
            capacities = placement.device_capacities(devices)
        weights = [max(_layer_params(layer), 0) for layer in layers]
        return placement.balance_by_weight(weights, capacities)
    counts = list(balance)
    if (len(counts) != num_stages or not all(_validation.is_int(c) and c >= 1 for c in counts)
            or sum(counts) != len(layers)):
        raise ValueError(_validation.message(
            "balance", f"'params' or {num_stages} layer counts >= 1 summing to "
            f"{len(layers)}", balance))
    return counts


def _build_stages(model, layers, counts) -> list:
    stages, start = [], 0
    shape = tuple(model.inputs[0].shape) if model.built and model.inputs else None
    for index, count in enumerate(counts):
        stage = keras.Sequential(layers[start:start + count], name=f"stage_{index}")
        if shape is not None:
            stage.build(shape)
            shape = tuple(stage.outputs[0].shape)
        stages.append(stage)
        start += count
    return stages


from keras_dist.parallel._pipeline_model import PipelineModel  # noqa: E402
