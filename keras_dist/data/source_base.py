"""`Source`: what every input source of `distribute_dataset` implements.

Its own module so that the sources (`sources.py`, `ray_source.py`) and the code that picks
one (`sources.make_source`) depend on it, not on each other.
"""

from __future__ import annotations

# Default shuffle buffer (elements) when the shard size is unknown or the shard is too
# big to hold twice: the value TensorFlow's own guides use.
DEFAULT_SHUFFLE_BUFFER = 10_000


class Source:
    """One kind of input. Subclasses define `shard_sizes` and `worker_dataset`.

    A source whose examples can be read by index sets `global_order = True` and defines
    `epoch_dataset(epoch, num_workers, worker_index, worker_batch, seed)`: the worker's
    examples of one epoch in the global order of `keras_dist/data/order.py`; it may
    override `epoch_batches` where reading a batch at once is cheaper.
    """

    global_order = False
    description = "a source"  # for messages: "arrays", "TFRecord files", ...

    def shard_sizes(self, num_workers: int, worker_batch: int) -> list[int] | None:
        """Each worker's shard size, or None when it is not known without reading."""
        return None

    def default_shuffle_buffer(self, shard_size: int | None) -> int:
        if shard_size is None:
            return DEFAULT_SHUFFLE_BUFFER
        return max(1, min(shard_size, DEFAULT_SHUFFLE_BUFFER))

    def epoch_batches(self, epoch, num_workers: int, worker_index: int, worker_batch: int,
                      seed: int, batch: int, drop_remainder: bool):
        """`epoch_dataset` in batches of `batch` (the pipeline's path without `map_fn`)."""
        return self.epoch_dataset(epoch, num_workers, worker_index, worker_batch,
                                  seed).batch(batch, drop_remainder=drop_remainder)

    def worker_dataset(self, num_workers, worker_index, worker_batch, input_context,
                       shuffle, seed):  # pragma: no cover - abstract
        raise NotImplementedError
