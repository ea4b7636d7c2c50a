"""Ray Data as a `distribute_dataset` source: the shard Ray Train gives each worker.

Inside a Ray Train `train_loop_per_worker`, `ray.train.get_dataset_shard("train")` returns
a `ray.data.DataIterator` over this worker's part of the dataset: Ray has already split it
across the workers (`DataConfig`), so keras_dist must not shard it again (that would keep
only 1/N of the 1/N). keras_dist reads it through Ray's own `DataIterator.to_tf` (same
column semantics: a column name gives a tensor, a list of names a dict of tensors), then
shuffles, batches per replica and prefetches like every other source.

Private: users reach it through `keras_dist.distribute_dataset(shard, ...,
feature_columns=..., label_columns=...)`; it imports nothing from Ray until a Ray object
is passed, so Ray stays an optional extra.
"""

from __future__ import annotations

from typing import Sequence, Union

from keras_dist.data.source_base import Source

Columns = Union[str, Sequence[str]]

# Rows per read from Ray's iterator. Only a read granularity: the rows are unbatched
# again before keras_dist's shuffle and per-replica batching.
_READ_BATCH_ROWS = 256


def is_ray_data(source) -> bool:
    """Whether `source` is a Ray Data iterator or dataset, without importing Ray."""
    return any(
        cls.__module__.startswith("ray.data") and cls.__name__ in ("DataIterator", "Dataset")
        for cls in type(source).__mro__
    )


class RayDataSource(Source):
    """A `ray.data.DataIterator` (already this worker's shard) or a `ray.data.Dataset`."""

    description = "a Ray Data shard"

    def __init__(self, source, feature_columns: Columns | None, label_columns: Columns | None):
        self.iterator = source.iterator() if _is_dataset(source) else source
        self.is_whole_dataset = _is_dataset(source)
        schema = self.iterator.schema()
        available = list(schema.names) if schema is not None else []
        if feature_columns is None or label_columns is None:
            raise ValueError(
                "A Ray Data source needs `feature_columns` and `label_columns` (a column "
                "name, or a list of names for a dict), as in Ray's DataIterator.to_tf. "
                f"Received: feature_columns={feature_columns!r}, "
                f"label_columns={label_columns!r}. The shard has columns {available}."
            )
        self.feature_columns = _check_columns("feature_columns", feature_columns, available)
        self.label_columns = _check_columns("label_columns", label_columns, available)

    def worker_dataset(self, num_workers, worker_index, worker_batch, input_context,
                       shuffle, seed):
        if self.is_whole_dataset and num_workers > 1:
            # Every worker would read all of it: Ray, not keras_dist, splits Ray Data.
            raise ValueError(
                "Argument `source` is a whole ray.data.Dataset in a job of "
                f"{num_workers} workers. Pass it to the trainer (`datasets={{'train': ds}}`) "
                "and give distribute_dataset `ray.train.get_dataset_shard('train')`, "
                "which Ray has already split across the workers."
            )
        # No `.shard()`: Ray already gave this worker its part.
        dataset = self.iterator.to_tf(self.feature_columns, self.label_columns,
                                      batch_size=_READ_BATCH_ROWS)
        return dataset.unbatch()


def _is_dataset(source) -> bool:
    return any(cls.__module__.startswith("ray.data") and cls.__name__ == "Dataset"
               for cls in type(source).__mro__)


def _check_columns(name: str, columns: Columns, available: list[str]):
    requested = [columns] if isinstance(columns, str) else list(columns)
    if not requested or not all(isinstance(column, str) for column in requested):
        raise TypeError(
            f"Argument `{name}` must be a column name or a non-empty list of names. "
            f"Received: {name}={columns!r}"
        )
    missing = [column for column in requested if column not in available]
    if missing and available:
        raise ValueError(
            f"Argument `{name}` names column(s) {missing} that the Ray Data shard does not "
            f"have. Received: {name}={columns!r}. The shard has columns {available}."
        )
    return columns if isinstance(columns, str) else requested
