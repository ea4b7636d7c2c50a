"""Fixes: stock optimizer options get one-device semantics under keras_dist.strategy().

Two upstream behaviours of Keras 3's TensorFlow optimizer under a multi-replica
`tf.distribute` strategy, each a probe-gated fix:

* `clip_after_all_reduce` (upstream behaviour; tf.keras refused clipping under strategies
  for this reason, tensorflow/tensorflow#33929; no Keras 3 issue is filed):
  `BaseOptimizer._backend_apply_gradients`
  clips (`clipnorm`, `global_clipnorm`, `clipvalue`) before `TFOptimizer._backend_update_step`
  all-reduces, so each replica clips its local 1/N share of the gradient: N replicas take
  a different step from one device with the same global batch. keras_dist defers the
  clipping to right after the all-reduce (`_all_reduce_sum_gradients`); weight decay,
  which Keras applies in between, does not read the gradient, so the order is otherwise
  unchanged.
* `optimizer_conds_cross_replica` (keras-team/keras#20582): with
  `gradient_accumulation_steps` the update runs inside an `ops.cond` in replica context,
  and the `merge_call`s in its branches fail (`RuntimeError` in `Cond.call()`); the
  same holds for the EMA overwrite of `use_ema=True, ema_overwrite_frequency=n`.
  keras_dist takes the same decision in cross-replica context (`merge_call`, `tf.cond`,
  `call_for_each_replica`, as Keras' `LossScaleOptimizer` does) and otherwise runs
  Keras' own steps: replica-local accumulation with no communication, and on every k-th
  micro-step the mean of the k micro-batch gradients is all-reduced once, clipped (after
  the all-reduce with the fix above), weight-decayed and applied. `iterations` counts
  updates and learning-rate schedules see micro-steps, exactly as on one device. The
  EMA overwrite is decided the same way.

Both act only inside a replica context of a strategy that `keras_dist.strategy()` built
and that has more than one replica: a plain `tf.distribute` strategy in the same process,
and one-replica training, run stock Keras. They stand aside for an optimizer that
`keras_dist.callbacks.GradientAggregation` hooked (it reduces the gradient itself, and
Keras' clipping then already acts on the aggregated gradient, so nothing clips twice).
"""

from __future__ import annotations

import functools

from keras_dist.compat import _keras_tf, _patch, _probe
from keras_dist.compat._fix import Fix

CLIP_NAME = "clip_after_all_reduce"
CONDS_NAME = "optimizer_conds_cross_replica"
# Upstream clips inside the apply path (before `_backend_update_step` all-reduces) ...
_CLIPS_BEFORE_REDUCE = r"self\._clip_gradients\( ?grads ?\).*self\._backend_update_step\("
# ... and its all-reduce returns the sum as it is.
_REDUCE_CLIPS = r"_clip"
# Upstream decides "accumulate or update" (and "overwrite with the EMA") with a
# replica-context cond.
_COND_IN_REPLICA_CONTEXT = r"ops\.cond\( ?(is_update_step|should_overwrite_model_vars)"


def _tf_optimizer():
    return _keras_tf.tf_optimizer_class()


def _upstream(name):
    return _patch.original(_tf_optimizer(), name)


def _built_by_keras_dist(strategy) -> bool:
    """Whether `keras_dist.strategy()` built `strategy` (only those get the fixes)."""
    from keras_dist import _runtime

    return any(entry.strategy is strategy for entry in _runtime.created())


def _distributed_here(optimizer, *, one_replica_too: bool = False) -> bool:
    """In a replica context of a multi-replica keras_dist strategy, not hooked by us.

    `one_replica_too`: also with one replica (a one-device MirroredStrategy still takes
    its updates through `merge_call`, which cannot sit inside Keras' `ops.cond`).
    """
    import tensorflow as tf

    if "_keras_dist_aggregator" in optimizer.__dict__:
        return False  # GradientAggregation reduces (and clips) itself
    context = tf.distribute.get_replica_context()
    if context is None or (context.num_replicas_in_sync == 1 and not one_replica_too):
        return False
    return _built_by_keras_dist(context.strategy)


# -- clip_after_all_reduce ---------------------------------------------------------------
def probe_clip(reduce_function=None, apply_function=None) -> str:
    """PRESENT while upstream clips before its all-reduce and not after it."""
    if _tf_optimizer() is None:
        return _probe.FIXED  # not the TensorFlow backend: no all-reduce in the optimizer
    reduce_function = reduce_function or _upstream("_all_reduce_sum_gradients")
    apply_function = apply_function or _upstream("_backend_apply_gradients")
    reduce_source = _probe.source_of(reduce_function)
    if reduce_source is None:
        return _probe.UNKNOWN
    if "all_reduce" in reduce_source and _REDUCE_CLIPS in reduce_source.replace("\\", ""):
        return _probe.FIXED
    return _probe.verdict_from_source(
        apply_function, _CLIPS_BEFORE_REDUCE, required=r"_backend_update_step")


def _clips_itself(optimizer) -> bool:
    """A subclass that overrides `_clip_gradients` keeps clipping where it does (once)."""
    return getattr(type(optimizer)._clip_gradients, "_keras_dist_fix", None) != CLIP_NAME


