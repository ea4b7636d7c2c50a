"""Fix: the input pipeline never learns which epoch `fit` is in.

tensorflow/tensorflow#48178, tensorflow/tensorflow#58925. Keras' epoch loop tells its
data adapter that an epoch begins (`data_adapter.on_epoch_begin()`) but not which one,
and tf.data's `reshuffle_each_iteration` counts iterators in the process. So a run
resumed at epoch 7 shuffles like epoch 0 (the resumed epoch skips some samples and
repeats others), and any order keyed by the epoch cannot be reproduced.

keras_dist publishes fit's epoch to its inputs (`keras_dist/data/order.py`): Keras'
`CallbackList.on_epoch_begin` runs right before the epoch's iterator is made, so a
`distribute_dataset` input reads the epoch Keras is in when its iterator starts. It also
notes which input a fit trains on (the dataset of the epoch iterator made before the
fit's callbacks start), so `BackupAndRestore` can record and check its order. A fit
that raises (a failing step or callback, Ctrl+C) never reaches `on_train_end`, so
`Model.fit` itself clears the epoch when it returns or raises: otherwise a custom loop run
after it would read the aborted fit's epoch order.
"""

from __future__ import annotations

import functools

from keras_dist.compat import _internals, _patch, _probe
from keras_dist.compat._fix import Fix

NAME = "input_epoch"
# Upstream tells the data adapter an epoch begins, without its number.
BUG_PATTERN = r"data_adapter\.on_epoch_begin\( ?\)"


def _callback_list():
    import keras

    return keras.callbacks.CallbackList


def _model():
    import keras

    return keras.Model


def probe(function=None) -> str:
    """PRESENT while Keras' epoch loop starts an epoch of the input without its number."""
    if function is None:
        iterator = _internals._epoch_iterator()
        if iterator is None:
            return _probe.UNKNOWN
        function = _patch.original(iterator, "_enumerate_iterator")
    return _probe.verdict_from_source(function, BUG_PATTERN, required=r"on_epoch_begin")


def apply() -> None:
    from keras_dist.data import order

    callbacks = _callback_list()
    on_train_begin = _patch.original(callbacks, "on_train_begin")
    on_epoch_begin = _patch.original(callbacks, "on_epoch_begin")
    on_train_end = _patch.original(callbacks, "on_train_end")

    @functools.wraps(on_train_begin)
    def patched_on_train_begin(self, logs=None):
        model = getattr(self, "model", None)
        if model is not None:
            model._keras_dist_input = order.fit_began()
        return on_train_begin(self, logs)

    @functools.wraps(on_epoch_begin)
    def patched_on_epoch_begin(self, epoch, logs=None):
        order.fit_began_epoch(epoch, (getattr(self, "params", None) or {}).get("steps"))
        return on_epoch_begin(self, epoch, logs)

    @functools.wraps(on_train_end)
    def patched_on_train_end(self, logs=None):
        order.fit_ended()
        return on_train_end(self, logs)

    _patch.patch(callbacks, "on_train_begin", patched_on_train_begin, fix=NAME)
    _patch.patch(callbacks, "on_epoch_begin", patched_on_epoch_begin, fix=NAME)
    _patch.patch(callbacks, "on_train_end", patched_on_train_end, fix=NAME)

    model = _model()
    fit = _patch.original(model, "fit")

    @functools.wraps(fit)
    def patched_fit(self, *args, **kwargs):
        try:
            return fit(self, *args, **kwargs)
        finally:
            order.fit_ended()

    _patch.patch(model, "fit", patched_fit, fix=NAME)

    epoch_iterator = _internals._tf_epoch_iterator()
    if epoch_iterator is None:
        return
    init = _patch.original(epoch_iterator, "__init__")

    @functools.wraps(init)
    def patched_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        order.iterating(getattr(self, "_distributed_dataset", None))

    _patch.patch(epoch_iterator, "__init__", patched_init, fix=NAME)


FIX = Fix(
    name=NAME,
    upstream="tensorflow/tensorflow#48178, tensorflow/tensorflow#58925",
    summary="Keras' epoch loop never tells the input its epoch; keras_dist publishes it "
    "to distribute_dataset inputs, which order each epoch by (seed, epoch).",
    symbols=("keras.EpochIterator._enumerate_iterator",
             "keras.TFEpochIterator._distributed_dataset"),
    probe=probe,
    apply=apply,
)
