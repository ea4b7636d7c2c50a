"""One worker's input pipeline, built by `distribute_dataset` (`data/pipeline.py`).

Two shapes:
    * the global order (`data/order.py`), for shuffled index-able sources: per epoch, the
      worker gathers its part of each global batch, a batch per gather (without map_fn),
      or -> map_fn -> batch; then equalise; the
      epoch comes from the iterator's start (`order.EpochClock`), and with `repeat` the
      stream runs on through the following epochs;
    * a fixed shard per worker, for the other sources: shard -> [cache] -> shuffle ->
      map_fn -> batch -> equalise -> [repeat].
"""

from __future__ import annotations

import dataclasses

from keras_dist.data import order
from keras_dist.data import sources as _data_sources
from keras_dist.data.plan import Layout, Plan

__all__ = ["Settings", "in_global_order", "worker_pipeline"]


@dataclasses.dataclass(frozen=True)
class Settings:
    shuffle: bool
    seed: int
    shuffle_buffer: int | None
    repeat: bool
    map_fn: object
    drop_remainder: bool | None  # None until the layout decides
    cache: bool


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


def worker_pipeline(source, plan: Plan, layout: Layout, worker_index: int,
                     input_context, settings: Settings):
    """This worker's dataset, prefetched, with TensorFlow's auto-sharding off.

    Returns:
        The dataset and the cardinality of one pass (before `repeat`).
    """
    import tensorflow as tf

    # Unshuffled, the fixed blocks of the shard path already are the identity order.
    if settings.shuffle and in_global_order(source, settings):
        dataset, pass_cardinality = _global_order_pipeline(source, plan, layout,
                                                           worker_index, settings)
    else:
        dataset, pass_cardinality = _shard_pipeline(source, plan, layout, worker_index,
                                                    input_context, settings)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = (
        tf.data.experimental.AutoShardPolicy.OFF
    )
    return dataset.prefetch(tf.data.AUTOTUNE).with_options(options), pass_cardinality


def in_global_order(source, settings: Settings) -> bool:
    """Whether the input's global batches follow `data/order.py` (the same for any
    worker count): index-able sources, except shuffled with `cache`, which keeps a fixed
    per-worker shard (the cache holds it)."""
    return source.global_order and not (settings.shuffle and settings.cache)


def _apply_map(dataset, map_fn):
    import tensorflow as tf

    return dataset.map(map_fn, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)


def _equalise(dataset, plan: Plan, layout: Layout, worker_index: int,
              drop_remainder: bool):
    """Gives one batched pass of this worker's examples the plan's step count.

    Returns:
        The pass and whether its cardinality must be hidden from Keras.
    """
    import tensorflow as tf

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
    if plan.batches_per_step > 1:
        # The cardinality counts per-replica batches here, not steps; Keras would run
        # too many steps.
        hide_cardinality = True
    return dataset, hide_cardinality


def _shard_pipeline(source, plan: Plan, layout: Layout, worker_index: int, input_context,
                    settings: Settings):
    """A fixed shard per worker: shard -> [cache] -> shuffle -> map_fn -> batch -> equalise."""
    map_fn, cache, shuffle = settings.map_fn, settings.cache, settings.shuffle
    dataset = source.worker_dataset(layout.num_workers, worker_index, plan.worker_batch,
                                    input_context, shuffle, settings.seed)
    if cache:
        # Cached after map_fn (preprocessing runs once) but before the shuffle: a cache
        # after it would replay the first epoch's order every epoch.
        dataset = (_apply_map(dataset, map_fn) if map_fn is not None else dataset).cache()
    if shuffle:
        shard_size = plan.sizes[worker_index] if plan.sizes else None
        buffer = settings.shuffle_buffer or source.default_shuffle_buffer(shard_size)
        # A fixed seed with reshuffle_each_iteration gives every epoch a new order that
        # is the same in every run; the worker index in the seed decorrelates shards.
        seed = _data_sources.derived_seed(settings.seed, worker_index, 0)
        dataset = dataset.shuffle(buffer, seed=seed, reshuffle_each_iteration=True)
    if map_fn is not None and not cache:
        dataset = _apply_map(dataset, map_fn)
    dataset, hide_cardinality = _equalise(
        dataset.batch(plan.batch, drop_remainder=settings.drop_remainder), plan, layout,
        worker_index, settings.drop_remainder)
    pass_cardinality = int(dataset.cardinality())
    if settings.repeat:
        dataset = dataset.repeat()
    elif hide_cardinality:
        dataset = dataset.filter(lambda *_: True)
    return dataset, pass_cardinality


def _global_order_pipeline(source, plan: Plan, layout: Layout, worker_index: int,
                           settings: Settings):
    """Epoch by epoch in the global order: [start epoch] -> gather -> map_fn -> batch ->
    equalise, for the epoch the iterator starts at (and those after it, with `repeat`)."""
    import tensorflow as tf

    clock = order.EpochClock(plan.steps)

    # Dataset construction only (no Python control flow on tensors): AutoGraph would
    # only warn about the sources' generators.
    @tf.autograph.experimental.do_not_convert
    def one_pass(epoch):
        where = (epoch, layout.num_workers, worker_index, plan.worker_batch, settings.seed)
        if settings.map_fn is None:
            # Whole batches read at once: the per-example work of the seed's pipeline
            # (shuffle, batch) is gone, so the global order costs less per step than it.
            dataset = source.epoch_batches(*where, plan.batch, settings.drop_remainder)
        else:
            dataset = _apply_map(source.epoch_dataset(*where), settings.map_fn).batch(
                plan.batch, drop_remainder=settings.drop_remainder)
        return _equalise(dataset, plan, layout, worker_index, settings.drop_remainder)

    _, hide_cardinality = one_pass(tf.constant(0, tf.int64))  # structure only, not run
    pass_cardinality = plan.steps * plan.batches_per_step
    start = tf.data.Dataset.from_tensors(0).map(
        lambda _: tf.ensure_shape(tf.py_function(clock.start, [], tf.int64), [2]))
    if settings.repeat:
        skip = plan.batches_per_step

        def stream(position):
            epochs = tf.data.Dataset.range(position[0], tf.int64.max)
            return epochs.flat_map(lambda epoch: one_pass(epoch)[0]).skip(position[1] * skip)

        # Said infinite: tf.data cannot see through the flat_map, and with an unknown
        # cardinality a multi-worker iterator all-reduces "has data" every step (7x
        # fewer examples/s on 2 workers, iterator alone).
        return start.flat_map(stream).apply(tf.data.experimental.assert_cardinality(
            tf.data.INFINITE_CARDINALITY)), pass_cardinality
    dataset = start.flat_map(lambda position: one_pass(position[0])[0])
    if hide_cardinality:
        return dataset, pass_cardinality
    return dataset.apply(tf.data.experimental.assert_cardinality(pass_cardinality)), \
        pass_cardinality
