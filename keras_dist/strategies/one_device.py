"""One-process strategies that answer `cluster_resolver` like the multi-worker one does.

TensorFlow's `MirroredStrategy` and `OneDeviceStrategy` have no cluster resolver
(`strategy.cluster_resolver is None`), while `MultiWorkerMirroredStrategy` always has one,
even in one process (task type and id `None`, empty cluster spec). Code written for
multi-worker training, such as TensorFlow's multi-worker Keras tutorial, reads
`strategy.cluster_resolver.task_type` unconditionally, so the strategy `keras_dist.strategy()`
returns in one process must have one too. `tf.distribute.Strategy.cluster_resolver`'s
documentation invites this: "Strategies that intend to have an associated ClusterResolver
must set the relevant attribute, or override this property". These subclasses override the
property and change nothing else; they keep TensorFlow's class names.
"""

from __future__ import annotations

import tensorflow as tf

from keras_dist.cluster import ClusterConfig

__all__ = ["MirroredStrategy", "OneDeviceStrategy", "cluster_resolver_for"]


def cluster_resolver_for(cluster: ClusterConfig) -> tf.distribute.cluster_resolver.ClusterResolver:
    """The resolver `MultiWorkerMirroredStrategy` would have for this (one-process) cluster.

    With no TF_CONFIG that is an empty cluster spec and `task_type`/`task_id` `None`;
    with a one-worker TF_CONFIG, that worker's spec, type and index.
    """
    return tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec({k: list(v) for k, v in cluster.cluster.items()}),
        task_type=cluster.task_type,
        task_id=cluster.task_index,
        rpc_layer=cluster.rpc_layer if cluster.task_type is not None else None,
    )


class MirroredStrategy(tf.distribute.MirroredStrategy):
    """`tf.distribute.MirroredStrategy` with a `cluster_resolver` (see the module doc)."""

    def __init__(self, devices=None, cross_device_ops=None, *, cluster_resolver=None):
        super().__init__(devices=devices, cross_device_ops=cross_device_ops)
        self._keras_dist_cluster_resolver = cluster_resolver

    @property
    def cluster_resolver(self):
        return self._keras_dist_cluster_resolver


class OneDeviceStrategy(tf.distribute.OneDeviceStrategy):
    """`tf.distribute.OneDeviceStrategy` with a `cluster_resolver` (see the module doc)."""

    def __init__(self, device, *, cluster_resolver=None):
        super().__init__(device)
        self._keras_dist_cluster_resolver = cluster_resolver

    @property
    def cluster_resolver(self):
        return self._keras_dist_cluster_resolver
