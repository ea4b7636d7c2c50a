"""Fix: the symbolic build all-reduces the input batch across workers.

keras-team/keras#20585, tensorflow/tensorflow#72388. The TF trainer's
`_maybe_symbolic_build` turns the first distributed batch into one batch with
`strategy.reduce("MEAN", batch, axis=None)`. Under a real multi-worker
MultiWorkerMirroredStrategy that is a cross-worker collective on the input data, which
fails ("Attempt to convert a value (PerReplica...) with an unsupported type") before
training starts. The build only needs shapes and dtypes, so keras_dist gives it the
first local replica's batch instead (no collective, no cross-worker traffic).
"""

from __future__ import annotations

import functools

from keras_dist.compat import _keras_tf, _patch, _probe
from keras_dist.compat._fix import Fix

NAME = "symbolic_build_multi_worker"
_ATTRIBUTE = "_maybe_symbolic_build"
# Upstream reduces the distributed batch with a cross-replica MEAN.
BUG_PATTERN = r"\.reduce\( ?\"MEAN\""


def probe(function=None) -> str:
    """PRESENT while upstream's `_maybe_symbolic_build` reduces the input batch."""
    if function is None:
        trainer = _keras_tf.trainer_class()
        if trainer is None:
            return _probe.FIXED  # not the TensorFlow backend: no such code path
        function = _patch.original(trainer, _ATTRIBUTE)
    return _probe.verdict_from_source(function, BUG_PATTERN, required=r"data_batch")


def apply() -> None:
    import tensorflow as tf

    trainer = _keras_tf.trainer_class()
    original = _patch.original(trainer, _ATTRIBUTE)

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

    _patch.patch(trainer, _ATTRIBUTE, _maybe_symbolic_build, fix=NAME)


FIX = Fix(
    name=NAME,
    upstream="keras-team/keras#20585, tensorflow/tensorflow#72388",
    summary="The symbolic build reads a local replica's batch instead of all-reducing "
    "the input across workers.",
    symbols=("keras.TFTrainer._maybe_symbolic_build", "keras.TFTrainer._distribute_strategy"),
    probe=probe,
    apply=apply,
)
