"""The global sample order: the same global batches for any number of workers.

For an index-able source (arrays, a dict/tuple of arrays, a pandas frame) of `n` examples
with global batch `G` (per-replica batch x all replicas):

* Epoch `e`'s order is `numpy.random.default_rng([seed, e]).permutation(n)` with
  `shuffle=True`, and `0 .. n-1` with `shuffle=False`. It depends on `seed` and `e` only:
  not on the worker count, the replica count, the fit form or a restart.
* Global step `t` of the epoch trains on positions `[t*G, (t+1)*G)` of that order; the
  last, partial global batch (if any) on the rest.
* Worker `w`, whose batch is `b = per_replica x its replicas`, reads positions
  `[t*G + w*b, t*G + (w+1)*b)` of each full step (its devices split those in order) and an
  even, in-order share of the last partial one. It reads nothing else: each worker gathers
  1/N of the examples per epoch, as with a fixed shard.

So N workers with global batch G see, step by step, the samples one device sees with batch
G, and a backup written by N workers resumes on M at the next unseen global batch.

Which epoch an iterator starts at (`EpochClock`): inside `model.fit`, the epoch Keras is in
(`fit_began_epoch`, published by the compat fix `input_epoch` from Keras' epoch loop, so a
run resumed at epoch 7 reads epoch 7's order); with `repeat=True` the stream then runs on
through epochs e+1, e+2, ... Outside `fit` (a custom loop iterating the dataset), and
under legacy Keras 2 (`tf_keras`, whose fit keras_dist does not patch), each new iterator
starts the next epoch of the dataset's own count, from 0: the same across worker counts,
but a resumed legacy run restarts at epoch 0's order.
"""

from __future__ import annotations

import dataclasses
import threading

import numpy as np

__all__ = [
    "EpochClock", "InputOrder", "array_shard_indices", "epoch_order", "fit_began",
    "fit_began_epoch", "fit_ended", "fit_input", "fit_position", "iterating", "keras_split",
    "shard_sizes_by_element", "shard_sizes_in_order", "worker_indices",
]



@dataclasses.dataclass(frozen=True)
class InputOrder:
    """What a `distribute_dataset` input promises about its order (kept in backups).

    Attributes:
        global_order: The global batches are the same for any worker count.
        global_batch: Examples per step over all replicas.
        source: The kind of source, for messages ("arrays", "TFRecord files", ...).
    """

    global_order: bool
    global_batch: int
    source: str

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, value) -> "InputOrder | None":
        if not isinstance(value, dict):
            return None
        try:
            return cls(bool(value["global_order"]), int(value["global_batch"]),
                       str(value["source"]))
        except (KeyError, TypeError, ValueError):
            return None


_lock = threading.Lock()
# (epoch, Keras steps per epoch or None) of the fit in progress in this process, or None.
_fit: tuple[int, int | None] | None = None
# The input of the newest Keras epoch iterator, and the training input of the fit.
_last_iterated: InputOrder | None = None


def iterating(dataset) -> None:
    """Keras made an epoch iterator over `dataset` (fit's is made before its callbacks
    start; validation's only after the first epoch)."""
    global _last_iterated
    with _lock:
        _last_iterated = getattr(dataset, "keras_dist_input", None)


def keras_split(dataset, num_processes: int, auto_shard: bool) -> InputOrder:
    """What a `tf.data.Dataset` input promises when a `keras.distribution` distribution
    feeds it: Keras splits each global batch between the processes (`rebatch` to the
    process's rows, then every process takes its own piece of each global batch), so the
    global batches are the dataset's own, on any process count; unless each process
    batches its own data (`auto_shard_dataset=False` on several processes).
    """
    import tensorflow as tf

    specs = tf.nest.flatten(dataset.element_spec)
    shape = getattr(specs[0], "shape", None) if specs else None
    batch = shape[0] if shape is not None and shape.rank else None
    if batch is None:
        return InputOrder(False, 0, "a tf.data.Dataset whose batch size is not fixed (batch "
                          "it with drop_remainder=True)")
    if num_processes > 1 and not auto_shard:
        return InputOrder(False, int(batch) * num_processes, "a tf.data.Dataset each process "
                          "batches on its own (auto_shard_dataset=False)")
    return InputOrder(True, int(batch), "a tf.data.Dataset of global batches, split between "
                      "the processes by keras.distribution")


