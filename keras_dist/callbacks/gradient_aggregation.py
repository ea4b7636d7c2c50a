"""`GradientAggregation`: keras_dist's gradient pipeline during `fit` (accumulate,
compress, all-reduce, clip), for what Keras' optimizer options do not cover."""

from __future__ import annotations

from keras_dist import aggregation
from keras_dist.callbacks.base import Callback
from keras_dist.callbacks._optimizer import install_aggregations

__all__ = ["GradientAggregation"]


class GradientAggregation(Callback):
    """Aggregates gradients correctly across replicas and workers during `fit`.

    Under `keras_dist.strategy()` the optimizer's own `clipnorm`, `global_clipnorm`,
    `clipvalue` and `gradient_accumulation_steps` already train like one device with
    the same global batch, without this callback. Use it for what Keras has no option
    for: accumulation that all-reduces once per update (learning-rate schedules then see
    updates), bf16/fp16 communication, all-reduce packing and timeouts, the aggregated
    gradient norm; or under a `tf.distribute` strategy keras_dist did not build, where
    Keras clips each replica's local gradient before the all-reduce. Gradients are never
    clipped twice: with this callback, the optimizer's own clipping acts once, on the
    aggregated gradient, and setting both it and `clipnorm` here is an error. A model
    with its own `train_step` and several optimizers (a GAN's `d_optimizer` and
    `g_optimizer`) gets the pipeline on each: each optimizer's own aggregated gradient
    is clipped by its own norm. See
    `keras_dist.aggregation` for the pipeline
    (accumulate -> compress -> all-reduce -> decompress -> norm -> clip).

    Args:
        clipnorm: Clip by the global norm of the aggregated gradient (Keras'
            single-device `global_clipnorm`). Not together with the optimizer's own
            `clipnorm`, `global_clipnorm` or `clipvalue` (that would clip twice).
        compression: None, `"bf16"` or `"fp16"`: dtype gradients are all-reduced in.
        accumulation_steps: Micro-batches per update; the all-reduce runs once per update.
            `optimizer.iterations` counts updates.
        bytes_per_pack: All-reduce bucket size in bytes (0: the strategy's, by default
            keras_dist's measured bucket size; see `keras_dist.strategy`).
        timeout_seconds: Fail an all-reduce that takes longer than this (None: wait).
        implementation: `"auto"`, `"ring"` or `"nccl"` collectives.

    Attributes:
        aggregator: The `GradientAggregator` of `model.optimizer` (set at `fit`).
        aggregators: `{attribute: GradientAggregator}` of every optimizer the model
            keeps (`{"optimizer": ...}`, plus `d_optimizer`, `g_optimizer`, ... for a
            model with its own `train_step`).

    Raises:
        ValueError: An argument is invalid (here), or the optimizer has conflicting
            settings (at `fit`): Keras clipping together with `clipnorm`, the
            optimizer's `gradient_accumulation_steps` (accumulate in one place only), or
            `accumulation_steps > 1` for an optimizer a custom `train_step` has not
            built yet.

    Example:
        >>> import keras, keras_dist, numpy as np
        >>> with keras_dist.strategy().scope():
        ...     model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        ...     model.compile(optimizer="sgd", loss="mse")
        >>> cb = keras_dist.callbacks.GradientAggregation(clipnorm=1.0, accumulation_steps=2)
        >>> _ = model.fit(np.ones((8, 4)), np.ones((8, 1)), batch_size=2, verbose=0,
        ...               callbacks=[cb])
        >>> cb.aggregator.all_reduce_count
        2
    """

    def __init__(self, clipnorm=None, compression=None, accumulation_steps=1,
                 bytes_per_pack=0, timeout_seconds=None, *, implementation="auto"):
        super().__init__()
        self.config = aggregation.AggregationConfig(
            clipnorm=clipnorm, compression=compression,
            accumulation_steps=accumulation_steps, bytes_per_pack=bytes_per_pack,
            timeout_seconds=timeout_seconds, implementation=implementation,
        )
        self.aggregator = None
        self.aggregators = {}

    def on_train_begin(self, logs=None):
        self.aggregators = install_aggregations(self.model, self.config,
                                                "GradientAggregation")
        self.aggregator = next(iter(self.aggregators.values()))
