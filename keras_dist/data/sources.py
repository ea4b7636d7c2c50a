"""The sources `keras_dist.distribute_dataset` reads, each sharded per worker at the source.

A source turns the user's input (arrays, a `tf.data.Dataset`, TFRecord files or a dataset
function) into one worker's *unbatched* shard, read before any shuffle or `map_fn`, so
each worker spends memory, I/O and preprocessing on its own 1/N only. It also reports the
shard sizes of all workers when they are known (arrays; datasets of known cardinality),
which lets `data.py` give every worker the same number of steps.

Private: the public entry point and its documentation are in `keras_dist/data/pipeline.py`.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Callable

import numpy as np

from keras_dist.data import map_style
from keras_dist.data.order import (
    array_shard_indices, shard_sizes_by_element, shard_sizes_in_order, worker_indices,
)
from keras_dist.data.source_base import Source

# Arrays fit in memory by definition, so their shard is shuffled whole, up to
# _MAX_SHUFFLE_BYTES of it.
_MAX_SHUFFLE_BYTES = 1 << 30
# TFRecord files read concurrently per worker; enough to hide file latency without
# opening every file of a large shard at once.
_FILE_CYCLE_LENGTH = 8


def derived_seed(seed: int, worker_index: int, stream: int) -> int:
    """A seed unique to (seed, worker, use): shards shuffle differently, reproducibly."""
    state = np.random.SeedSequence([seed, worker_index, stream]).generate_state(1, np.uint32)
    return int(state[0])


class ArraySource(Source):
    """NumPy arrays (or a tuple/dict nest of them, or pandas columns): index-able.

    In one global order (`keras_dist/data/order.py`) when shuffled without `cache`:
    every epoch each worker gathers the examples of its part of each global batch.
    Otherwise sliced in NumPy before TensorFlow, in blocks of one worker batch.
    """

    description = "arrays"

    global_order = True

    def __init__(self, structure: Any, num_examples: int):
        self.structure = structure
        self.num_examples = num_examples
        total_bytes = sum(array.nbytes for _, array in _named_leaves(structure))
        self._bytes_per_example = total_bytes / max(1, num_examples)
        self._tensors = None

    def epoch_batches(self, epoch, num_workers, worker_index, worker_batch, seed, batch,
                      drop_remainder):
        """This worker's examples of epoch `epoch` (a scalar int64 tensor), in batches.

        The indices are batched first and each batch is one `tf.gather` per array: a
        gather per example (a function call per element) cost ~10x the seed's
        `shuffle().batch()` per step, more than keras_dist's strategy saves.
        """
        import tensorflow as tf

        if self._tensors is None:
            # Converted once per process (zero-copy for aligned NumPy arrays on CPU).
            self._tensors = tf.nest.map_structure(tf.convert_to_tensor, self.structure)
        tensors = self._tensors
        size = shard_sizes_in_order(self.num_examples, num_workers, worker_batch)[worker_index]

        def indices(epoch_value):
            return worker_indices(self.num_examples, num_workers, worker_index,
                                  worker_batch, int(epoch_value), seed)

        index = tf.py_function(indices, [epoch], tf.int64)
        index.set_shape([size])
        return tf.data.Dataset.from_tensor_slices(index).batch(
            batch, drop_remainder=drop_remainder).map(
            lambda rows: tf.nest.map_structure(lambda tensor: tf.gather(tensor, rows),
                                               tensors),
            num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)

    def epoch_dataset(self, epoch, num_workers, worker_index, worker_batch, seed):
        """This worker's unbatched examples of epoch `epoch` (for a `map_fn`): gathered a
        worker batch at a time, then unbatched (cheaper than a gather per example)."""
        return self.epoch_batches(epoch, num_workers, worker_index, worker_batch, seed,
                                  worker_batch, False).unbatch()

    def shard_sizes(self, num_workers, worker_batch):
        return shard_sizes_in_order(self.num_examples, num_workers, worker_batch)

    def default_shuffle_buffer(self, shard_size):
        # The whole shard (a full shuffle of it) while that buffer stays under 1 GiB.
        fits = int(_MAX_SHUFFLE_BYTES // max(1.0, self._bytes_per_example))
        return max(1, min(shard_size or 1, fits))

    def worker_dataset(self, num_workers, worker_index, worker_batch, input_context,
                       shuffle, seed):
        import tensorflow as tf

        if num_workers == 1:
            shard = self.structure
        else:
            indices = array_shard_indices(self.num_examples, num_workers, worker_index,
                                          worker_batch)
            shard = tf.nest.map_structure(lambda array: array[indices], self.structure)
        return tf.data.Dataset.from_tensor_slices(shard)


class DatasetSource(Source):
    """A `tf.data.Dataset` of unbatched elements: `.shard()` first, on every worker."""

    description = "a tf.data.Dataset"

    def __init__(self, dataset):
        self.dataset = dataset
        cardinality = int(dataset.cardinality())
        if cardinality == 0:
            raise ValueError("Argument `source` is a tf.data.Dataset with no elements.")
        self.num_examples = cardinality if cardinality >= 0 else None

    def shard_sizes(self, num_workers, worker_batch):
        if self.num_examples is None:
            return None
        return shard_sizes_by_element(self.num_examples, num_workers)

    def worker_dataset(self, num_workers, worker_index, worker_batch, input_context,
                       shuffle, seed):
        if num_workers == 1:
            return self.dataset
        return self.dataset.shard(num_workers, worker_index)


class FileSource(Source):
    """TFRecord files: by file when there are at least as many files as workers."""

    description = "TFRecord files"

    def __init__(self, paths: list[str]):
        self.paths = paths

    def worker_dataset(self, num_workers, worker_index, worker_batch, input_context,
                       shuffle, seed):
        import tensorflow as tf

        if len(self.paths) < num_workers:
            # Too few files to give each worker its own: every worker reads the records
            # but keeps only its 1/N, so map_fn (the parsing) still runs on 1/N.
            return tf.data.TFRecordDataset(self.paths).shard(num_workers, worker_index)
        paths = self.paths[worker_index::num_workers]
        files = tf.data.Dataset.from_tensor_slices(paths)
        if shuffle and len(paths) > 1:
            files = files.shuffle(len(paths), seed=derived_seed(seed, worker_index, 1),
                                  reshuffle_each_iteration=True)
        return files.interleave(
            tf.data.TFRecordDataset,
            cycle_length=min(len(paths), _FILE_CYCLE_LENGTH),
            num_parallel_calls=tf.data.AUTOTUNE,
            deterministic=True,
        )


class FunctionSource(Source):
    """`fn(input_context) -> tf.data.Dataset` that reads this worker's shard itself."""

    description = "a dataset function"

    def __init__(self, dataset_fn: Callable):
        self.dataset_fn = dataset_fn

    def call(self, input_context):
        import tensorflow as tf

        dataset = self.dataset_fn(input_context)
        if not isinstance(dataset, tf.data.Dataset):
            raise TypeError(
                "Argument `source` is a function, so it must return a tf.data.Dataset of "
                "this worker's unbatched elements. Received from it: "
                f"{type(dataset).__name__}"
            )
        return dataset

    def worker_dataset(self, num_workers, worker_index, worker_batch, input_context,
                       shuffle, seed):
        # The function shards itself (input_context.input_pipeline_id of
        # num_input_pipelines), as with tf.distribute's distribute_datasets_from_function.
        return self.call(input_context)


