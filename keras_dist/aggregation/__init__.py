"""Cross-replica gradient aggregation for Keras 3 optimizers on the TensorFlow backend.

Keras 3 reduces gradients in exactly one place, `TFOptimizer._all_reduce_sum_gradients`
(a plain `ReplicaContext.all_reduce(SUM)`), and it clips (`clipnorm`, `global_clipnorm`,
`clipvalue`) *before* that, on each replica's local gradient. Under a strategy built by
`keras_dist.strategy()` the compat fixes in `keras_dist.compat.optimizer_options` already
give those options (and `gradient_accumulation_steps`) one-device semantics; this module
adds what Keras has no option for. keras_dist takes the reduction over with an
**instance hook**: `install(optimizer, config)` replaces two methods on the
optimizer object that performs the update (the inner optimizer of a
`LossScaleOptimizer`):

* `_backend_apply_gradients` runs keras_dist's pipeline and then calls the original
  method with gradients that are already aggregated, so Keras' own weight decay, EMA,
  clipping and `update_step` run unchanged;
* `_all_reduce_sum_gradients` becomes the identity (its input is already reduced).

An instance hook rather than a mixin or a wrapper optimizer: it works on the optimizer a
user already created and compiled (also inside a `LossScaleOptimizer`), keeps
`type(optimizer)`, `get_config()`, saved models and checkpoints unchanged (keras_dist's
state is not among `optimizer.variables`), and `uninstall()` restores stock Keras.

The pipeline, in this fixed order (optax-style):

    accumulate -> compress -> all-reduce -> decompress -> norm -> clip -> (Keras update)

1. **accumulate** (`accumulation_steps=k > 1`): each replica adds its micro-batch
   gradient to replica-local accumulators (`ON_READ` variables): no communication. Every
   k-th micro-step the average `sum / k` goes through the rest of the pipeline once: one
   all-reduce and one update per k steps. The branch that all-reduces cannot sit in a
   `tf.cond` in replica context under MirroredStrategy (the `merge_call` inside a cond
   is what breaks Keras' own `gradient_accumulation_steps`, keras-team/keras#20582), so
   keras_dist takes the decision in cross-replica context (`merge_call`, then `tf.cond`,
   then `call_for_each_replica`), as Keras' `LossScaleOptimizer` does.
   `optimizer.iterations` counts **updates** (as `iterations` does with Keras' own
   accumulation), and learning-rate schedules and Adam's bias correction see update
   steps too, so k micro-batches of size b train exactly like single-device batches of
   k*b. (Keras' own accumulation feeds schedules micro-steps; keras_dist does not, to
   keep that invariant.) With a `LossScaleOptimizer`, a micro-step whose gradient is not
   finite is skipped by it and does not count towards k. The accumulators and the
   micro-step phase are not saved in checkpoints; after a restore a new window of k
   starts.
2. **compress** (`compression="bf16" | "fp16"`): float gradients wider than the target
   are cast before the all-reduce and cast back after it, one all-reduce per dtype
   group. bf16 keeps float32's range (relative error ~2**-9 per element). fp16 keeps
   more precision (~2**-12) but overflows above 65504. No extra pre-scaling is applied:
   Keras already divides each replica's loss by the number of replicas, so the values
   summed are 1/n shares of the mean gradient, and pre-scaling further would push small
   gradients into fp16's subnormal range. Instead, when the fp16 sum is not finite, the
   same round is all-reduced again in the original dtype (counted in
   `GradientAggregator.fallback_count`), so overflow never reaches the weights.
3. **all-reduce**: `ReplicaContext.all_reduce(SUM, ..., options=CommunicationOptions)`
   with `bytes_per_pack`, `timeout_seconds` and `implementation`.
4. **norm**: the global L2 norm of the aggregated gradient, before clipping, is kept in
   a replicated variable (`GradientAggregator.gradient_norm`, used by
   `keras_dist.callbacks.GradientNormLogger`).
5. **clip** (`clipnorm=c`): by that global norm, after the all-reduce; equal to
   single-device Keras `global_clipnorm=c`. Keras' own `clipnorm`/`global_clipnorm`/
   `clipvalue` on the optimizer, if set instead, also act on the aggregated gradient
   once the hook is installed.

**Sparse gradients** (`tf.IndexedSlices`, from embedding lookups) go through every
stage: accumulation scatter-adds their rows into the dense accumulator (no table-sized
temporary; `keras_dist.aggregation.accumulation`), so after accumulation they are dense; without
accumulation they stay sparse and the all-reduce gathers their rows, unless the
replicas together hold at least as many rows as the table: then a dense all-reduce
moves less (`aggregation.ops.densify_if_smaller`). With "bf16" their
values travel as bf16 bits in a float16 carrier, because the gather collective of
MultiWorkerMirroredStrategy has no bfloat16 type (`aggregation.ops.compress`). The
norm sums rows that share an index first, i.e. it is the dense gradient's norm (Keras'
own `global_clipnorm` squares the rows as they come and over-counts repeated tokens).

With one replica (the default strategy, `OneDeviceStrategy`) the all-reduce and
compression are skipped; accumulation, norm and clipping still apply.
`GradientAggregator.all_reduce_count` counts aggregation rounds (one per update), so
tests and benchmarks can check "once per k steps".
"""