def fit_began() -> InputOrder | None:
    """A fit is starting: its training input (None if not from `distribute_dataset`)."""
    global _last_iterated
    with _lock:
        found, _last_iterated = _last_iterated, None
        return found


def fit_input(model) -> InputOrder | None:
    """The training input of `model`'s fit in progress, as `fit_began` found it."""
    return getattr(model, "_keras_dist_input", None)


def fit_began_epoch(epoch: int, steps: int | None) -> None:
    """Keras' fit loop is starting `epoch` (of `steps` steps, if known)."""
    global _fit
    with _lock:
        _fit = (int(epoch), int(steps) if steps else None)


def fit_ended() -> None:
    global _fit
    with _lock:
        _fit = None


def fit_position() -> tuple[int, int | None] | None:
    with _lock:
        return _fit


def shard_sizes_by_element(num_examples: int, num_workers: int) -> list[int]:
    """Sizes of `Dataset.shard(num_workers, w)` for every worker w."""
    base, extra = divmod(num_examples, num_workers)
    return [base + (1 if w < extra else 0) for w in range(num_workers)]


def shard_sizes_in_order(num_examples: int, num_workers: int, worker_batch: int) -> list[int]:
    """Every worker's examples per epoch when dealt as `array_shard_indices` deals them."""
    tails = shard_sizes_by_element(num_examples % (num_workers * worker_batch), num_workers)
    full = num_examples // (num_workers * worker_batch) * worker_batch
    return [full + tail for tail in tails]


def array_shard_indices(num_examples: int, num_workers: int, worker_index: int,
                        worker_batch: int) -> np.ndarray:
    """The positions (of an epoch's order) worker `worker_index` reads, in order.

    Whole steps are dealt in blocks of one worker batch (step s of worker w is positions
    `[s*G + w*b, s*G + (w+1)*b)`, G = b * num_workers), and the last partial global batch
    is split as evenly as possible, in order. So all workers have the same number of
    batches unless fewer examples than workers are left over, and a multi-worker
    `predict` (which gathers step by step in worker order) returns the predictions in
    the order of the epoch.
    """
    global_batch = worker_batch * num_workers
    full_steps, remainder = divmod(num_examples, global_batch)
    blocks = (np.arange(full_steps)[:, None] * global_batch + worker_index * worker_batch
              + np.arange(worker_batch)).ravel()
    tails = shard_sizes_by_element(remainder, num_workers)
    start = full_steps * global_batch + sum(tails[:worker_index])
    return np.concatenate([blocks, np.arange(start, start + tails[worker_index])]).astype(
        np.int64)


def epoch_order(num_examples: int, epoch: int, seed: int) -> np.ndarray:
    """Epoch `epoch`'s global order of the example indices (shuffled)."""
    return np.random.default_rng([int(seed), int(epoch)]).permutation(num_examples)


def worker_indices(num_examples: int, num_workers: int, worker_index: int,
                   worker_batch: int, epoch: int, seed: int, shuffle: bool = True
                   ) -> np.ndarray:
    """The example indices worker `worker_index` reads in `epoch`, in training order."""
    positions = array_shard_indices(num_examples, num_workers, worker_index, worker_batch)
    if not shuffle:
        return positions
    return epoch_order(num_examples, epoch, seed)[positions].astype(np.int64)


class EpochClock:
    """Where a new iterator of one worker's pipeline starts: `(epoch, steps to skip)`.

    Args:
        data_steps: The steps of one epoch of the data (the same on every worker).
    """

    def __init__(self, data_steps: int):
        self.data_steps = int(data_steps)
        self._lock = threading.Lock()
        self._passes = 0

    def start(self) -> np.ndarray:
        """Called once per iterator, when its pipeline starts (see the module doc)."""
        fit = fit_position()
        if fit is None:
            with self._lock:
                epoch, self._passes = self._passes, self._passes + 1
            return np.array([epoch, 0], np.int64)
        epoch, keras_steps = fit
        if not keras_steps or keras_steps == self.data_steps:
            return np.array([epoch, 0], np.int64)
        # fit(steps_per_epoch=S) over a repeated dataset: the stream is continuous, so
        # Keras' epoch e starts e*S global batches into it.
        return np.array(divmod(epoch * keras_steps, self.data_steps), np.int64)
