"""Fix: Keras's `keras.distribution` has no TensorFlow backend; keras_dist provides it.

keras-team/keras#18473. `keras.distribution` (DeviceMesh, LayoutMap, DataParallel,
ModelParallel) runs on JAX; Keras's TensorFlow `distribution_lib` is a prototype ("DO
NOT USE") without `distribute_data_input`, `num_processes` or variable placement, so on
TensorFlow a distribution is silently ignored or fails. `apply()` plugs in
`keras_dist.distribution` (on `tf.experimental.dtensor`; why: docs/
keras_distribution_engine.md): its device/mesh/layout functions replace the prototype's,
Keras TF variables created under a distribution are stored as DTensor `DVariable`s with
their layout, and `fit`/`evaluate`/`predict` of such a model run each step on the mesh.

Two DTensor defects are contained here (both silent, both measured on 4 virtual CPUs):

* **Read after write.** In a traced function, DTensor does not keep a variable's read
  after its write in order (Keras's `train_step` with Adam and a compiled "mae" metric
  left the weights unchanged, depending on the model's *name*). Every `DVariable.assign*`
  in a traced function computes the new value and forwards it to the variable's later
  reads in the same function: a data dependency instead of an ordering DTensor drops.
* **Random numbers drawn per shard.** A sharded random op draws each device's part from a
  seed mixed with the device id: dropout on a mesh differed from one device (GPT-2, 0.14
  after one step). On a mesh, Keras's TF random functions draw the whole value on every
  device (`keras_dist.distribution.random_ops`): one device's numbers on any mesh.
* **Contracting dimension sharded twice.** A weight sharded along the batch axis (FSDP,
  keras-hub's layouts) is read with that axis gathered; DTensor's matmul expander
  refuses a contracting dimension sharded on the batch axis on one side and another
  axis on the other.

It also tags what a distribution's `distribute_dataset` returns with the input's order
(`keras_dist.data.order.keras_split`): a `tf.data.Dataset` of global batches, which Keras
splits between the processes, has the same global batches on any process count, so
`BackupAndRestore` resumes it mid-epoch on another one. (Keras 3.15 splits it in
`Distribution.distribute_dataset`; the 3.16 nightlies split it in the TF data adapter, not
tagged yet: there such a resume on another process count is refused, as before.)

The probe reads Keras's TensorFlow `distribution_lib`: once it has the functions
`keras.distribution` calls on JAX, keras_dist steps aside (the fix is not applied, and
`keras_dist.compat.applied()` says so).
"""

from __future__ import annotations

import functools

from keras_dist.compat import _distribution_internals as _internals
from keras_dist.compat import _keras_tf, _patch, _probe
from keras_dist.compat._fix import Fix
from keras_dist.distribution import mesh_ops, random_ops

NAME = "keras_distribution_on_tensorflow"
# What keras.distribution calls on a backend (JAX's distribution_lib has each).
_BACKEND_FUNCTIONS = ("list_devices", "get_device_count", "initialize", "num_processes",
                      "process_id", "distribute_tensor", "distribute_data_input",
                      "_to_backend_mesh", "_to_backend_layout")
_PROTOTYPE_MARK = "DO NOT USE"


def _distribution_lib():
    """Keras's TF `distribution_lib` (None on another backend)."""
    if not _keras_tf.uses_tensorflow_backend():
        return None
    return _internals._tf_distribution_lib()


def probe(module=None) -> str:
    """PRESENT while Keras's TF `distribution_lib` lacks what `keras.distribution` calls.

    Static: reads the module (its functions and docstring); runs no TensorFlow op.
    """
    module = module if module is not None else _distribution_lib()
    if module is None:
        return _probe.FIXED  # another backend: nothing to provide
    missing = [name for name in _BACKEND_FUNCTIONS
               if _patch.original(module, name) is None]
    if missing or _PROTOTYPE_MARK in (module.__doc__ or ""):
        return _probe.PRESENT
    return _probe.FIXED


# The read-after-write containment (below). Only tests turn it off: to show that DTensor
# still drops that order in this TensorFlow (tests/test_keras_distribution.py).
forward_written_values = True


def _written() -> dict:
    """Per graph being traced: id(DVariable) -> (variable, the value last assigned to it)."""
    from tensorflow.python.framework import ops

    graph = ops.get_default_graph()
    if not hasattr(graph, "_keras_dist_written"):
        graph._keras_dist_written = {}
    return graph._keras_dist_written


