"""tf.data's private dataset classes, read to warn about an already batched source.

`distribute_dataset` batches per replica; a dataset the user batched already would be
batched twice. tf.data has no public "is this batched" question, so the check reads the
dataset's class name and walks `_input_dataset` through pass-through datasets (prefetch,
options, cache): private names, registered as the "data" group of internals
(`keras_dist.compat.registry`), whose check turns a TensorFlow that renamed them into a
warning instead of a silently missing one.
"""

from __future__ import annotations

BATCHING_DATASETS = (
    "_BatchDataset", "_PaddedBatchDataset", "_ParallelBatchDataset", "_MapAndBatchDataset",
    "_RebatchDataset", "_DenseToRaggedDataset", "_DenseToSparseBatchDataset",
)
PASS_THROUGH_DATASETS = ("_PrefetchDataset", "_OptionsDataset", "CacheDataset",
                         "_CacheDataset", "DatasetV1Adapter")


def looks_batched(dataset) -> bool:
    """True when `dataset` (past prefetch/options/cache) is a batching dataset."""
    from keras_dist import compat

    compat.check("data")
    # Best effort: only the dataset's own class (past the pass-through ones) is looked at.
    for _ in range(8):
        name = type(dataset).__name__
        if name in BATCHING_DATASETS:
            return True
        if name not in PASS_THROUGH_DATASETS or not hasattr(dataset, "_input_dataset"):
            return False
        dataset = dataset._input_dataset
    return False
