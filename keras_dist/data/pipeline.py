"""One data entry point for distributed training: `distribute_dataset`.

`distribute_dataset(source, per_replica_batch_size)` builds each worker's input pipeline
(shard at the source -> shuffle -> map_fn -> batch -> prefetch) and hands it to the
strategy, returning what `model.fit`, `evaluate` and `predict` consume on the default
strategy, `MirroredStrategy` and `MultiWorkerMirroredStrategy`, with the number of steps
per epoch attached (`steps_per_epoch(data)`).

How the work is split:
    * Across workers, keras_dist shards at the source, before shuffle and `map_fn`, so
      each worker reads, holds and preprocesses only its 1/N, and TensorFlow's own
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
    * `drop_remainder=None` means True for multi-worker training with `repeat=True`
      (every step a full global batch, static shapes) and False otherwise (no example
      is dropped).

Order: the shard of each worker is fixed; the order within it is shuffled anew each epoch
(the same sequence of orders in every run with the same `seed`). With `shuffle=False`,
`predict` returns predictions in the original order on one worker (any number of
devices). On several workers with one replica each (CPU or one GPU per worker), arrays
are dealt in blocks of one worker batch, so `predict` (which gathers every step in worker
order) returns the original order on every worker; a `tf.data.Dataset` source, dealt
element by element (`shard`), or workers with several GPUs, give every prediction but
grouped per step by worker/replica.
"""

from __future__ import annotations

import dataclasses

from keras_dist import _runtime, _validation
from keras_dist.data import sources as _data_sources
from keras_dist.data.plan import Layout, Plan, layout_of, plan_for
from keras_dist.strategies import resolve_strategy

__all__ = ["distribute_dataset", "steps_per_epoch"]


@dataclasses.dataclass(frozen=True)
class _Settings:
    shuffle: bool
    seed: int
    shuffle_buffer: int | None
    repeat: bool
    map_fn: object
    drop_remainder: bool | None  # None until the layout decides
    cache: bool


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


def _empty_batch(element_spec):
    """A batch with 0 examples and the dataset's structure, or None if not buildable."""
    import tensorflow as tf

    specs = tf.nest.flatten(element_spec)
    if not all(type(spec) is tf.TensorSpec and spec.shape.rank for spec in specs):
        return None
    return tf.nest.map_structure(
        lambda spec: tf.zeros([0] + [dim or 0 for dim in spec.shape.as_list()[1:]],
                              spec.dtype),
        element_spec,
    )