def _assigning(kind: str, assign):
    """`DVariable.assign*` that lays the value out as the variable (a regular tensor, e.g.
    a loaded weight, is placed on the mesh first) and, in a traced function, computes the
    new value itself and forwards it to later reads of the variable."""

    @functools.wraps(assign)
    def wrapper(self, value, use_locking=None, name=None, read_value=True):
        import tensorflow as tf
        from tensorflow.experimental import dtensor

        from keras_dist.distribution import backend

        value = tf.cast(value, self.dtype)
        eager = tf.executing_eagerly()
        value = (backend.distribute_tensor(value, self.layout) if eager
                 else dtensor.relayout(value, self.layout))
        if eager or not forward_written_values:
            return assign(self, value, use_locking=use_locking, name=name,
                          read_value=read_value)
        if kind != "assign":
            # The stored layout, not the compute one: an FSDP weight's update is computed
            # on its shard (its gradient and slots are sharded alike), not gathered.
            current = _stored_read(self, _patch.original(type(self), "_read_variable_op"))
            value = dtensor.relayout(
                current + value if kind == "assign_add" else current - value, self.layout)
        operation = _patch.original(type(self), "assign")(
            self, value, use_locking=use_locking, name=name, read_value=False)
        _written()[id(self)] = (self, value)
        return value if read_value else operation

    return wrapper


def _stored_read(variable, read, no_copy=False):
    """`variable`'s value in its stored layout: the value last written to it in the
    function being traced (forwarded), else a read."""
    import tensorflow as tf

    from keras_dist.distribution import backend

    if tf.executing_eagerly():
        return read(variable, no_copy=no_copy)
    backend.mark_graph(variable.layout.mesh)
    if forward_written_values:
        entry = _written().get(id(variable))
        if entry is not None and entry[0] is variable:
            return tf.identity(entry[1])
    return read(variable, no_copy=no_copy)


def _forwarding_read(read):
    @functools.wraps(read)
    def wrapper(self, no_copy=False):
        from tensorflow.experimental import dtensor

        value = _stored_read(self, read, no_copy)
        compute = getattr(self, "_keras_dist_compute_layout", None)
        return value if compute is None else dtensor.relayout(value, compute)

    return wrapper


def _initializing(initialize):
    @functools.wraps(initialize)
    def wrapper(self, value):
        import tensorflow as tf
        from keras.src.distribution import distribution_lib

        from keras_dist.distribution import variables

        distribution = distribution_lib.distribution()
        if distribution is None or isinstance(value, tf.Variable):
            return initialize(self, value)
        return variables.initialize(self, value, distribution)

    return wrapper


def _making_step_function(kind: str, make):
    """`make_train_function` / `make_test_function`: a model on a mesh gets a step on it.

    (Not `_make_function`: the custom_step_loss_scale fix wraps that one.)
    """

    @functools.wraps(make)
    def wrapper(self, force=False):
        from keras_dist.distribution import training

        distribution = training.distribution_of(self)
        if distribution is None:
            return make(self, force)
        attribute = f"{kind}_function"
        if getattr(self, attribute) is None or force:
            step = self.train_step if kind == "train" else self.test_step
            setattr(self, attribute, training.make_function(self, step, distribution))
        return getattr(self, attribute)

    return wrapper


def _making_predict_function(make):
    @functools.wraps(make)
    def wrapper(self, force=False):
        from keras_dist.distribution import training

        distribution = training.distribution_of(self)
        if distribution is None:
            return make(self, force)
        if self.predict_function is None or force:
            self.predict_function = training.make_predict_function(self, distribution)
        return self.predict_function

    return wrapper


def _calling(call):
    """`Layer.__call__`: an eager call of a model on the mesh with host inputs places them."""

    @functools.wraps(call)
    def wrapper(self, *args, **kwargs):
        from keras_dist.distribution import training

        if training.eager_call_needs_mesh(self, args, kwargs):
            return training.call_on_mesh(call, self, args, kwargs)
        return call(self, *args, **kwargs)

    return wrapper


def _numpy(numpy):
    @functools.wraps(numpy)
    def wrapper(self):
        from keras_dist.distribution import variables

        if getattr(self, "_keras_dist_distribution", None) is not None:
            return variables.full_value(self._value)
        return numpy(self)

    return wrapper


def _array(array):
    @functools.wraps(array)
    def wrapper(self, dtype=None, **kwargs):
        import numpy as np

        from keras_dist.distribution import variables

        if getattr(self, "_keras_dist_distribution", None) is not None:
            return np.asarray(variables.full_value(self._value), dtype=dtype)
        return array(self, dtype, **kwargs)

    return wrapper


def _generating_in_scope(generate):
    """keras-hub `CausalLM.generate`: a model on a mesh samples in its distribution's scope
    (keras-hub places the prompt on the mesh only when a distribution is current: a model
    created in `distribution.scope()` and sampled after it fed DTensor regular tensors)."""

    @functools.wraps(generate)
    def wrapper(self, *args, **kwargs):
        from keras.src.distribution import distribution_lib

        from keras_dist.distribution import training

        distribution = training.distribution_of(self)
        if distribution is None or distribution_lib.distribution() is distribution:
            return generate(self, *args, **kwargs)
        with distribution.scope():
            return generate(self, *args, **kwargs)

    return wrapper


