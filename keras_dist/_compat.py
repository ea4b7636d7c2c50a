"""Version-gated fixes for upstream Keras/TensorFlow bugs. The only place they live.

Each fix names its upstream issue, applies only to the versions that have the bug, is
applied once (by `keras_dist.strategy()` or `keras_dist.aggregation.install()`), and has
a test that fails without it (`tests/test_compat.py`; the loss-scale fix:
`tests/test_compat_loss_scale.py`). Set `KERAS_DIST_DISABLE_COMPAT=name[,name]` (or
`all`) to turn fixes off, e.g. to check whether an upstream release fixed a bug.

Fixes:
    symbolic_build_multi_worker: keras-team/keras#20585, tensorflow/tensorflow#72388.
        `TensorFlowTrainer._maybe_symbolic_build` turns the first distributed batch into
        one batch with `strategy.reduce("MEAN", batch, axis=None)`. Under a real
        multi-worker MultiWorkerMirroredStrategy that is a cross-worker collective on the
        input data, which fails ("Attempt to convert a value (PerReplica...) with an
        unsupported type") before training starts. The build only needs shapes and
        dtypes, so keras_dist takes the first local replica's batch instead.
    reduce_per_replica_scalar: same issues. In multi-worker mode `reduce_per_replica`
        calls `strategy.reduce("MEAN", v, axis=0)` on the scalar metric/loss logs, and
        axis 0 does not exist on a scalar. keras_dist reduces scalars with `axis=None`
        (the mean over all replicas on all workers), so every worker logs the same,
        global value.
    loss_scale_finite_across_replicas: keras-team/keras#18691 (where the TF path of
        `LossScaleOptimizer` was written). `LossScaleOptimizer._tf_apply` decides whether
        to apply a step from `check_finite` of the first replica's gradients, assuming
        they were already all-reduced ("Each replica computed the same `finite`
        value"), but in Keras 3 the all-reduce happens later, inside the inner
        optimizer. An inf/NaN gradient on any other replica is then summed into the
        update on every replica and the loss scale is not lowered. keras_dist makes
        `check_finite` all-reduce a non-finite flag in replica context, so every
        replica on every worker sees the same, global answer: the step is skipped
        everywhere and the scale is halved (one scalar all-reduce per step).
"""

from __future__ import annotations

import functools
import os
import threading

__all__ = ["apply", "applied", "keras_version"]

_lock = threading.Lock()
_applied: dict[str, bool] = {}


def keras_version() -> tuple[int, int, int]:
    import keras

    parts = []
    for piece in keras.__version__.split(".")[:3]:
        digits = "".join(c for c in piece if c.isdigit())
        parts.append(int(digits or 0))
    return tuple((parts + [0, 0, 0])[:3])


def _disabled() -> set[str]:
    value = os.environ.get("KERAS_DIST_DISABLE_COMPAT", "")
    return {name.strip() for name in value.split(",") if name.strip()}


def _trainer_module():
    import keras

    if keras.backend.backend() != "tensorflow":
        return None
    from keras.src.backend.tensorflow import trainer

    return trainer


# -- keras-team/keras#20585 / tensorflow#72388: _maybe_symbolic_build ------------------
def _has_symbolic_build_bug() -> bool:
    # Introduced with the symbolic build on the TF trainer in Keras 3.6; still present
    # in 3.15.1 (the newest release when this was written). Re-check when bumping.
    trainer = _trainer_module()
    return (
        trainer is not None
        and (3, 6, 0) <= keras_version() < (3, 16, 0)
        and hasattr(trainer.TensorFlowTrainer, "_maybe_symbolic_build")
    )