def make_source(source, feature_columns=None, label_columns=None) -> Source:
    """Validates `source` and wraps it in the matching `Source`.

    `feature_columns`/`label_columns` select the columns of a Ray Data source (see
    `keras_dist/data/ray_source.py`); other sources take neither.

    Raises:
        TypeError: The source type is not supported, or columns are given for a source
            that has none.
        ValueError: Arrays are empty or of different lengths, a nest is empty, a glob
            matches nothing, a listed file does not exist, or a Ray Data column is missing.
    """
    from keras_dist.data import ray_source

    if ray_source.is_ray_data(source):
        return ray_source.RayDataSource(source, feature_columns, label_columns)
    if feature_columns is not None or label_columns is not None:
        raise TypeError(
            "Arguments `feature_columns`/`label_columns` select columns of a Ray Data "
            f"shard; the source is a {type(source).__name__}. Received: "
            f"feature_columns={feature_columns!r}, label_columns={label_columns!r}"
        )
    import tensorflow as tf

    if isinstance(source, tf.data.Dataset):
        _warn_if_batched(source)
        return DatasetSource(source)
    if isinstance(source, (str, os.PathLike)):
        return FileSource(_glob(os.fspath(source)))
    if isinstance(source, list) and source and all(
        isinstance(path, (str, os.PathLike)) for path in source
    ):
        return FileSource(_existing_files(source))
    if isinstance(source, list):
        raise TypeError(
            "Argument `source` is a list, which keras_dist reads as TFRecord file paths, but "
            f"it holds {sorted({type(item).__name__ for item in source}) or 'nothing'}. "
            "Pass arrays as a tuple (x, y) or (x, y, sample_weight), or a dict."
        )
    if callable(source) and not _is_array(source):
        return FunctionSource(source)
    if isinstance(source, (tuple, dict)) or _is_array(source):
        structure = _to_array_structure(source)
        return ArraySource(structure, _common_length(structure))
    if map_style.is_indexable(source):
        return map_style.indexable_source(source)
    raise TypeError(
        "Argument `source` must be NumPy arrays (or a tuple/dict of them), a "
        "tf.data.Dataset of unbatched elements, a list of TFRecord paths or a glob string, "
        f"or a function input_context -> tf.data.Dataset. Received: {type(source).__name__}"
    )