def _recording_input_order(distribute):
    """`Distribution.distribute_dataset` that tags a `tf.data.Dataset` with what it
    promises about its order (`keras_dist.data.order.keras_split`), so `BackupAndRestore`
    can resume it mid-epoch on another process count."""

    @functools.wraps(distribute)
    def wrapper(self, dataset):
        from keras_dist.data import order
        from keras_dist.distribution import backend

        result = distribute(self, dataset)
        recorded = getattr(dataset, "keras_dist_input", None)
        if recorded is None and hasattr(dataset, "element_spec"):
            recorded = order.keras_split(dataset, backend.num_processes(),
                                         bool(getattr(self, "auto_shard_dataset", True)))
        if recorded is not None and getattr(result, "keras_dist_input", None) is None:
            try:
                result.keras_dist_input = recorded
            except AttributeError:  # a dataset type that takes no attributes
                pass
        return result

    return wrapper


def _patch_keras_hub() -> None:
    causal_lm = _internals._keras_hub_causal_lm()
    if causal_lm is not None and getattr(causal_lm.generate, "_keras_dist_fix", None) != NAME:
        _patch.patch(causal_lm, "generate",
                     _generating_in_scope(_patch.original(causal_lm, "generate")), fix=NAME)


def apply_keras_hub() -> None:
    """The keras-hub part, once keras-hub is imported (call it while the fix is applied)."""
    import sys

    if "keras_hub" in sys.modules:
        _patch_keras_hub()


def apply() -> None:
    import keras

    from keras_dist.distribution import backend

    module = _distribution_lib()
    for name in _BACKEND_FUNCTIONS:
        _patch.patch(module, name, getattr(backend, name), fix=NAME)
    d_variable = _internals._d_variable()
    for name in ("assign", "assign_add", "assign_sub"):
        _patch.patch(d_variable, name, _assigning(name, _patch.original(d_variable, name)),
                     fix=NAME)
    _patch.patch(d_variable, "_read_variable_op",
                 _forwarding_read(_patch.original(d_variable, "_read_variable_op")), fix=NAME)
    trainer = _internals._TRAINER()
    for kind in ("train", "test"):
        name = f"make_{kind}_function"
        _patch.patch(trainer, name, _making_step_function(kind, _patch.original(trainer, name)),
                     fix=NAME)
    _patch.patch(trainer, "make_predict_function", _making_predict_function(
        _patch.original(trainer, "make_predict_function")), fix=NAME)
    variable = _internals._tf_core_variable()
    _patch.patch(variable, "numpy", _numpy(_patch.original(variable, "numpy")), fix=NAME)
    _patch.patch(variable, "__array__", _array(_patch.original(variable, "__array__")),
                 fix=NAME)
    _patch.patch(variable, "_initialize",
                 _initializing(_patch.original(variable, "_initialize")), fix=NAME)
    layer = _internals._keras_layer()
    _patch.patch(layer, "__call__", _calling(_patch.original(layer, "__call__")), fix=NAME)
    random = _internals._tf_random()
    for name in random_ops.DRAWING:
        _patch.patch(random, name, random_ops.drawing(_patch.original(random, name)),
                     fix=NAME)
    _patch.patch(random, "dropout", random_ops.dropping(_patch.original(random, "dropout")),
                 fix=NAME)
    for distribution in (_internals.distribution_base(), keras.distribution.DataParallel,
                         keras.distribution.ModelParallel):
        if "distribute_dataset" in vars(distribution):  # 3.15: the base class only
            _patch.patch(distribution, "distribute_dataset", _recording_input_order(
                _patch.original(distribution, "distribute_dataset")), fix=NAME)
    core = _internals._tf_core()
    _patch.patch(core, "slice_update", mesh_ops.updating_slices(
        _patch.original(core, "slice_update")), fix=NAME)
    numpy_ops = _internals._tf_numpy()
    _patch.patch(numpy_ops, "einsum", mesh_ops.einsum_as_one_op(
        _patch.original(numpy_ops, "einsum")), fix=NAME)
    # 3.15 binds `convert_to_numpy` into `keras.src.backend` too (keras.ops calls it there);
    # the 3.16 nightlies call it on the ops module only.
    for module in (core, _internals._keras_module("keras.src.backend")()):
        if _patch.original(module, "convert_to_numpy") is not None:
            _patch.patch(module, "convert_to_numpy", mesh_ops.converting_dtensors(
                _patch.original(module, "convert_to_numpy")), fix=NAME)
    import sys

    if "keras_hub" in sys.modules:
        _patch_keras_hub()


FIX = Fix(
    name=NAME,
    upstream="keras-team/keras#18473",
    summary="keras.distribution (DataParallel, ModelParallel, LayoutMap) on the TensorFlow "
    "backend, on DTensor: variables stored with their layout, steps run on the mesh.",
    symbols=("keras.tensorflow.distribution_lib", "keras.tensorflow.Variable",
             "keras.TFTrainer.make_train_function", "keras.TFTrainer.make_predict_function",
             "keras.Layer.__call__", "tf.dtensor.DVariable", "keras.tensorflow.random",
             "keras.Distribution"),
    probe=probe,
    apply=apply,
)
