"""`GradientAggregation`: keras_dist's gradient pipeline during `fit` (accumulate,
compress, all-reduce, clip), for what Keras' optimizer options do not cover."""

from __future__ import annotations

from keras_dist import aggregation
from keras_dist.callbacks.base import Callback
from keras_dist.callbacks._optimizer import install_aggregations
from keras_dist.checkpointing import step_state

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
    is clipped by its own norm (optimizers the step builds lazily are built on the
    first step, so their accumulators exist). See
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
            optimizer's `gradient_accumulation_steps` (accumulate in one place only).

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
        if self.config.accumulation_steps > 1 and step_state.unbuilt_step_optimizers(
                self.model):
            # Accumulators are sized from each optimizer's variables, which a custom
            # train_step creates on its first step: build them then, and install.
            _InstallOnFirstStep.install(self)
            return
        self._install(remake=True)

    def _install(self, remake):
        self.aggregators = install_aggregations(self.model, self.config,
                                                "GradientAggregation", remake=remake)
        self.aggregator = next(iter(self.aggregators.values()))


class _InstallOnFirstStep:
    """Wraps `model.train_function`: on the first call, builds the optimizers the model's
    own `train_step` builds (tracing it, training nothing), then installs the
    aggregation on them before the real step function is first traced."""

    def __init__(self, callback, function):
        self.callback, self.function = callback, function

    @classmethod
    def install(cls, callback):
        model = callback.model
        model.train_function = cls(callback, model.train_function)

    def __call__(self, iterator):
        model = self.callback.model
        step_state.build_step_state(model, iterator)
        if model.train_function is self:
            model.train_function = self.function
        # Not traced yet (Keras traces on the first call): no need to remake it.
        self.callback._install(remake=False)
        return self.function(iterator)