def _worker_pipeline(source, plan: Plan, layout: Layout, worker_index: int,
                     input_context, settings: _Settings):
    """This worker's dataset: shard -> [cache] -> shuffle -> map_fn -> batch -> equalise.

    Returns:
        The dataset and the cardinality of one pass (before `repeat`).
    """
    import tensorflow as tf

    map_fn, cache, shuffle = settings.map_fn, settings.cache, settings.shuffle
    dataset = source.worker_dataset(layout.num_workers, worker_index, plan.worker_batch,
                                    input_context, shuffle, settings.seed)

    def apply_map(ds):
        return ds.map(map_fn, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)

    if cache:
        # Cached after map_fn (preprocessing runs once) but before the shuffle: a cache
        # after it would replay the first epoch's order every epoch.
        dataset = (apply_map(dataset) if map_fn is not None else dataset).cache()
    if shuffle:
        shard_size = plan.sizes[worker_index] if plan.sizes else None
        buffer = settings.shuffle_buffer or source.default_shuffle_buffer(shard_size)
        # A fixed seed with reshuffle_each_iteration gives every epoch a new order that
        # is the same in every run; the worker index in the seed decorrelates shards.
        seed = _data_sources.derived_seed(settings.seed, worker_index, 0)
        dataset = dataset.shuffle(buffer, seed=seed, reshuffle_each_iteration=True)
    if map_fn is not None and not cache:
        dataset = apply_map(dataset)
    drop_remainder = settings.drop_remainder
    dataset = dataset.batch(plan.batch, drop_remainder=drop_remainder)
    hide_cardinality = layout.num_workers > 1 and plan.steps is None
    if plan.steps is not None:
        if drop_remainder:
            dataset = dataset.take(plan.steps * plan.batches_per_step)
        elif plan.needs_padding:
            # Decided from the element spec, the same on every worker, so all workers
            # either pad or hide their cardinality together.
            empty = _empty_batch(dataset.element_spec)
            missing = plan.steps * plan.batches_per_step - plan.batches[worker_index]
            if empty is None:
                hide_cardinality = True
            elif missing:
                dataset = dataset.concatenate(tf.data.Dataset.from_tensors(empty).repeat(missing))
    pass_cardinality = int(dataset.cardinality())
    if plan.batches_per_step > 1:
        # The cardinality counts per-replica batches here, not steps; Keras would run
        # too many steps.
        hide_cardinality = True
    if settings.repeat:
        dataset = dataset.repeat()
    elif hide_cardinality:
        dataset = dataset.filter(lambda *_: True)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = (
        tf.data.experimental.AutoShardPolicy.OFF
    )
    return dataset.prefetch(tf.data.AUTOTUNE).with_options(options), pass_cardinality


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
    `strategy.experimental_distribute_dataset`: each worker reads only its own shard
    (arrays sliced in NumPy, `Dataset.shard`, or TFRecord files by file when there are at
    least as many as workers, else by record), shuffles it with a seed of its own, runs
    `map_fn` on it, batches `per_replica_batch_size` per replica and prefetches. Every
    worker gets the same number of steps per epoch, so uneven data never hangs a
    multi-worker run. Call `keras_dist.strategy()` first. The module docstring describes
    the uneven-data policy and the order of examples (per epoch, and of `predict`).

    Args:
        source: NumPy arrays, or a tuple `(x, y)` / `(x, y, sample_weight)` / dict (nests
            allowed) of equally long arrays; a `tf.data.Dataset` of unbatched elements;
            a list of TFRecord paths or a glob (elements are serialized records: parse
            them in `map_fn`); a Ray Data shard (with `feature_columns`/`label_columns`);
            or a function `input_context -> tf.data.Dataset` of this worker's unbatched
            elements (it shards itself by `input_context.input_pipeline_id`).
        per_replica_batch_size: Examples per replica per step (the global batch is this
            times `strategy.num_replicas_in_sync`).
        strategy: Default: the active one, else `keras_dist.strategy()`'s.
        shuffle: Shuffle each worker's shard, anew each epoch.
        seed: Integer >= 0; with the worker index it seeds the shuffles.
        shuffle_buffer: Shuffle buffer size. Default: arrays, the whole shard (up to 1
            GiB); other sources, 10,000 (or the shard size if smaller).
        repeat: Repeat for ever (pass `steps_per_epoch=data.steps_per_epoch` to `fit`).
        map_fn: Per-element preprocessing as in `tf.data.Dataset.map` (tuples unpacked
            into arguments), on this worker's shard only.
        drop_remainder: Drop the last partial global batch. Default (None): True for
            multi-worker training with `repeat=True`, False otherwise.
        cache: Cache each worker's shard in memory after `map_fn` (before the shuffle).
        feature_columns: Ray Data only (a shard Ray split, not sharded again): the
            feature column(s) (a list makes `x` a dict), as Ray's `DataIterator.to_tf`.
        label_columns: Ray Data only: the label column(s).

    Returns:
        On TensorFlow's default strategy a `tf.data.Dataset`, else a
        `tf.distribute.DistributedDataset` (this worker's batches, per replica), with
        `steps_per_epoch`: the steps of one epoch (the same on every worker), or None when
        unknown (files, functions). `class_weight` does not apply: weight in the source.

    Raises:
        ValueError: A bad number (`per_replica_batch_size` < 1, `seed` < 0,
            `shuffle_buffer` < 1); arrays of different lengths or none; an empty nest; a
            glob matching nothing or a missing file; `drop_remainder=True` leaving no
            step; a Ray Data source without a named column (its columns are listed).
        TypeError: An unsupported `source`, a `map_fn` that is not callable, a flag that
            is not a bool, or `feature_columns`/`label_columns` for a non-Ray source.
        RuntimeError: `strategy` is None under a multi-worker environment before
            `keras_dist.strategy()` created the multi-worker strategy.

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
            settings, drop_remainder=settings.repeat and layout.num_workers > 1)
    plan = plan_for(source, layout, per_replica_batch_size, settings.drop_remainder)
    data, pass_cardinality = _distribute(strategy, source, plan, layout, settings)
    steps = plan.steps
    if steps is None and pass_cardinality is not None and pass_cardinality >= 0:
        # One worker: one pass's cardinality is the steps, when tf.data knows it.
        steps = pass_cardinality
    data.steps_per_epoch = steps
    return data


def _checked_settings(shuffle, seed, shuffle_buffer, repeat, map_fn, drop_remainder,
                      cache) -> _Settings:
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
    return _Settings(shuffle=shuffle, seed=seed, shuffle_buffer=shuffle_buffer,
                     repeat=repeat, map_fn=map_fn, drop_remainder=drop_remainder,
                     cache=cache)


def _distribute(strategy, source, plan: Plan, layout: Layout, settings: _Settings):
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
            dataset, _ = _worker_pipeline(source, plan, layout,
                                          input_context.input_pipeline_id, input_context,
                                          settings)
            return dataset

        return strategy.distribute_datasets_from_function(dataset_fn), None
    input_context = tf.distribute.InputContext(
        num_input_pipelines=1, input_pipeline_id=0,
        num_replicas_in_sync=strategy.num_replicas_in_sync,
    )
    dataset, pass_cardinality = _worker_pipeline(source, plan, layout, 0, input_context,
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
