"""Keras's own `keras.distribution` API on the TensorFlow backend, on DTensor.

Keras ships `keras.distribution` (DeviceMesh, LayoutMap, DataParallel, ModelParallel) for
JAX; its TensorFlow `distribution_lib` is a prototype (keras-team/keras#18473). After
`import keras_dist`, the same user code runs on TensorFlow: the fix
`keras_distribution_on_tensorflow` (keras_dist.compat) puts this package's functions into
Keras's TF backend once Keras is imported. Variables created under a distribution are
DTensor `DVariable`s stored with their layout (each device keeps its slice), and `fit`,
`evaluate`, `predict` and eager calls run on the mesh. Why DTensor and not an engine of
keras_dist's own: docs/keras_distribution_engine.md.

Nothing here is called directly; use `keras.distribution`. Example (4 virtual CPUs)::

    import keras_dist
    keras_dist.virtual_devices(4, "CPU")      # before TensorFlow starts
    import keras
    from keras import distribution as kd

    mesh = kd.DeviceMesh((2, 2), ["batch", "model"], kd.list_devices())
    layout_map = kd.LayoutMap(mesh)
    layout_map[".*dense.*kernel"] = (None, "model")
    kd.set_distribution(kd.ModelParallel(layout_map=layout_map, batch_dim_name="batch"))
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32)])
    model.compile(optimizer="adam", loss="mse")
    model.fit(x, y, batch_size=16)            # the global batch, split along "batch"
    keras_dist.parallel.shards(model.layers[0].kernel)   # 4 x (device, (16, 16) array)

Multi-worker: every worker calls `keras.distribution.initialize()` before TensorFlow runs an
op; the job comes from TF_CONFIG (`keras-dist launch`, Kubernetes, Slurm, Ray).

Models with no layout map: `keras_dist.distribution.FSDP` shards every large variable (and
its optimizer slots) over the devices, the batch too (keras_dist/distribution/fsdp.py).
"""

__all__ = ["FSDP"]


def __getattr__(name):
    # FSDP subclasses keras.distribution.Distribution: Keras (and TensorFlow) are imported
    # when it is first used, not when keras_dist.distribution is.
    if name == "FSDP":
        from keras_dist.distribution.fsdp import FSDP

        return FSDP
    raise AttributeError(f"module 'keras_dist.distribution' has no attribute {name!r}")
