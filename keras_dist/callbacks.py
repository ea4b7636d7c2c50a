"""Keras callbacks for distributed training: aggregation, checks, warmup, throughput.

Every callback here is a plain `keras.callbacks.Callback`. Pass the same list to
`fit` on every worker: some of them run a collective (all workers must take part), and
the ones that print do so from the chief only. Each extends `logs` and never replaces it,
so `History`, `ProgbarLogger` and `TensorBoard` see the new keys; put
`GradientNormLogger` and `Throughput` before `TensorBoard` in the list.
"""

from __future__ import annotations

import time

import keras

from keras_dist import aggregation
from keras_dist._callback_base import Callback
from keras_dist._profiler import Profiler
from keras_dist._step_time import StepTimeMonitor
from keras_dist._replica_sync import ReplicaDivergenceError, ReplicaSyncCheck, _positive_int
from keras_dist.checkpointing import BackupAndRestore, BackupError, ModelCheckpoint, TensorBoard
from keras_dist.cluster import is_chief

__all__ = [
    "BackupAndRestore",
    "BackupError",
    "GradientAggregation",
    "GradientNormLogger",
    "LearningRateWarmup",
    "ModelCheckpoint",
    "Profiler", "StepTimeMonitor",
    "ReplicaDivergenceError",
    "ReplicaSyncCheck",
    "TensorBoard",
    "Throughput",
]


def _optimizer_of(model, caller):
    if not isinstance(model, keras.Model):
        raise TypeError(
            f"{caller} hooks the gradient all-reduce of Keras 3 optimizers, but the model "
            f"is a {type(model).__module__}.{type(model).__name__} (legacy Keras 2 / "
            "tf_keras, TF_USE_LEGACY_KERAS=1). tf_keras all-reduces inside its own "
            "optimizer and keras_dist cannot hook it: drop this callback under tf_keras "
            "(clip with the optimizer's global_clipnorm, which tf_keras applies after "
            "its all-reduce), or move the model to Keras 3."
        )
    if getattr(model, "optimizer", None) is None:
        raise ValueError(
            f"{caller} needs a compiled model with an optimizer. Call "
            "model.compile(optimizer=...) before model.fit()."
        )
    return model.optimizer


def _install(model, config, caller):
    """Installs `config` on the model's optimizer; re-makes a stale train function.

    `fit` makes (but does not yet trace) the train function before `on_train_begin`;
    a function traced by an earlier `fit` would keep the old aggregation, so it is
    rebuilt whenever the installation changes.
    """
    optimizer = _optimizer_of(model, caller)
    if not optimizer.built and model.trainable_variables:
        # Under the default strategy fit defers this to tracing; the accumulators
        # need the variables now.
        with model.distribute_strategy.scope():
            optimizer.build(model.trainable_variables)
    before = aggregation.get_aggregator(optimizer)
    installed = aggregation.install(optimizer, config, strategy=model.distribute_strategy)
    if installed is not before:
        model.make_train_function(force=True)
    return installed


def _positive_number(value, name):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"Argument `{name}` must be a number > 0. Received: {name}={value!r}")


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
    aggregated gradient, and setting both it and `clipnorm` here is an error. See
    `keras_dist.aggregation` for the pipeline
    (accumulate -> compress -> all-reduce -> decompress -> norm -> clip).

    Args:
        clipnorm: Clip by the global norm of the aggregated gradient (Keras'
            single-device `global_clipnorm`). Not together with the optimizer's own
            `clipnorm`, `global_clipnorm` or `clipvalue` (that would clip twice).
        compression: None, `"bf16"` or `"fp16"`: dtype gradients are all-reduced in.
        accumulation_steps: Micro-batches per update; the all-reduce runs once per update.
            `optimizer.iterations` counts updates.
        bytes_per_pack: All-reduce pack size in bytes (0: TensorFlow decides).
        timeout_seconds: Fail an all-reduce that takes longer than this (None: wait).
        implementation: `"auto"`, `"ring"` or `"nccl"` collectives.

    Raises:
        ValueError: An argument is invalid (here), or the optimizer has conflicting
            settings (at `fit`): Keras clipping together with `clipnorm`, or the
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

    def on_train_begin(self, logs=None):
        self.aggregator = _install(self.model, self.config, "GradientAggregation")