def _apply_symbolic_build_fix() -> None:
    import tensorflow as tf

    trainer = _trainer_module()
    original = trainer.TensorFlowTrainer._maybe_symbolic_build

    @functools.wraps(original)
    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        if self._distribute_strategy is None or iterator is None:
            return original(self, iterator=iterator, data_batch=data_batch)
        for _, _, it in iterator:
            batch = next(it)
            # Only shapes and dtypes matter for building; a local replica's batch has
            # them, and reading it needs no collective (so no cross-worker traffic).
            data_batch = tf.nest.map_structure(
                lambda value: (
                    self.distribute_strategy.experimental_local_results(value)[0]
                    if isinstance(value, tf.distribute.DistributedValues)
                    else value
                ),
                batch,
            )
            break
        return original(self, iterator=None, data_batch=data_batch)

    _maybe_symbolic_build._keras_dist_fix = "symbolic_build_multi_worker"
    trainer.TensorFlowTrainer._maybe_symbolic_build = _maybe_symbolic_build


# -- keras-team/keras#20585 / tensorflow#72388: reduce_per_replica on scalars ---------
def _has_reduce_per_replica_bug() -> bool:
    trainer = _trainer_module()
    return (
        trainer is not None
        and (3, 0, 0) <= keras_version() < (3, 16, 0)
        and hasattr(trainer, "reduce_per_replica")
    )


def _apply_reduce_per_replica_fix() -> None:
    trainer = _trainer_module()
    original = trainer.reduce_per_replica

    @functools.wraps(original)
    def reduce_per_replica(values, strategy, reduction):
        if reduction not in ("auto", "mean") or not trainer._collective_all_reduce_multi_worker(
            strategy
        ):
            return original(values, strategy, reduction)
        import tensorflow as tf

        def _reduce(value):
            rank = value.shape.rank if hasattr(value, "shape") else None
            if rank == 0 or (
                isinstance(value, tf.distribute.DistributedValues)
                and strategy.experimental_local_results(value)[0].shape.rank == 0
            ):
                return strategy.reduce("MEAN", value, axis=None)
            return original(value, strategy, reduction)

        return tf.nest.map_structure(_reduce, values)

    reduce_per_replica._keras_dist_fix = "reduce_per_replica_scalar"
    # The trainer's methods look the function up in their module at call time.
    trainer.reduce_per_replica = reduce_per_replica


# -- keras-team/keras#18691: LossScaleOptimizer checks only replica 0's gradients -------
def _loss_scale_optimizer_class():
    import keras

    if keras.backend.backend() != "tensorflow":
        return None
    return keras.optimizers.LossScaleOptimizer


def _has_loss_scale_finite_bug() -> bool:
    # `_tf_apply` (Keras 3.0 onwards) takes `finite` from the first replica's local
    # gradients; still so in 3.15.1, the newest release when this was written.
    lso = _loss_scale_optimizer_class()
    return (
        lso is not None
        and (3, 0, 0) <= keras_version() < (3, 16, 0)
        and hasattr(lso, "_tf_apply")
        and hasattr(lso, "check_finite")
    )


def _apply_loss_scale_finite_fix() -> None:
    lso = _loss_scale_optimizer_class()
    original = lso.check_finite

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

    check_finite._keras_dist_fix = "loss_scale_finite_across_replicas"
    lso.check_finite = check_finite


_FIXES = {
    "symbolic_build_multi_worker": (_has_symbolic_build_bug, _apply_symbolic_build_fix),
    "reduce_per_replica_scalar": (_has_reduce_per_replica_bug, _apply_reduce_per_replica_fix),
    "loss_scale_finite_across_replicas": (
        _has_loss_scale_finite_bug, _apply_loss_scale_finite_fix
    ),
}


def apply() -> list[str]:
    """Applies every fix whose bug this Keras/TF has, once. Returns the names applied."""
    with _lock:
        disabled = _disabled()
        for name, (has_bug, fix) in _FIXES.items():
            if name in _applied:
                continue
            if "all" in disabled or name in disabled or not has_bug():
                _applied[name] = False
                continue
            fix()
            _applied[name] = True
        return [name for name, on in _applied.items() if on]


def applied() -> dict[str, bool]:
    """Which fixes were considered in this process and whether each was applied."""
    return dict(_applied)
