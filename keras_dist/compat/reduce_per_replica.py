"""Fix: multi-worker `reduce_per_replica` reduces scalar logs along an axis they lack.

keras-team/keras#20585, tensorflow/tensorflow#72388. In multi-worker mode the TF
trainer's `reduce_per_replica` calls `strategy.reduce("MEAN", v, axis=0)` on the scalar
loss/metric logs, and axis 0 does not exist on a scalar ("Invalid reduction dimension
0"). keras_dist reduces scalars with `axis=None` (the mean over all replicas on all
workers), so every worker logs the same, global value.
"""

from __future__ import annotations

import functools

from keras_dist.compat import _keras_tf, _patch, _probe
from keras_dist.compat._fix import Fix

NAME = "reduce_per_replica_scalar"
_ATTRIBUTE = "reduce_per_replica"
# Upstream's multi-worker branch: a MEAN along axis 0 whatever the rank.
BUG_PATTERN = r"\.reduce\( ?\"MEAN\", ?\w+, ?axis ?= ?0 ?\)"


def probe(function=None) -> str:
    """PRESENT while upstream reduces every multi-worker value along axis 0."""
    if function is None:
        module = _keras_tf.trainer_module()
        if module is None:
            return _probe.FIXED
        function = _patch.original(module, _ATTRIBUTE)
    return _probe.verdict_from_source(
        function, BUG_PATTERN, required=r"_collective_all_reduce_multi_worker"
    )


def apply() -> None:
    import tensorflow as tf

    module = _keras_tf.trainer_module()
    original = _patch.original(module, _ATTRIBUTE)
    is_multi_worker = module._collective_all_reduce_multi_worker

    @functools.wraps(original)
    def reduce_per_replica(values, strategy, reduction):
        if reduction not in ("auto", "mean") or not is_multi_worker(strategy):
            return original(values, strategy, reduction)

        def _reduce(value):
            rank = value.shape.rank if hasattr(value, "shape") else None
            if rank == 0 or (
                isinstance(value, tf.distribute.DistributedValues)
                and strategy.experimental_local_results(value)[0].shape.rank == 0
            ):
                return strategy.reduce("MEAN", value, axis=None)
            return original(value, strategy, reduction)

        return tf.nest.map_structure(_reduce, values)

    # The trainer's methods look the function up in their module at call time.
    _patch.patch(module, _ATTRIBUTE, reduce_per_replica, fix=NAME)


FIX = Fix(
    name=NAME,
    upstream="keras-team/keras#20585, tensorflow/tensorflow#72388",
    summary="Scalar logs are reduced over all replicas with axis=None, not axis=0.",
    symbols=("keras.trainer.reduce_per_replica",
             "keras.trainer._collective_all_reduce_multi_worker"),
    probe=probe,
    apply=apply,
)