class GradientNormLogger(Callback):
    """Adds `gradient_norm` (global norm of the aggregated gradient) to the logs.

    The epoch value is the mean over the epoch's updates; with `update_freq="batch"`
    each batch's logs also get the latest update's norm. The norm is taken after the
    all-reduce and before clipping, so it is the norm single-device training would see.
    If no `GradientAggregation` callback installed keras_dist's aggregation, this one
    installs it with default settings (plain all-reduce, same weights as stock Keras).

    Args:
        update_freq: `"epoch"` or `"batch"`.

    Example:
        >>> logger = keras_dist.callbacks.GradientNormLogger()
        >>> history = model.fit(x, y, callbacks=[logger])       # doctest: +SKIP
        >>> history.history["gradient_norm"]                     # doctest: +SKIP
    """

    def __init__(self, update_freq="epoch"):
        super().__init__()
        if update_freq not in ("epoch", "batch"):
            raise ValueError(
                "Argument `update_freq` must be 'epoch' or 'batch'. "
                f"Received: update_freq={update_freq!r}"
            )
        self.update_freq = update_freq

    def _aggregator(self):
        return aggregation.get_aggregator(self.model.optimizer)

    def on_train_begin(self, logs=None):
        if aggregation.get_aggregator(_optimizer_of(self.model, "GradientNormLogger")) is None:
            _install(self.model, aggregation.AggregationConfig(), "GradientNormLogger")

    def on_epoch_begin(self, epoch, logs=None):
        self._aggregator().mean_gradient_norm(reset=True)

    def on_train_batch_end(self, batch, logs=None):
        if self.update_freq == "batch" and logs is not None:
            logs["gradient_norm"] = self._aggregator().gradient_norm

    def on_epoch_end(self, epoch, logs=None):
        if logs is None:
            return
        aggregator = self._aggregator()
        mean = aggregator.mean_gradient_norm()
        logs["gradient_norm"] = aggregator.gradient_norm if mean is None else mean


class LearningRateWarmup(Callback):
    """Warms the learning rate up linearly to `target_lr` over the first updates.

    Large global batches (many replicas) need a large learning rate, and starting at
    it diverges; Goyal et al. (2017) and Horovod's `LearningRateWarmupCallback` start
    at `target_lr / num_replicas` and rise linearly. At update `step` (counted by
    `optimizer.iterations`, so it resumes correctly and counts updates under
    accumulation) the rate is
    `initial_lr + (target_lr - initial_lr) * min(1, (step + 1) / warmup_steps)`.
    Epoch logs get `learning_rate`.

    Args:
        target_lr: The rate to reach (e.g. `keras_dist.scale_learning_rate(base)`).
            None: the optimizer's learning rate when training starts.
        warmup_epochs: Warm up over this many epochs (needs the steps per epoch).
        warmup_steps: Or over this many updates. Give exactly one of the two.
        initial_lr: Starting rate. None: `target_lr / num_replicas_in_sync`.
        steps_per_epoch: Used with `warmup_epochs` when `fit` does not know it.
        verbose: 1 prints (on the chief) when warmup ends.

    Raises:
        ValueError: Invalid arguments, or the optimizer uses a learning-rate schedule.

    Example:
        >>> warmup = keras_dist.callbacks.LearningRateWarmup(warmup_epochs=5)
        >>> model.fit(dataset, epochs=90, callbacks=[warmup])   # doctest: +SKIP
    """

    def __init__(self, target_lr=None, warmup_epochs=None, warmup_steps=None, *,
                 initial_lr=None, steps_per_epoch=None, verbose=0):
        super().__init__()
        if (warmup_epochs is None) == (warmup_steps is None):
            raise ValueError(
                "Pass exactly one of `warmup_epochs` and `warmup_steps`. Received: "
                f"warmup_epochs={warmup_epochs!r}, warmup_steps={warmup_steps!r}"
            )
        if warmup_epochs is not None:
            _positive_number(warmup_epochs, "warmup_epochs")
        else:
            _positive_int(warmup_steps, "warmup_steps")
        if target_lr is not None:
            _positive_number(target_lr, "target_lr")
        if initial_lr is not None and (
            isinstance(initial_lr, bool) or not isinstance(initial_lr, (int, float))
            or initial_lr < 0
        ):
            raise ValueError(
                f"Argument `initial_lr` must be a number >= 0. Received: initial_lr={initial_lr!r}"
            )
        if steps_per_epoch is not None:
            _positive_int(steps_per_epoch, "steps_per_epoch")
        self.target_lr = target_lr
        self.warmup_epochs = warmup_epochs
        self.warmup_steps = warmup_steps
        self.initial_lr = initial_lr
        self.steps_per_epoch = steps_per_epoch
        self.verbose = verbose
        self._total_steps = None
        self._done = False

    def _lr_variable(self):
        optimizer = _optimizer_of(self.model, "LearningRateWarmup")
        lr = optimizer.learning_rate
        if not hasattr(lr, "assign"):
            raise ValueError(
                "LearningRateWarmup needs a constant learning rate it can set, but the "
                "optimizer uses a schedule or callable. Use a schedule with built-in "
                "warmup instead, e.g. keras.optimizers.schedules.CosineDecay(..., "
                "warmup_target=..., warmup_steps=...)."
            )
        return lr

    def on_train_begin(self, logs=None):
        lr = self._lr_variable()
        if self.target_lr is None:
            self.target_lr = float(lr.numpy())
        if self.initial_lr is None:
            self.initial_lr = self.target_lr / self.model.distribute_strategy.num_replicas_in_sync
        if self.warmup_steps is not None:
            self._total_steps = self.warmup_steps
        else:
            steps = self.steps_per_epoch or (self.params or {}).get("steps")
            if not steps:
                raise ValueError(
                    "LearningRateWarmup(warmup_epochs=...) needs the number of steps per "
                    "epoch, which fit() does not know for this dataset. Pass "
                    "steps_per_epoch= here (or to fit), or use warmup_steps= instead."
                )
            self._total_steps = max(1, round(self.warmup_epochs * steps))
        self._done = False

    def on_train_batch_begin(self, batch, logs=None):
        if self._done:
            return
        step = int(self.model.optimizer.iterations.numpy())
        fraction = min(1.0, (step + 1) / self._total_steps)
        self._lr_variable().assign(
            self.initial_lr + (self.target_lr - self.initial_lr) * fraction
        )
        if fraction >= 1.0:
            self._done = True
            if self.verbose and is_chief():
                print(f"LearningRateWarmup: reached learning rate {self.target_lr:g} "
                      f"after {self._total_steps} updates.")

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs.setdefault("learning_rate", float(self._lr_variable().numpy()))


