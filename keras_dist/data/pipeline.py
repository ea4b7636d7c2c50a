"""One data entry point for distributed training: `distribute_dataset`.

`distribute_dataset(source, per_replica_batch_size)` builds each worker's input pipeline
(`data/worker_pipeline.py`: its part of each global batch, or its shard, -> map_fn ->
batch -> prefetch) and hands it to the
strategy, returning what `model.fit`, `evaluate` and `predict` consume on the default
strategy, `MirroredStrategy` and `MultiWorkerMirroredStrategy`, with the number of steps
per epoch attached (`steps_per_epoch(data)`).

How the work is split:
    * Across workers, keras_dist splits at the source, before `map_fn`, so each worker
      reads and preprocesses only its 1/N, and TensorFlow's own
      auto-sharding is switched off (it would shard again, or print fallback warnings).
    * Within a worker, the strategy splits a batch across the local devices. On one
      worker keras_dist batches `per_replica * local replicas` examples and uses
      `experimental_distribute_dataset` (which splits each batch in order, so one step
      equals one single-device step on the same global batch, and the dataset's
      cardinality equals the steps). Under `MultiWorkerMirroredStrategy` it uses
      `distribute_datasets_from_function`, whose function receives the worker's
      `InputContext` and batches per replica; this is TensorFlow's path for pipelines
      that are already sharded per worker.

Uneven data (the policy): every worker runs the same number of steps per epoch, because
a worker that stops early leaves the others waiting in a collective for ever.
    * When the global size is known (arrays; datasets of known cardinality), keras_dist
      computes every worker's shard size, and so the steps, on every worker. With
      `drop_remainder=False`, a worker whose shard has one batch fewer gets one empty
      batch at the end (a no-op step), so all report the same cardinality;
      with `drop_remainder=True`, each worker takes exactly `steps` full batches.
    * When it is unknown (TFRecord files, filtered datasets, functions), the per-worker
      cardinality is hidden (made UNKNOWN): Keras then reads until the data runs out,
      and tf.distribute's multi-worker iterator agrees across workers on when that is,
      padding the workers that ran out with empty batches.
    * `drop_remainder=None` means True with `repeat=True` (every step a full global
      batch, static shapes) and False otherwise (no example is dropped), on any number
      of workers, so the steps per epoch do not change with the worker count (a backup
      resumes on another count).

Order, and what each source guarantees:
    * Arrays, dicts/tuples of arrays, pandas frames, and any object with `len()` whose
      `source[i]` is one example (index-able sources): one global order
      (`keras_dist/data/order.py`). Epoch e's order is
      `numpy.random.default_rng([seed, e]).permutation(n)` (`shuffle=True`) or the
      original order, and global step t trains on its t-th global batch: the same
      samples for any number of workers and replicas at a fixed global batch, equal to
      one device with that batch, in both fit forms (one pass per epoch, or
      `repeat=True` with `steps_per_epoch`), and after a restart (in `fit`, the epoch
      is Keras' own, so a resumed run reads the epoch it resumes in). Each worker
      gathers only its part of each global batch (1/N of the examples per epoch).
      `shuffle_buffer` does not apply (the permutation is whole); with `cache=True` the
      source is read as a fixed shard per worker, like the sources below.
    * `tf.data.Dataset`: a fixed shard per worker (`Dataset.shard`, element by element),
      shuffled within the shard with a buffer, anew each epoch: the order depends on the
      worker count. TFRecord files: by file when there are at least as many files as
      workers (the files of a worker are shuffled and interleaved), else by record;
      the order depends on the worker count. Functions: what the function does. Ray
      Data: Ray's split.
    * With `shuffle=False`, `predict` returns predictions in the original order on one
      worker (any number of devices), and on several workers with one replica each for
      arrays (dealt in blocks of one worker batch; `predict` gathers every step in
      worker order); a `tf.data.Dataset` source or workers with several GPUs give every
      prediction but grouped per step by worker/replica.
"""

from __future__ import annotations

import dataclasses

from keras_dist import _runtime, _validation
from keras_dist.data import order
from keras_dist.data import sources as _data_sources
from keras_dist.data.plan import Layout, Plan, layout_of, plan_for
from keras_dist.data.worker_pipeline import Settings, in_global_order, worker_pipeline
from keras_dist.strategies import resolve_strategy

__all__ = ["distribute_dataset", "steps_per_epoch"]


def _check_bool(name: str, value) -> bool:
    return _validation.check_bool(name, value, error=TypeError)


def _check_int(name: str, value, minimum: int) -> int:
    return _validation.check_int(name, value, minimum)


