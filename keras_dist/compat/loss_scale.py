"""Fix: LossScaleOptimizer decides from replica 0's gradients alone.

keras-team/keras#18691 (where the TF path of `LossScaleOptimizer` was written).
`LossScaleOptimizer._tf_apply` decides whether to apply a step from `check_finite` of
the first replica's gradients, assuming they were already all-reduced ("Each replica
computed the same `finite` value"), but in Keras 3 the all-reduce happens later, inside
the inner optimizer. An inf/NaN gradient on any other replica is then summed into the
update on every replica and the loss scale is not lowered. keras_dist makes
`check_finite` all-reduce a non-finite flag in replica context, so every replica on
every worker sees the same, global answer: the step is skipped everywhere and the scale
is halved (one scalar all-reduce per step).
"""

from __future__ import annotations

import functools

from keras_dist.compat import _keras_tf, _patch, _probe
from keras_dist.compat._fix import Fix

NAME = "loss_scale_finite_across_replicas"
# Upstream takes `finite` from the first replica's local result.
BUG_PATTERN = r"experimental_local_results\( ?finite\w*\ ?\)\[0\]"


def probe(function=None) -> str:
    """PRESENT while `_tf_apply` trusts the first replica's `finite`."""
    if function is None:
        lso = _keras_tf.loss_scale_optimizer_class()
        if lso is None:
            return _probe.FIXED
        function = _patch.original(lso, "_tf_apply")
    return _probe.verdict_from_source(function, BUG_PATTERN, required=r"check_finite")


def apply() -> None:
    lso = _keras_tf.loss_scale_optimizer_class()
    original = _patch.original(lso, "check_finite")

    @functools.wraps(original)
    def check_finite(self, grads):
        import tensorflow as tf

        finite = original(self, grads)
        context = tf.distribute.get_replica_context()
        if context is None or context.num_replicas_in_sync == 1:
            return finite
        # ReduceOp has no MIN/MAX: count the replicas that saw a non-finite gradient.
        non_finite = context.all_reduce(
            tf.distribute.ReduceOp.SUM, tf.cast(tf.logical_not(finite), tf.float32)
        )
        return tf.equal(non_finite, 0.0)

    _patch.patch(lso, "check_finite", check_finite, fix=NAME)


FIX = Fix(
    name=NAME,
    upstream="keras-team/keras#18691",
    summary="check_finite all-reduces a non-finite flag, so every replica skips the "
    "step and lowers the scale together.",
    symbols=("keras.LossScaleOptimizer._tf_apply", "keras.LossScaleOptimizer.check_finite"),
    probe=probe,
    apply=apply,
)