class Throughput(Callback):
    """Adds training throughput to the epoch logs: examples/s globally and per replica.

    Keys: `examples_per_second`, `examples_per_second_per_replica` and, when
    `single_replica_examples_per_second` is given, `scaling_efficiency` (global
    throughput / (N x single-replica throughput)). Timing starts after each epoch's
    first batch, so tracing and input-pipeline start-up do not count (an epoch of one
    batch is timed whole). Without `global_batch_size` the examples are counted exactly
    from Keras' loss tracker (a collective read under multi-worker, on every worker).
    Every worker logs the same measure; only the chief prints (`verbose=1`).

    Args:
        global_batch_size: Examples per step over all replicas, if known.
        single_replica_examples_per_second: Baseline for `scaling_efficiency`.
        verbose: 1 prints one line per epoch on the chief.

    Example:
        >>> tp = keras_dist.callbacks.Throughput(global_batch_size=256)
        >>> history = model.fit(dataset, callbacks=[tp])         # doctest: +SKIP
        >>> history.history["examples_per_second"]               # doctest: +SKIP
    """

    def __init__(self, global_batch_size=None, single_replica_examples_per_second=None,
                 verbose=0):
        super().__init__()
        if global_batch_size is not None:
            _positive_int(global_batch_size, "global_batch_size")
        if single_replica_examples_per_second is not None:
            _positive_number(single_replica_examples_per_second,
                             "single_replica_examples_per_second")
        self.global_batch_size = global_batch_size
        self.single_replica_examples_per_second = single_replica_examples_per_second
        self.verbose = verbose

    def _examples_seen(self, steps):
        """Examples this epoch after `steps` steps (global, over all replicas)."""
        if self.global_batch_size is not None:
            return steps * self.global_batch_size
        from keras_dist import compat

        compat.check("callbacks")
        tracker = getattr(self.model, "_loss_tracker", None)
        if tracker is None:
            raise ValueError(
                "Throughput cannot count examples for this model; pass global_batch_size="
            )
        return float(tracker.count.numpy())

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch_start = time.perf_counter()
        self._window = None  # (time, steps, examples) after the first batch
        self._steps = 0

    def on_train_batch_end(self, batch, logs=None):
        self._steps = batch + 1  # `batch` is the last step run (steps_per_execution)
        if self._window is None:
            self._window = (time.perf_counter(), self._steps, self._examples_seen(self._steps))

    def on_epoch_end(self, epoch, logs=None):
        if logs is None or not self._steps:
            return
        now = time.perf_counter()
        examples = self._examples_seen(self._steps)
        start, first_steps, first_examples = self._window
        if self._steps > first_steps:
            examples, elapsed = examples - first_examples, now - start
        else:
            elapsed = now - self._epoch_start
        replicas = self.model.distribute_strategy.num_replicas_in_sync
        per_second = examples / max(elapsed, 1e-9)
        logs["examples_per_second"] = per_second
        logs["examples_per_second_per_replica"] = per_second / replicas
        if self.single_replica_examples_per_second:
            logs["scaling_efficiency"] = per_second / (
                replicas * self.single_replica_examples_per_second
            )
        if self.verbose and is_chief():
            print(f"Throughput: epoch {epoch + 1}: {per_second:.1f} examples/s "
                  f"({per_second / replicas:.1f} per replica, {replicas} replicas)")