def _check_no_pending_cluster() -> None:
    cluster = _runtime.cluster()
    if cluster.is_multi_worker:
        # Built for one worker, the data would not be sharded and Keras would later
        # split each of its batches across the workers: a smaller global batch, and
        # every worker reading everything.
        raise RuntimeError(
            f"The cluster ({cluster.source}) has {cluster.num_workers} workers, but no "
            "MultiWorkerMirroredStrategy exists yet, so distribute_dataset would build "
            "single-worker input. Call keras_dist.strategy() before distribute_dataset, "
            "or pass `strategy=` explicitly."
        )


def distribute_dataset(
    source,
    per_replica_batch_size: int,
    *,
    strategy=None,
    shuffle: bool = True,
    seed: int = 0,
    shuffle_buffer: int | None = None,
    repeat: bool = False,
    map_fn=None,
    drop_remainder: bool | None = None,
    cache: bool = False,
    feature_columns=None,
    label_columns=None,
):
    """Builds the sharded, shuffled, batched input for distributed `fit`/`evaluate`/`predict`.

    Use it instead of hand-building a `tf.data` pipeline and calling
    `strategy.experimental_distribute_dataset`: each worker reads only its part (of
    each global batch for arrays, so N workers train on one device's batches; else its
    shard), runs `map_fn` on it, batches per replica and prefetches. Every worker gets
    the same steps per epoch, so uneven data never hangs a multi-worker run. Call
    `keras_dist.strategy()` first. The module docstring says what order each source
    guarantees and the uneven-data policy.

    Args:
        source: Arrays, or a tuple `(x, y[, sample_weight])` / dict (nests allowed) of
            them; an object with `len()` and `source[i]` -> one example; a
            `tf.data.Dataset` of unbatched elements; a list of TFRecord paths or a glob
            (serialized records: parse them in `map_fn`); a Ray Data shard (with
            `feature_columns`/`label_columns`); or a function `input_context ->
            tf.data.Dataset` of this worker's unbatched elements (it shards itself).
        per_replica_batch_size: Examples per replica per step (the global batch is this
            times `strategy.num_replicas_in_sync`).
        strategy: Default: the active one, else `keras_dist.strategy()`'s.
        shuffle: Shuffle anew each epoch (arrays: in one global order, by `seed` and
            the epoch; other sources: each worker's shard, by `seed` and the worker).
        seed: Integer >= 0.
        shuffle_buffer: Buffer size for sources read in sequence (arrays are permuted
            whole). Default: 10,000 or the shard size if smaller (`cache=True` arrays:
            the whole shard up to 1 GiB).
        repeat: Repeat for ever (pass `steps_per_epoch=data.steps_per_epoch` to `fit`).
        map_fn: Per-element preprocessing as in `tf.data.Dataset.map` (tuples unpacked
            into arguments), on this worker's shard only.
        drop_remainder: Drop the last partial global batch. Default (None): True with
            `repeat=True`, False otherwise.
        cache: Cache each worker's shard in memory after `map_fn` (before the shuffle).
        feature_columns: Ray Data only (a shard Ray split, not sharded again): the
            feature column(s) (a list makes `x` a dict), as Ray's `DataIterator.to_tf`.
        label_columns: Ray Data only: the label column(s).

    Returns:
        A `tf.distribute.DistributedDataset` (a `tf.data.Dataset` on TF's default
        strategy) with `steps_per_epoch` (the same on every worker; None when unknown:
        files, functions). `class_weight` does not apply: weight in the source.

    Raises:
        ValueError: A bad number (`per_replica_batch_size` < 1, `seed` < 0,
            `shuffle_buffer` < 1); arrays of different lengths or none; an empty nest; a
            glob matching nothing or a missing file; `drop_remainder=True` leaving no
            step; a Ray Data source without a named column (its columns are listed).
        TypeError: An unsupported `source`, a `map_fn` that is not callable, a flag that
            is not a bool, or `feature_columns`/`label_columns` for a non-Ray source.
        RuntimeError: `strategy` is None in a multi-worker cluster before
            `keras_dist.strategy()`.

    Example:
        >>> import keras, keras_dist, numpy as np
        >>> x, y = np.random.rand(1000, 8), np.random.rand(1000, 1)
        >>> with keras_dist.strategy().scope():
        ...     model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
        ...     model.compile(optimizer="sgd", loss="mse")
        >>> data = keras_dist.distribute_dataset((x, y), per_replica_batch_size=32)
        >>> history = model.fit(data, epochs=2, verbose=0)
    """
    per_replica_batch_size = _check_int("per_replica_batch_size", per_replica_batch_size, 1)
    settings = _checked_settings(shuffle, seed, shuffle_buffer, repeat, map_fn,
                                 drop_remainder, cache)
    source = _data_sources.make_source(source, feature_columns, label_columns)
    return _build(source, per_replica_batch_size, settings, strategy)