from __future__ import annotations

from keras_dist.aggregation import accumulation
from keras_dist.aggregation import ops as gops
from keras_dist.aggregation.config import AggregationConfig

__all__ = [
    "AggregationConfig",
    "GradientAggregator",
    "get_aggregator",
    "install",
    "uninstall",
]

def _update_owner(optimizer):
    """The optimizer whose `apply` performs the update (the inner one of a LSO)."""
    import keras

    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return _update_owner(optimizer.inner_optimizer)
    return optimizer


def _check_can_install(owner, config: AggregationConfig) -> None:
    import keras

    if keras.backend.backend() != "tensorflow":
        raise ValueError(
            "keras_dist gradient aggregation needs the TensorFlow backend. "
            f"Received: KERAS_BACKEND={keras.backend.backend()!r}"
        )
    if not isinstance(owner, keras.optimizers.Optimizer):
        raise TypeError(
            "Expected a keras.optimizers.Optimizer (e.g. model.optimizer after compile()). "
            f"Received: {type(owner).__name__}"
        )
    steps = owner.gradient_accumulation_steps
    if steps:
        raise ValueError(
            f"The optimizer has gradient_accumulation_steps={steps}, and keras_dist's "
            "aggregation would accumulate micro-batches again. Choose one: drop the "
            "keras_dist aggregation (Keras' own accumulation works under "
            "keras_dist.strategy(), which fixes keras-team/keras#20582), or remove "
            "gradient_accumulation_steps from the optimizer and pass accumulation_steps="
            f"{steps} to keras_dist (one all-reduce per update, optional compression)."
        )
    if config.clipnorm is not None:
        keras_clip = {
            name: getattr(owner, name)
            for name in ("clipnorm", "global_clipnorm", "clipvalue")
            if getattr(owner, name, None) is not None
        }
        if keras_clip:
            settings = ", ".join(f"{k}={v}" for k, v in keras_clip.items())
            raise ValueError(
                f"Both keras_dist clipnorm={config.clipnorm} and the optimizer's own "
                f"{settings} are set; gradients would be clipped twice. Remove "
                f"{', '.join(keras_clip)} from the optimizer (keras_dist's clipnorm is "
                "Keras' global_clipnorm applied to the aggregated gradient)."
            )


def _identity_all_reduce(grads_and_vars):
    # Installed as `_all_reduce_sum_gradients`: what reaches it is already aggregated.
    return list(grads_and_vars)


