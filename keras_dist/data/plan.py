"""The step arithmetic of `distribute_dataset`: how a strategy lays out replicas over
workers (`Layout`), and every worker's shard, batch and step counts (`Plan`), computed
the same on every worker so that all of them run the same number of steps."""

from __future__ import annotations

import dataclasses

from keras_dist import _runtime

__all__ = ["Layout", "Plan", "layout_of", "plan_for"]


@dataclasses.dataclass(frozen=True)
class Layout:
    num_workers: int
    local_replicas: int
    # MultiWorkerMirrored: per-replica batches through distribute_datasets_from_function.
    from_function: bool


@dataclasses.dataclass(frozen=True)
class Plan:
    worker_batch: int  # examples per worker per step
    batch: int  # examples per element of the per-worker dataset
    batches_per_step: int  # elements of the per-worker dataset one step consumes
    sizes: tuple | None  # every worker's shard size, when known
    batches: tuple | None  # every worker's batch count before equalising
    steps: int | None  # steps per epoch, the same on every worker

    @property
    def needs_padding(self) -> bool:
        return self.batches is not None and any(
            self.steps * self.batches_per_step > count for count in self.batches
        )


def layout_of(strategy) -> Layout:
    import tensorflow as tf

    replicas = int(strategy.num_replicas_in_sync)
    if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        local = len(strategy.extended.worker_devices)
        return Layout(num_workers=_runtime.workers_of(strategy), local_replicas=local,
                       from_function=True)
    return Layout(num_workers=1, local_replicas=replicas, from_function=False)


def plan_for(source, layout: Layout, per_replica: int, drop_remainder: bool) -> Plan:
    worker_batch = per_replica * layout.local_replicas
    if layout.from_function:
        batch, per_step = per_replica, layout.local_replicas
    else:
        batch, per_step = worker_batch, 1
    sizes = source.shard_sizes(layout.num_workers, worker_batch)
    if sizes is None:
        return Plan(worker_batch, batch, per_step, None, None, None)
    if drop_remainder:
        batches = [size // batch for size in sizes]
        steps = min(count // per_step for count in batches)
    else:
        batches = [-(-size // batch) for size in sizes]
        steps = max(-(-count // per_step) for count in batches)
    if steps == 0:
        raise ValueError(
            f"The source has {sum(sizes)} examples, fewer than one global batch "
            f"({worker_batch * layout.num_workers} = per_replica_batch_size {per_replica} x "
            f"{layout.local_replicas * layout.num_workers} replicas), and "
            "drop_remainder=True would leave no step. Lower `per_replica_batch_size` or "
            "set drop_remainder=False."
        )
    return Plan(worker_batch, batch, per_step, tuple(sizes), tuple(batches), steps)