def _build(source, per_replica_batch_size, settings, strategy):
    """`distribute_dataset` once its arguments are checked."""
    explicit_strategy = strategy is not None
    strategy = resolve_strategy(strategy)
    layout = layout_of(strategy)
    if not explicit_strategy and not layout.from_function:
        _check_no_pending_cluster()
    if settings.drop_remainder is None:
        settings = dataclasses.replace(
            settings, drop_remainder=settings.repeat)
    plan = plan_for(source, layout, per_replica_batch_size, settings.drop_remainder)
    data, pass_cardinality = _distribute(strategy, source, plan, layout, settings)
    steps = plan.steps
    if steps is None and pass_cardinality is not None and pass_cardinality >= 0:
        # One worker: one pass's cardinality is the steps, when tf.data knows it.
        steps = pass_cardinality
    data.steps_per_epoch = steps
    data.keras_dist_input = order.InputOrder(
        global_order=in_global_order(source, settings),
        global_batch=plan.worker_batch * layout.num_workers, source=source.description)
    return data


def _checked_settings(shuffle, seed, shuffle_buffer, repeat, map_fn, drop_remainder,
                      cache) -> Settings:
    """The pipeline settings, each argument checked (`drop_remainder` may stay None)."""
    seed = _check_int("seed", seed, 0)
    if shuffle_buffer is not None:
        shuffle_buffer = _check_int("shuffle_buffer", shuffle_buffer, 1)
    for name, value in (("shuffle", shuffle), ("repeat", repeat), ("cache", cache)):
        _check_bool(name, value)
    if drop_remainder is not None:
        _check_bool("drop_remainder", drop_remainder)
    if map_fn is not None and not callable(map_fn):
        raise TypeError(
            "Argument `map_fn` must be a function applied to each element, or None. "
            f"Received: map_fn={map_fn!r}"
        )
    return Settings(shuffle=shuffle, seed=seed, shuffle_buffer=shuffle_buffer,
                     repeat=repeat, map_fn=map_fn, drop_remainder=drop_remainder,
                     cache=cache)


def _distribute(strategy, source, plan: Plan, layout: Layout, settings: Settings):
    """Hands each worker's pipeline to the strategy: (distributed data, one pass's
    cardinality on one worker, or None)."""
    import tensorflow as tf

    if layout.from_function:
        def dataset_fn(input_context):
            if input_context.num_input_pipelines != layout.num_workers:
                raise RuntimeError(
                    f"tf.distribute reports {input_context.num_input_pipelines} input "
                    f"pipelines but keras_dist counted {layout.num_workers} workers."
                )
            dataset, _ = worker_pipeline(source, plan, layout,
                                          input_context.input_pipeline_id, input_context,
                                          settings)
            return dataset

        return strategy.distribute_datasets_from_function(dataset_fn), None
    input_context = tf.distribute.InputContext(
        num_input_pipelines=1, input_pipeline_id=0,
        num_replicas_in_sync=strategy.num_replicas_in_sync,
    )
    dataset, pass_cardinality = worker_pipeline(source, plan, layout, 0, input_context,
                                                 settings)
    return strategy.experimental_distribute_dataset(dataset), pass_cardinality


def steps_per_epoch(dataset) -> int | None:
    """The steps of one epoch of `dataset`, the same on every worker.

    Use it to pass `steps_per_epoch=` to `fit` for a dataset made with `repeat=True`.

    Args:
        dataset: What `distribute_dataset` returned, or any `tf.data.Dataset` of batches.

    Returns:
        The number of steps, or None when it is unknown (or the dataset is infinite).

    Raises:
        TypeError: `dataset` is neither a keras_dist dataset nor a `tf.data.Dataset`.

    Example:
        >>> data = keras_dist.distribute_dataset((x, y), 32, repeat=True)
        >>> model.fit(data, epochs=3, steps_per_epoch=keras_dist.steps_per_epoch(data))
    """
    if hasattr(dataset, "steps_per_epoch"):
        return dataset.steps_per_epoch
    import tensorflow as tf

    if isinstance(dataset, tf.data.Dataset):
        cardinality = int(dataset.cardinality())
        return cardinality if cardinality >= 0 else None
    raise TypeError(
        "Argument `dataset` must come from keras_dist.distribute_dataset or be a "
        f"tf.data.Dataset. Received: {type(dataset).__name__}"
    )