def _apply_clip_fix() -> None:
    owner = _tf_optimizer()
    upstream_clip = _patch.original(owner, "_clip_gradients")
    upstream_reduce = _patch.original(owner, "_all_reduce_sum_gradients")

    @functools.wraps(upstream_clip)
    def _clip_gradients(self, grads):
        if _distributed_here(self):
            return list(grads)  # clipped after the all-reduce instead
        return upstream_clip(self, grads)

    @functools.wraps(upstream_reduce)
    def _all_reduce_sum_gradients(self, grads_and_vars):
        reduced = list(upstream_reduce(self, grads_and_vars))
        if not _distributed_here(self) or _clips_itself(self):
            return reduced
        clipped = upstream_clip(self, [grad for grad, _ in reduced])
        return [(grad, variable) for grad, (_, variable) in zip(clipped, reduced)]

    _patch.patch(owner, "_clip_gradients", _clip_gradients, fix=CLIP_NAME)
    _patch.patch(owner, "_all_reduce_sum_gradients", _all_reduce_sum_gradients,
                 fix=CLIP_NAME)


# -- optimizer_conds_cross_replica ------------------------------------------------------
def probe_conds(function=None) -> str:
    """PRESENT while upstream decides an update or an EMA overwrite in `ops.cond`."""
    if _tf_optimizer() is None:
        return _probe.FIXED
    function = function or _upstream("_backend_apply_gradients")
    return _probe.verdict_from_source(
        function, _COND_IN_REPLICA_CONTEXT, required=r"gradient_accumulation_steps")


def _needs_cross_replica_conds(optimizer) -> bool:
    return bool(optimizer.gradient_accumulation_steps) or bool(
        optimizer.use_ema and optimizer.ema_overwrite_frequency)


def _update(optimizer, grads, trainable_variables) -> None:
    """Upstream's update: clip, weight decay, `_backend_update_step` (it all-reduces)."""
    grads = optimizer._clip_gradients(grads)
    optimizer._apply_weight_decay(trainable_variables)
    optimizer._backend_update_step(grads, trainable_variables, optimizer.learning_rate)


def _accumulate_or_update(optimizer, grads, trainable_variables) -> None:
    """Keras' accumulation step, with the decision taken in cross-replica context."""
    import tensorflow as tf

    from keras_dist.aggregation import ops as _aggregation_ops

    steps = optimizer.gradient_accumulation_steps
    is_update_step = tf.equal((optimizer._iterations + 1) % steps, 0)
    accumulators = [
        optimizer._accumulated_gradients[optimizer._get_variable_index(variable)]
        for variable in trainable_variables
    ]

    def update(grads):
        # Upstream's update branch: the mean of the k micro-batch gradients, update, reset.
        grads = [(grad + accumulator) / steps for grad, accumulator in zip(grads, accumulators)]
        _update(optimizer, grads, trainable_variables)
        optimizer._backend_reset_gradient_accumulators()

    def accumulate(grads):
        optimizer._backend_increment_gradient_accumulators(grads, accumulators)

    _aggregation_ops.replica_cond(is_update_step, update, accumulate, args=(grads,))


def _moving_average(optimizer) -> None:
    """Upstream's EMA tail (every micro-step), its overwrite decided cross-replica."""
    import tensorflow as tf

    from keras_dist.aggregation import ops as _aggregation_ops

    if not optimizer.use_ema:
        return
    optimizer._update_model_variables_moving_average(optimizer._trainable_variables)
    if optimizer.ema_overwrite_frequency:
        should_overwrite = tf.equal(
            (optimizer.iterations + 1) % optimizer.ema_overwrite_frequency, 0)
        _aggregation_ops.replica_cond(
            should_overwrite,
            lambda: optimizer._overwrite_model_variables_with_average_value(
                optimizer._trainable_variables),
            lambda: None,
        )


def _apply_conds_fix() -> None:
    owner = _tf_optimizer()
    upstream_apply = _patch.original(owner, "_backend_apply_gradients")

    @functools.wraps(upstream_apply)
    def _backend_apply_gradients(self, grads, trainable_variables):
        if not _needs_cross_replica_conds(self) or not _distributed_here(
                self, one_replica_too=True):
            return upstream_apply(self, grads, trainable_variables)
        grads, trainable_variables = list(grads), list(trainable_variables)
        if self.gradient_accumulation_steps:
            _accumulate_or_update(self, grads, trainable_variables)
        else:
            _update(self, grads, trainable_variables)
        _moving_average(self)
        return None

    _patch.patch(owner, "_backend_apply_gradients", _backend_apply_gradients, fix=CONDS_NAME)


CLIP_FIX = Fix(
    name=CLIP_NAME,
    upstream="tensorflow/tensorflow#33929 (Keras 3 kept the order; no issue filed)",
    summary="clipnorm/global_clipnorm/clipvalue act on the all-reduced gradient, not on "
    "each replica's local share.",
    symbols=("keras.Optimizer._backend_apply_gradients", "keras.Optimizer._clip_gradients",
             "keras.TFOptimizer._all_reduce_sum_gradients"),
    probe=probe_clip,
    apply=_apply_clip_fix,
)

CONDS_FIX = Fix(
    name=CONDS_NAME,
    upstream="keras-team/keras#20582",
    summary="gradient_accumulation_steps and ema_overwrite_frequency decide in "
    "cross-replica context, so their merge_calls work; one all-reduce per update.",
    symbols=("keras.Optimizer._backend_apply_gradients", "keras.Optimizer._iterations",
             "keras.Optimizer._accumulated_gradients", "keras.Optimizer._get_variable_index",
             "keras.Optimizer._backend_update_step",
             "keras.Optimizer._backend_increment_gradient_accumulators",
             "keras.Optimizer._backend_reset_gradient_accumulators",
             "keras.Optimizer._apply_weight_decay", "keras.Optimizer._clip_gradients",
             "keras.Optimizer._trainable_variables",
             "keras.Optimizer._update_model_variables_moving_average",
             "keras.Optimizer._overwrite_model_variables_with_average_value",
             "tf.__internal__.distribute.strategy_supports_no_merge_call"),
    probe=probe_conds,
    apply=_apply_conds_fix,
)