class GradientAggregator:
    """keras_dist's aggregation state on one optimizer; returned by `install()`.

    Read its counters in eager code (callbacks, tests, benchmarks); every property reads
    replica 0's copy of a per-replica variable, so it costs no communication and gives
    the same value on every worker.
    """

    def __init__(self, optimizer, config: AggregationConfig, strategy):
        import tensorflow as tf

        self.optimizer = optimizer
        self.config = config
        self.strategy = strategy
        self._options = config.communication.to_tf()
        with strategy.scope():
            self._gradient_norm = gops.local_variable(0.0, tf.float32, "gradient_norm")
            self._norm_sum = gops.local_variable(0.0, tf.float32, "gradient_norm_sum")
            self._norm_count = gops.local_variable(0, tf.int64, "gradient_norm_count")
            self._all_reduce_count = gops.local_variable(0, tf.int64, "all_reduce_count")
            self._fallback_count = gops.local_variable(0, tf.int64, "fallback_count")
            self._micro_steps = gops.local_variable(0, tf.int64, "micro_steps")
            self._accumulators = self._make_accumulators(optimizer, config)
        self._original_apply = None

    @staticmethod
    def _make_accumulators(optimizer, config):
        return accumulation.make_accumulators(optimizer, config.accumulation_steps)

    # -- what callbacks and tests read ------------------------------------------------
    @property
    def gradient_norm(self) -> float:
        """Global norm of the most recent aggregated gradient, before clipping."""
        return float(self._gradient_norm.numpy())

    @property
    def all_reduce_count(self) -> int:
        """Aggregation rounds so far: one all-reduce of all gradients per update."""
        return int(self._all_reduce_count.numpy())

    @property
    def fallback_count(self) -> int:
        """fp16 rounds whose sum overflowed and were all-reduced again in float32."""
        return int(self._fallback_count.numpy())

    def mean_gradient_norm(self, reset: bool = False) -> float | None:
        """Mean `gradient_norm` of the updates since the last reset (None if none)."""
        count = int(self._norm_count.numpy())
        mean = float(self._norm_sum.numpy()) / count if count else None
        if reset:
            self._norm_sum.assign(0.0)
            self._norm_count.assign(0)
        return mean

    # -- installation -------------------------------------------------------------------
    def _attach(self):
        owner = self.optimizer
        self._original_apply = type(owner)._backend_apply_gradients.__get__(owner)
        # object.__setattr__: keep Keras' tracker and TF's checkpoint tracking out of it.
        object.__setattr__(owner, "_keras_dist_aggregator", self)
        object.__setattr__(owner, "_backend_apply_gradients", self._backend_apply_gradients)
        object.__setattr__(owner, "_all_reduce_sum_gradients", _identity_all_reduce)

    def _detach(self):
        for name in ("_keras_dist_aggregator", "_backend_apply_gradients",
                     "_all_reduce_sum_gradients"):
            self.optimizer.__dict__.pop(name, None)

    # -- the pipeline (replica context, inside the train step) ---------------------------
    def _backend_apply_gradients(self, grads, trainable_variables):
        grads = list(grads)
        trainable_variables = list(trainable_variables)
        if self.config.accumulation_steps == 1:
            self._reduce_and_apply(grads, trainable_variables)
        else:
            self._accumulate(grads, trainable_variables)

    def _accumulate(self, grads, trainable_variables):
        import tensorflow as tf

        steps = self.config.accumulation_steps
        owner = self.optimizer
        accumulators = [
            self._accumulators[owner._get_variable_index(v)] for v in trainable_variables
        ]
        accumulation.accumulate(accumulators, grads)
        self._micro_steps.assign_add(1)
        is_update = tf.equal(self._micro_steps.read_value() % steps, 0)
        # `apply()` adds 1 to `_iterations` after this returns; undo it on steps that
        # only accumulate, so `iterations` (and LR schedules, Adam) count updates.
        iterations = owner._iterations
        iterations.assign_sub(tf.cast(tf.logical_not(is_update), iterations.dtype))

        def update():
            averaged = accumulation.read_and_reset(accumulators, steps)
            self._reduce_and_apply(averaged, trainable_variables)

        gops.replica_cond(is_update, update, lambda: None)

    def _reduce_and_apply(self, grads, trainable_variables):
        import tensorflow as tf

        context = tf.distribute.get_replica_context()
        if context is None or context.num_replicas_in_sync == 1:
            self._finish(grads, trainable_variables)
            return
        grads = gops.densify_if_smaller(grads, context.num_replicas_in_sync)
        dtypes = gops.dtypes_of(grads)
        compression = self.config.compression
        reduced = self._all_reduce(gops.compress(grads, compression))
        if compression != "fp16":
            self._finish(gops.decompress(reduced, dtypes, compression),
                         trainable_variables)
            return

        def use_fp16_sum(reduced, grads):
            self._finish(gops.decompress(reduced, dtypes, compression),
                         trainable_variables)

        def redo_in_original_dtype(reduced, grads):
            self._fallback_count.assign_add(1)
            self._finish(self._all_reduce(grads), trainable_variables)

        # The fp16 sum is identical on every replica, so they all take the same branch.
        gops.replica_cond(gops.all_finite(reduced), use_fp16_sum, redo_in_original_dtype,
                      args=(reduced, grads))

    def _all_reduce(self, grads):
        import tensorflow as tf

        context = tf.distribute.get_replica_context()
        reduced = list(grads)
        for positions in gops.group_by_dtype(grads).values():
            group = context.all_reduce(
                tf.distribute.ReduceOp.SUM, [grads[i] for i in positions],
                options=self._options,
            )
            for position, value in zip(positions, group):
                reduced[position] = value
        return reduced

    def _finish(self, grads, trainable_variables):
        self._all_reduce_count.assign_add(1)
        norm = gops.global_norm(grads)
        self._gradient_norm.assign(norm)
        self._norm_sum.assign_add(norm)
        self._norm_count.assign_add(1)
        if self.config.clipnorm is not None:
            grads = gops.clip_by_global_norm(grads, self.config.clipnorm, norm)
        self._original_apply(grads, trainable_variables)