def _is_array(value) -> bool:
    return isinstance(value, np.ndarray) or (
        hasattr(value, "__array__") and hasattr(value, "shape")
    )


def _to_array_structure(source):
    """Tuples/dicts stay (lists inside become tuples: tf.data would stack them)."""
    if isinstance(source, dict):
        if not source:
            raise ValueError("Argument `source` is an empty dict; it needs at least one array.")
        return {key: _to_array_structure(value) for key, value in source.items()}
    if isinstance(source, (tuple, list)):
        if not source:
            raise ValueError(
                f"Argument `source` holds an empty {type(source).__name__}; expected arrays "
                "such as (x, y)."
            )
        return tuple(_to_array_structure(value) for value in source)
    if not _is_array(source):
        raise TypeError(
            "Argument `source` must hold only arrays in its tuple/dict. Received an element "
            f"of type {type(source).__name__}."
        )
    array = np.asarray(source)
    if array.ndim == 0:
        raise ValueError(
            "Argument `source` holds a scalar; every array needs a first (example) "
            f"dimension. Received an array of shape {array.shape}."
        )
    return array


def _named_leaves(structure, prefix=""):
    if isinstance(structure, dict):
        for key, value in structure.items():
            yield from _named_leaves(value, f"{prefix}[{key!r}]")
    elif isinstance(structure, tuple):
        for index, value in enumerate(structure):
            yield from _named_leaves(value, f"{prefix}[{index}]")
    else:
        yield prefix or "array", structure


def _common_length(structure) -> int:
    lengths = {name: len(array) for name, array in _named_leaves(structure)}
    if len(set(lengths.values())) > 1:
        raise ValueError(
            "Argument `source` holds arrays of different lengths; they must all have one "
            f"entry per example. Received lengths: {lengths}"
        )
    (length,) = set(lengths.values())
    if length == 0:
        raise ValueError("Argument `source` holds arrays with 0 examples.")
    return length


def _glob(pattern: str) -> list[str]:
    import tensorflow as tf

    # Sorted so every worker sees the same list and the shards are disjoint.
    paths = sorted(tf.io.gfile.glob(pattern))
    if not paths:
        raise ValueError(
            f"Argument `source` is the file pattern {pattern!r}, which matches no file. "
            "Check the path (it is read on every worker)."
        )
    return paths


def _existing_files(paths) -> list[str]:
    import tensorflow as tf

    paths = [os.fspath(path) for path in paths]
    missing = [path for path in paths if not tf.io.gfile.exists(path)]
    if missing:
        raise ValueError(
            f"Argument `source` lists {len(missing)} file(s) that do not exist: "
            f"{missing[:3]}{' ...' if len(missing) > 3 else ''}"
        )
    return paths


def _warn_if_batched(dataset) -> None:
    from keras_dist.compat import tf_data

    if tf_data.looks_batched(dataset):
        warnings.warn(
            "Argument `source` looks like an already batched tf.data.Dataset; "
            "distribute_dataset batches it again (per replica). Pass the unbatched "
            "dataset (call .unbatch() or drop the .batch()).",
            stacklevel=4,
        )
