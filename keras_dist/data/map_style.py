"""Map-style sources for `distribute_dataset`: any object with `len()` whose `source[i]` is
one example (an array, or a tuple/dict of them), e.g. a PyTorch-style dataset.

Read by index in the global order (`keras_dist/data/order.py`) through Python (a generator
per epoch), so each worker fetches only its examples. A `keras.utils.PyDataset` (whose
items are batches) is refused.
"""

from __future__ import annotations

import numpy as np

from keras_dist.data.order import array_shard_indices, shard_sizes_in_order, worker_indices
from keras_dist.data.source_base import Source

__all__ = ["IndexableSource", "indexable_source", "is_indexable"]


def is_indexable(value) -> bool:
    return hasattr(value, "__len__") and hasattr(value, "__getitem__") and not isinstance(
        value, (str, bytes))


def indexable_source(source) -> Source:
    import keras

    if isinstance(source, keras.utils.PyDataset):
        raise TypeError(
            "Argument `source` is a keras.utils.PyDataset, whose items are whole batches; "
            "distribute_dataset batches per replica itself. Pass an object whose "
            "`source[i]` is one example (or the underlying arrays).")
    length = len(source)
    if length == 0:
        raise ValueError("Argument `source` has no examples (len(source) == 0).")
    try:
        first = source[0]
    except Exception as error:  # the user's __getitem__ may raise anything
        raise TypeError(
            f"Argument `source` ({type(source).__name__}) has a length but `source[0]` "
            f"failed with {type(error).__name__}: {error}. An index-able source must "
            "return one example (an array, or a tuple/dict of arrays) for each index "
            "0..len-1.") from error
    return IndexableSource(source, length, first)


class IndexableSource(Source):
    """Any object with `len()` and `source[i]` -> one example (an array, or a tuple/dict of
    them), such as a map-style dataset: read by index in the global order, through
    Python (a generator per epoch), so each worker fetches only its examples."""

    description = "an index-able source"
    global_order = True

    def __init__(self, source, num_examples: int, first_example):
        import tensorflow as tf

        self.source = source
        self.num_examples = num_examples
        self._spec = tf.nest.map_structure(
            lambda array: tf.TensorSpec(array.shape, tf.as_dtype(array.dtype)),
            _example_arrays(first_example))

    def shard_sizes(self, num_workers, worker_batch):
        return shard_sizes_in_order(self.num_examples, num_workers, worker_batch)

    def _examples(self, indices):
        for index in indices:
            yield _example_arrays(self.source[int(index)])

    def epoch_dataset(self, epoch, num_workers, worker_index, worker_batch, seed):
        import tensorflow as tf

        def generate(epoch_value):
            yield from self._examples(worker_indices(
                self.num_examples, num_workers, worker_index, worker_batch,
                int(epoch_value), seed))

        return tf.data.Dataset.from_generator(generate, output_signature=self._spec,
                                              args=(epoch,))

    def worker_dataset(self, num_workers, worker_index, worker_batch, input_context,
                       shuffle, seed):
        import tensorflow as tf

        indices = array_shard_indices(self.num_examples, num_workers, worker_index,
                                      worker_batch)
        return tf.data.Dataset.from_generator(lambda: self._examples(indices),
                                              output_signature=self._spec)


def _example_arrays(example):
    """One example as NumPy arrays: tuples/dicts kept, lists as tuples (not stacked)."""
    if isinstance(example, dict):
        return {key: _example_arrays(value) for key, value in example.items()}
    if isinstance(example, (tuple, list)):
        return tuple(_example_arrays(value) for value in example)
    return np.asarray(example)
