"""Fix: Keras makes every epoch's input iterator twice and throws the first away.

Upstream behaviour (no Keras issue was found; `docs/upstream/epoch_iterator.md` is the
report ready to file): `EpochIterator._enumerate_iterator`, once an epoch has used up an
input of known length (arrays, a `tf.data.Dataset` or a `distribute_dataset` input of
known cardinality, with no `steps_per_epoch`), makes the next epoch's iterator right away
(`self._current_iterator = iter(self._get_iterator())`); the next epoch then makes its
own, because without `steps_per_epoch` every epoch starts a fresh one. So every epoch of
`fit`, every validation pass and every `evaluate`/`predict` call makes one iterator that
is never read, the last one after training ended. Under a `tf.distribute` strategy that
iterator is a `MultiDeviceIterator` per worker, whose creation traces a dozen small
functions: measured on 2 virtual CPU devices, 0.12 CPU-seconds per epoch, 80 % of a
5-epoch `fit` of a small model (8 steps per epoch).

What keras_dist does: the iterator made at the end of an epoch is a placeholder that
holds the dataset and makes the real iterator only where Keras hands it to a step (the
epoch after it, with `steps_per_epoch` set); otherwise it is dropped unmade. Each epoch
still reads a fresh iterator made at its start, after `on_epoch_begin` (so
`distribute_dataset`'s global order reads the epoch it starts in, as before); what
training sees is unchanged (`tests/test_compat_iterators.py`). One difference from stock
Keras remains visible: a `tf.data` `shuffle()` reshuffled each iteration draws a seed per
iterator made, so without the unread ones its epochs from the second on come in other
(equally random, reproducible) orders. Applied by `keras_dist.strategy()` with the other
fixes (not by `import keras_dist`). Only the TensorFlow backend's `TFEpochIterator` is
patched.
"""

from __future__ import annotations

import functools

from keras_dist.compat import _internals, _patch, _probe
from keras_dist.compat._fix import Fix

NAME = "one_iterator_per_epoch"
# Upstream starts a fresh iterator each epoch without `steps_per_epoch` ...
_FRESH_EACH_EPOCH = r"self\._current_iterator is None or self\.steps_per_epoch is None"
# ... and after the epoch's last step already makes the next one.
_MADE_AFTER_THE_STEPS = r"\byield\b.*self\._current_iterator = iter\(self\._get_iterator\(\)\)"
BUG_PATTERN = _FRESH_EACH_EPOCH + ".*" + _MADE_AFTER_THE_STEPS


class _Unmade:
    """The next epoch's iterator as Keras asked for it: made only where a step uses it."""

    __slots__ = ("dataset",)

    def __init__(self, dataset):
        self.dataset = dataset

    def __iter__(self):
        return self

    def __next__(self):  # never reached: `patched_enumerate` makes it first
        raise TypeError("keras_dist: an unmade epoch iterator was read directly")


def probe(function=None) -> str:
    """PRESENT while the epoch loop makes the next epoch's iterator after the last step
    although the next epoch makes its own."""
    if function is None:
        iterator = _internals._epoch_iterator()
        if iterator is None:
            return _probe.UNKNOWN
        function = _patch.original(iterator, "_enumerate_iterator")
    return _probe.verdict_from_source(function, BUG_PATTERN, required=r"_get_iterator")


def apply() -> None:
    owner = _internals._tf_epoch_iterator()
    if owner is None:
        return
    enumerate_epoch = _patch.original(owner, "_enumerate_iterator")
    get_iterator = _patch.original(owner, "_get_iterator")

    @functools.wraps(enumerate_epoch)
    def patched_enumerate(self):
        steps = enumerate_epoch(self)
        # Keras makes the epoch's own iterator before its first step; any iterator it
        # asks for after a step is the next epoch's.
        started = False
        while True:
            self._keras_dist_after_a_step = started
            try:
                begin, end, iterator = next(steps)
            except StopIteration:
                return
            finally:
                self._keras_dist_after_a_step = False
            started = True
            if isinstance(iterator, _Unmade):
                iterator = self._current_iterator = iter(iterator.dataset)
            yield begin, end, iterator

    @functools.wraps(get_iterator)
    def patched_get_iterator(self):
        dataset = get_iterator(self)
        if getattr(self, "_keras_dist_after_a_step", False):
            return _Unmade(dataset)
        return dataset

    _patch.patch(owner, "_enumerate_iterator", patched_enumerate, fix=NAME)
    _patch.patch(owner, "_get_iterator", patched_get_iterator, fix=NAME)


FIX = Fix(
    name=NAME,
    upstream="none found (report ready to file: docs/upstream/epoch_iterator.md)",
    summary="Keras makes each epoch's input iterator twice (the one made after an "
    "epoch's last step is never read; under tf.distribute a MultiDeviceIterator that "
    "traces its functions); keras_dist makes it only where a step reads it.",
    symbols=("keras.EpochIterator._enumerate_iterator", "keras.TFEpochIterator._get_iterator"),
    probe=probe,
    apply=apply,
)
