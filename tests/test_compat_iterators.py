"""Input iterators that nobody reads are not made: one per epoch and per evaluation.

Stock Keras makes every epoch's iterator twice (`keras_dist/compat/one_iterator_per_epoch.py`)
and, under a strategy, one more per `fit`/`evaluate` call for its symbolic build, also when
the model is built (`keras_dist/compat/symbolic_build.py`); under a strategy each is a
`MultiDeviceIterator` whose creation traces its functions. These tests count the iterators
`fit`, validation, `evaluate` and `predict` make of a `distribute_dataset` input, with the
fixes and without them (reverted in this process), and check that they change nothing
that trains: the same weights, the same order.
"""

import numpy as np
import pytest

import keras_dist
from keras_dist import compat
from keras_dist.compat import one_iterator_per_epoch, symbolic_build

EPOCHS = 2
BATCHES = 4  # per epoch, of 8 examples


class _Counted:
    """Counts the iterators made of a distributed dataset (its class, swapped for a
    subclass that counts `iter()`; what Keras sees is still that dataset)."""

    def __init__(self, dataset):
        self.made = 0
        counter = self
        base = type(dataset)

        class Counting(base):
            def __iter__(self):
                counter.made += 1
                return super().__iter__()

        dataset.__class__ = Counting
        self.dataset = dataset


def _run(reverted=(), **fit_kwargs):
    """(weights, iterators made of train data, of validation data) of one fit + evaluate +
    predict on one device, with the fixes named in `reverted` reverted."""
    import keras

    strategy = keras_dist.strategy()  # applies the fixes
    for name in reverted:
        compat.revert(name)
    try:
        rng = np.random.default_rng(0)
        x = rng.normal(size=(BATCHES * 8, 4)).astype("float32")
        y = rng.normal(size=(BATCHES * 8, 1)).astype("float32")
        keras.utils.set_random_seed(1)
        with strategy.scope():
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
            model.compile(optimizer="adam", loss="mse")
        train = _Counted(keras_dist.distribute_dataset((x, y), 8, seed=5))
        val = _Counted(keras_dist.distribute_dataset((x[:16], y[:16]), 8, shuffle=False))
        model.fit(train.dataset, validation_data=val.dataset, verbose=0, **fit_kwargs)
        model.evaluate(val.dataset, verbose=0)
        model.predict(val.dataset, verbose=0)
        return model.get_weights(), train.made, val.made
    finally:
        compat.apply()


def test_each_epoch_and_evaluation_makes_one_iterator_and_trains_as_without_the_fixes():
    weights, train_made, val_made = _run(epochs=EPOCHS)
    # One per epoch, one per validation pass, evaluate and predict, each read; plus the
    # one the symbolic build of the new model reads a batch from.
    assert (train_made, val_made) == (EPOCHS + 1, EPOCHS + 2)
    # Stock Keras makes one more after every epoch and evaluation, never read ...
    stock_weights, stock_train_made, stock_val_made = _run(
        (one_iterator_per_epoch.NAME,), epochs=EPOCHS)
    assert (stock_train_made - train_made, stock_val_made - val_made) == (EPOCHS, EPOCHS + 2)
    # ... and, for the symbolic build of a built model, one per validation pass and evaluate.
    _, _, build_val_made = _run((symbolic_build.NAME,), epochs=EPOCHS)
    assert build_val_made - val_made == EPOCHS + 1
    for ours, stock in zip(weights, stock_weights):
        np.testing.assert_array_equal(ours, stock)


def test_an_iterator_kept_across_epochs_by_steps_per_epoch_is_made_when_read():
    # Two epochs of 2 steps read the 4 batches once; the iterator Keras makes after the
    # 4th batch serves epochs 3 and 4 (made when their first step reads it); the one it
    # makes after the 8th is never read (made by stock Keras only).
    kwargs = dict(epochs=4, steps_per_epoch=BATCHES // 2)
    weights, train_made, _ = _run(**kwargs)
    stock_weights, stock_train_made, _ = _run((one_iterator_per_epoch.NAME,), **kwargs)
    assert train_made == stock_train_made - 1 == 3
    for ours, stock in zip(weights, stock_weights):
        np.testing.assert_array_equal(ours, stock)


def test_the_probe_reads_upstreams_loop_not_the_wrapper():
    keras_dist.strategy()
    assert compat.applied()[one_iterator_per_epoch.NAME] is True
    assert one_iterator_per_epoch.probe() == compat.PRESENT
    from keras_dist.compat._internals import _tf_epoch_iterator

    wrapper = _tf_epoch_iterator()._enumerate_iterator
    assert wrapper._keras_dist_fix == one_iterator_per_epoch.NAME
    with pytest.raises(TypeError, match="unmade epoch iterator"):
        next(one_iterator_per_epoch._Unmade(None))
