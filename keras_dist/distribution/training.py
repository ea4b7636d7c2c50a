"""`fit`, `evaluate` and `predict` of a model whose variables live on a DTensor mesh.

Keras's TF trainer runs each step under `tf.distribute`; for a model created under a
`keras.distribution` distribution, each batch from Keras's iterator is instead placed on
the mesh (split along the batch axis; on several processes each gives its rows) and
Keras's own step runs in a `tf.function`, on the mesh: DTensor expands it over the
devices, so the loss, metrics and gradients are those of the global batch.
"""

from __future__ import annotations

from keras_dist.distribution import backend


def distribution_of(model):
    """The distribution `model`'s variables were created under, or None."""
    for variable in model.weights:
        distribution = getattr(variable, "_keras_dist_distribution", None)
        if distribution is not None:
            return distribution
    return None


def _batch_shards(distribution) -> int:
    mesh = distribution.device_mesh
    return int(mesh.shape[list(mesh.axis_names).index(distribution.batch_dim_name)])


def _place(data, distribution, training=True):
    """`data` on the mesh, split along the batch axis.

    A batch whose rows the batch axis does not divide is an error in training (the
    gradient is the global batch's); in evaluate/predict on one process (the last, smaller
    batch of a dataset) it is placed whole on every device instead: the same outputs.
    """
    import tensorflow as tf

    shards = _batch_shards(distribution) // backend.num_processes() or 1

    def place(tensor):
        if tensor is None or not isinstance(tensor, (tf.Tensor, tf.Variable)) and not hasattr(
                tensor, "shape"):
            return tensor
        tensor = tf.convert_to_tensor(tensor)
        if tensor.shape.rank == 0:
            return backend.distribute_tensor(tensor, distribution.get_data_layout(()))
        rows = int(tensor.shape[0])
        if rows % shards and not training and backend.num_processes() == 1:
            return backend.replicated(tensor, distribution.device_mesh.backend_mesh)
        if rows % shards:
            mesh = distribution.device_mesh
            where = ("this process's batch" if backend.num_processes() > 1
                     else "the global batch")
            raise ValueError(
                f"A batch of {rows} rows (input of shape {tuple(tensor.shape)}) cannot be "
                f"split along the batch axis {distribution.batch_dim_name!r} of the mesh "
                f"{dict(zip(mesh.axis_names, mesh.shape))}: {where} must be a multiple of "
                f"{shards}. Use a batch_size divisible by {shards} (and drop the last, "
                "smaller batch: `dataset.batch(n, drop_remainder=True)`, or a number of "
                "samples divisible by the batch size).")
        return backend.distribute_data_input(
            tensor, distribution.get_data_layout(tensor.shape), distribution.batch_dim_name)

    return tf.nest.map_structure(place, data)


def _local(outputs):
    """Regular tensors from the step's DTensor outputs: the full (replicated) value."""
    import tensorflow as tf

    def local(value):
        return tf.identity(backend.whole(value)) if backend.is_dtensor(value) else value

    return tf.nest.map_structure(local, outputs)


def _compiled(model, step, distribution):
    """`step(data)` in the distribution's scope, traced unless the model runs eagerly."""
    import tensorflow as tf

    mesh = distribution.device_mesh.backend_mesh

    def one_step(data):
        with distribution.scope(), backend.computing_on(mesh):
            return step(data)

    return one_step if model.run_eagerly else tf.function(one_step, reduce_retracing=True)


def make_function(model, step_function, distribution):
    """Keras's `train_function`/`test_function` contract, each step on the mesh."""
    import tensorflow as tf

    training = step_function == model.train_step
    compiled = _compiled(model, step_function, distribution)

    def function(iterator):
        outputs = None
        for _ in range(model.steps_per_execution):
            try:
                data = next(iterator)
            except (StopIteration, tf.errors.OutOfRangeError):
                if outputs is None:
                    raise StopIteration
                break
            with distribution.scope():
                outputs = compiled(_place(data, distribution, training))
        return _local(outputs)

    return function


def make_predict_function(model, distribution):
    """Keras's `predict_function` contract: a list of batches in, the outputs out."""
    import tensorflow as tf

    compiled = _compiled(model, model.predict_step, distribution)

    def function(batches):
        outputs = [_local(compiled(_place(batch, distribution, training=False)))
                   for batch in batches]
        if len(outputs) == 1:
            return outputs[0]
        return tf.nest.map_structure(lambda *parts: tf.concat(parts, axis=0), *outputs)

    return function


def eager_call_needs_mesh(layer, args, kwargs) -> bool:
    """Whether an eager `layer(...)` call gets host inputs while its weights are on a mesh."""
    from keras_dist.distribution import variables

    if not variables.created:
        return False
    import numpy as np
    import tensorflow as tf

    if not tf.executing_eagerly():
        return False
    inputs = [value for value in tf.nest.flatten((args, kwargs))
              if isinstance(value, (tf.Tensor, np.ndarray))]
    if not inputs or any(backend.is_dtensor(value) for value in inputs
                         if isinstance(value, tf.Tensor)):
        return False
    return distribution_of(layer) is not None


def call_on_mesh(call, layer, args, kwargs):
    """`layer(...)` eagerly on its mesh: the inputs replicated, the outputs whole values."""
    import numpy as np
    import tensorflow as tf
    from tensorflow.experimental import dtensor

    distribution = distribution_of(layer)
    mesh = distribution.device_mesh.backend_mesh

    def place(value):
        if isinstance(value, (tf.Tensor, np.ndarray)):
            return backend.replicated(value, mesh)
        return value

    args, kwargs = tf.nest.map_structure(place, (args, kwargs))
    with distribution.scope(), dtensor.default_mesh(mesh), backend.computing_on(mesh):
        outputs = call(layer, *args, **kwargs)
    return _local(outputs)