def get_aggregator(optimizer) -> GradientAggregator | None:
    """The aggregator installed on `optimizer` (or its inner optimizer), if any."""
    return _update_owner(optimizer).__dict__.get("_keras_dist_aggregator")


def install(optimizer, config: AggregationConfig | None = None, *, strategy=None,
            **kwargs) -> GradientAggregator:
    """Routes `optimizer`'s gradient reduction through keras_dist's pipeline.

    Use it in custom training loops or benchmarks; with `model.fit`, the
    `keras_dist.callbacks.GradientAggregation` callback calls it for you. Call it
    before the train function is traced (a traced `tf.function` keeps the old path).
    Installing the same config again returns the existing aggregator; a different
    config replaces it.

    Args:
        optimizer: A Keras optimizer on the TensorFlow backend, or a
            `LossScaleOptimizer` (the hook goes on its inner optimizer).
        config: An `AggregationConfig`; or pass its fields as keyword arguments.
        strategy: The strategy the model trains under (default: the one in scope, else
            the one the optimizer was created under).

    Returns:
        The `GradientAggregator`, whose counters callbacks read.

    Raises:
        ValueError: Conflicting optimizer settings (Keras' `gradient_accumulation_steps`,
            or Keras clipping together with `clipnorm`), an unbuilt optimizer with
            `accumulation_steps > 1`, or an invalid config.

    Example:
        >>> import keras, keras_dist
        >>> from keras_dist import aggregation
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        >>> model.compile(optimizer="sgd", loss="mse")
        >>> model.optimizer.build(model.trainable_variables)
        >>> agg = aggregation.install(model.optimizer, clipnorm=1.0, accumulation_steps=2)
        >>> agg.config.accumulation_steps
        2
    """
    import tensorflow as tf

    from keras_dist import compat

    if config is None:
        config = AggregationConfig(**kwargs)
    elif kwargs:
        raise TypeError(
            "Pass either `config` or its fields as keyword arguments, not both. "
            f"Received: config={config!r} and {sorted(kwargs)}"
        )
    compat.check("aggregation")
    compat.apply()
    owner = _update_owner(optimizer)
    _check_can_install(owner, config)
    existing = get_aggregator(owner)
    if existing is not None:
        if existing.config == config:
            return existing
        existing._detach()
    if strategy is None:
        strategy = (tf.distribute.get_strategy() if tf.distribute.has_strategy()
                    else owner._distribution_strategy)
    aggregator = GradientAggregator(owner, config, strategy)
    aggregator._attach()
    return aggregator


def uninstall(optimizer) -> bool:
    """Restores stock Keras aggregation on `optimizer`. Returns whether one was installed."""
    aggregator = get_aggregator(optimizer)
    if aggregator is None:
        return False
    aggregator._detach()
    return True
