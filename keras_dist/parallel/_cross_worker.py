"""Data parallelism around a pipeline: each stage's gradients averaged across workers.

tf.distribute cannot host a pipeline as a replica: a `MultiWorkerMirroredStrategy`
replica is one device per worker (`extended.worker_devices` was
`('/job:worker/replica:0/task:0/device:CPU:0',)` with 2 logical CPUs per worker), and in
its scope every stage variable, even one created under `tf.device('/device:CPU:1')`,
became a `MirroredVariable` on CPU:0 (measured on 2 launched workers). So
every worker runs the whole pipeline on its local devices and, before the one optimizer
apply, averages stage s's gradients with stage s on the other workers: one collective
group per stage (members: device s of every worker), over the collective runtime that
`keras_dist.strategy()` starts for the job.
"""

from __future__ import annotations

import tensorflow as tf

# Group keys far from those MultiWorkerMirroredStrategy hands out (it counts from 1).
_GROUP_KEY_BASE = 1_000_000
_INSTANCE_KEY_BASE = 2_000_000


def all_reduce_stage_gradients(grads_per_stage, devices, num_workers: int):
    """Each stage's gradients averaged over `num_workers`, on that stage's device."""
    reduced, instance = [], _INSTANCE_KEY_BASE
    for stage, (grads, device) in enumerate(zip(grads_per_stage, devices)):
        stage_grads = []
        with tf.device(device):
            for grad in grads:
                stage_grads.append(tf.raw_ops.CollectiveReduceV2(
                    input=grad, group_size=num_workers, group_key=_GROUP_KEY_BASE + stage,
                    instance_key=instance, ordering_token=[], merge_op="Add",
                    final_op="Div"))
                instance += 1
        reduced.append(stage_grads)
    return reduced
