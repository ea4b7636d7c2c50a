"""Fix: the symbolic build all-reduces the input batch across workers.

keras-team/keras#20585, tensorflow/tensorflow#72388. The TF trainer's
`_maybe_symbolic_build` turns the first distributed batch into one batch with
`strategy.reduce("MEAN", batch, axis=None)`. Under a real multi-worker
MultiWorkerMirroredStrategy that is a cross-worker collective on the input data, which
fails ("Attempt to convert a value (PerReplica...) with an unsupported type") before
training starts. The build only needs shapes and dtypes, so keras_dist gives it the
first local replica's batch instead (no collective, no cross-worker traffic).

It also reads that batch only if the build needs one (`Trainer._symbolic_build` asks its
iterator only while the model, its compiled metrics or loss are unbuilt). Upstream reads
it on every `fit`, `evaluate` and `predict` call: an input iterator made (under a strategy
a `MultiDeviceIterator`, whose creation traces its functions) and its pipeline started
(a shuffle buffer filled) for one batch that a built model, every validation pass after
the first included, throws away (no upstream issue found: see
`docs/upstream/epoch_iterator.md`).
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


class _FirstLocalBatch:
    """An epoch iterator as `Trainer._symbolic_build` reads it: its first batch, a local
    replica's part, read only if the build asks for it."""

    def __init__(self, epoch_iterator, strategy):
        self._epoch_iterator = epoch_iterator
        self._strategy = strategy

    def __iter__(self):
        for begin, end, iterator in self._epoch_iterator:
            yield begin, end, _LocalBatches(iterator, self._strategy)
            return


class _LocalBatches:
    def __init__(self, iterator, strategy):
        self._iterator = iterator
        self._strategy = strategy

    def __iter__(self):
        return self

    def __next__(self):
        import tensorflow as tf

        # Only shapes and dtypes matter for building; a local replica's batch has them,
        # and reading it needs no collective (so no cross-worker traffic).
        return tf.nest.map_structure(
            lambda value: (self._strategy.experimental_local_results(value)[0]
                           if isinstance(value, tf.distribute.DistributedValues) else value),
            next(self._iterator))


def apply() -> None:
    trainer = _keras_tf.trainer_class()
    original = _patch.original(trainer, _ATTRIBUTE)

    @functools.wraps(original)
    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        if self._distribute_strategy is None or iterator is None:
            return original(self, iterator=iterator, data_batch=data_batch)
        with self.distribute_strategy.scope():
            self._symbolic_build(iterator=_FirstLocalBatch(iterator, self.distribute_strategy))

    _patch.patch(trainer, _ATTRIBUTE, _maybe_symbolic_build, fix=NAME)


FIX = Fix(
    name=NAME,
    upstream="keras-team/keras#20585, tensorflow/tensorflow#72388",
    summary="The symbolic build reads a local replica's batch instead of all-reducing "
    "the input across workers, and only if something is left to build.",
    symbols=("keras.TFTrainer._maybe_symbolic_build", "keras.TFTrainer._distribute_strategy",
             "keras.Trainer._symbolic_build"),
    probe=probe,
    apply=apply,
)
