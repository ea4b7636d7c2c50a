"""The registry's entries for `keras.distribution` on TensorFlow (keras_distribution fix).

Split from `keras_dist.compat._internals` (the checks, the other entries): the private
Keras/TensorFlow symbols the DTensor engine (`keras_dist.distribution`) patches or reads.
"""

from __future__ import annotations

from keras_dist.compat._internals import (_TRAINER, Internal, _all, _attribute,
                                          _code_mentions, _keras_module)


# keras.distribution on TensorFlow (the keras_distribution_on_tensorflow fix).
def _tf_distribution_lib():
    return _keras_module("keras.src.backend.tensorflow.distribution_lib")()


def _tf_core_variable():
    """The TF backend's Variable class: the one that defines `_initialize` in the MRO of
    `keras.src.backend.Variable` (`tensorflow.core.Variable` in 3.15, `tensorflow.ops.
    core.Variable` renamed to `keras.src.backend.Variable` in the 3.16 nightlies)."""
    variable = _keras_module("keras.src.backend")().Variable
    for cls in variable.__mro__:
        if "_initialize" in vars(cls) and not cls.__module__.startswith(
                "keras.src.backend.common"):
            return cls
    return None


def _keras_layer():
    return _keras_module("keras.src.layers.layer")().Layer


def _d_variable():
    return _keras_module("tensorflow.dtensor.python.d_variable")().DVariable


def _name_scope_stack():
    """Keras's stack of open name scopes (each with the `caller` that opened it)."""
    from keras.src.backend.common import global_state

    return global_state.get_global_attribute("name_scope_stack", default=[]) or []


def creating_optimizer_variable() -> bool:
    """Whether the variable being created belongs to an optimizer (a slot, a counter):
    Keras's `Optimizer.add_variable` creates it in `name_scope(self.name, caller=self)`."""
    from keras.src.optimizers.base_optimizer import BaseOptimizer

    return any(isinstance(getattr(scope, "caller", None), BaseOptimizer)
               for scope in _name_scope_stack())


def _keras_hub_causal_lm():
    """keras-hub's `CausalLM` (None without keras-hub)."""
    import importlib

    try:
        return importlib.import_module("keras_hub.src.models.causal_lm").CausalLM
    except ImportError:
        return None


def _tf_ops_module(name: str):
    """The TF backend's `core` / `numpy` ops module (`keras.src.backend.tensorflow.<name>`
    in 3.15, `keras.src.backend.tensorflow.ops.<name>` in the 3.16 nightlies)."""
    import importlib

    try:
        return importlib.import_module(f"keras.src.backend.tensorflow.ops.{name}")
    except ImportError:
        return importlib.import_module(f"keras.src.backend.tensorflow.{name}")


def _tf_core():
    return _tf_ops_module("core")


def _tf_numpy():
    return _tf_ops_module("numpy")


def _tf_random():
    return _keras_module("keras.src.backend.tensorflow.random")()


def distribution_base():
    """Keras's `Distribution` class (3.15 exports it only from `keras.src`)."""
    import keras

    public = getattr(keras.distribution, "Distribution", None)
    if public is not None:
        return public
    return _keras_module("keras.src.distribution.distribution_lib")().Distribution


_DISTRIBUTION_INTERNALS = (
    Internal(
        "keras.tensorflow.distribution_lib",
        "Its device, mesh and layout functions are replaced by keras_dist.distribution's "
        "(Keras's are a prototype); keras.distribution calls them through this module.",
        ("distribution",), "the module imports and `keras.distribution` still calls "
        "`distribution_lib._to_backend_mesh`",
        _all(_attribute(_tf_distribution_lib, "_to_backend_mesh"),
             _code_mentions(lambda: _keras_module(
                 "keras.src.distribution.distribution_lib")().DeviceMesh, "backend_mesh",
                 r"distribution_lib\._to_backend_mesh\("))),
    Internal(
        "keras.tensorflow.Variable",
        "`_initialize` stores a variable created under a distribution as a DTensor "
        "DVariable with its layout; `numpy` and `__array__` return its whole value "
        "(saving writes full values).",
        ("distribution",), "attribute lookups on the TF backend's Variable class",
        _all(_attribute(_tf_core_variable, "_initialize"),
             _attribute(_tf_core_variable, "numpy"),
             _attribute(_tf_core_variable, "__array__"))),
    Internal(
        "keras.TFTrainer.make_train_function",
        "With make_test_function: a model whose variables live on a mesh runs each "
        "fit/evaluate step on it (the step stored as `train_function`/`test_function`).",
        ("distribution",), "attribute lookups on the TF trainer class; it still sets "
        "`self.train_function`",
        _all(_attribute(_TRAINER, "make_test_function"),
             _code_mentions(_TRAINER, "make_train_function", r"self\.train_function ="))),
    Internal(
        "keras.TFTrainer.make_predict_function",
        "A model whose variables live on a mesh runs each predict step on it.",
        ("distribution",), "attribute lookup on the TF trainer class",
        _attribute(_TRAINER, "make_predict_function")),
    Internal(
        "keras.Layer.__call__",
        "An eager call of a model on a mesh places host inputs on the mesh.",
        ("distribution",), "attribute lookup on keras.layers.Layer",
        _attribute(_keras_layer, "__call__")),
    Internal(
        "tf.dtensor.DVariable",
        "Its assign/assign_add/assign_sub/_read_variable_op forward a value written in a "
        "traced step to the later reads (DTensor drops that order).",
        ("distribution",), "attribute lookups on tensorflow.dtensor.python.d_variable",
        _all(*(_attribute(_d_variable, name) for name in (
            "assign", "assign_add", "assign_sub", "_read_variable_op")))),
    Internal(
        "keras.tensorflow.random",
        "Its random functions (normal, uniform, dropout, categorical, ...) draw the whole "
        "value on every device of a mesh, so random numbers equal one device's.",
        ("distribution",), "attribute lookups on keras.src.backend.tensorflow.random",
        _all(*(_attribute(_tf_random, name) for name in (
            "normal", "uniform", "truncated_normal", "randint", "categorical", "shuffle",
            "gamma", "binomial", "beta", "dropout")))),
    Internal(
        "keras.tensorflow.core.slice_update",
        "On a mesh, computed as a select with the padded update: DTensor cannot lay out "
        "XLA's DynamicUpdateSlice (keras-hub's KV cache, its samplers).",
        ("distribution",), "attribute lookup on keras.src.backend.tensorflow.core",
        _attribute(_tf_core, "slice_update")),
    Internal(
        "keras.tensorflow.numpy.einsum / backend.convert_to_numpy",
        "On a mesh, einsum is one Einsum op (Keras's transpose+matmul rewrite cannot be "
        "expanded by DTensor); convert_to_numpy of a DTensor returns its whole value.",
        ("distribution",), "attribute lookups on the TF backend's ops modules (also patched "
        "in keras.src.backend where it binds convert_to_numpy, as 3.15 does)",
        _all(_attribute(_tf_numpy, "einsum"), _attribute(_tf_core, "convert_to_numpy"))),
    Internal(
        "keras_hub.CausalLM.generate",
        "Wrapped: a model on a mesh samples in its distribution's scope (keras-hub places "
        "the prompt on the mesh only under a current distribution). Absent keras-hub: "
        "nothing to wrap.",
        ("distribution",), "keras-hub absent, or the class still has `generate` and it "
        "still distributes its inputs through `distribution_lib.distribution()`",
        lambda: None if _keras_hub_causal_lm() is None else _code_mentions(
            _keras_hub_causal_lm, "generate", r"distribution_lib\.distribution\(\)")()),
    Internal(
        "keras.name_scope_stack / BaseOptimizer.add_variable",
        "An optimizer's variables (created in `name_scope(optimizer.name, caller=optimizer)`)"
        " are read as stored: FSDP's update runs on the shards, not on gathered slots.",
        ("distribution",), "`BaseOptimizer.add_variable` still opens a name scope with "
        "`caller=self`",
        _code_mentions(lambda: _keras_module("keras.src.optimizers.base_optimizer")()
                       .BaseOptimizer, "add_variable", r"name_scope\(self\.name, caller=self\)")),
    Internal(
        "keras.Distribution",
        "keras_dist.distribution.FSDP subclasses it (not exported by keras.distribution "
        "in 3.15); keras.distribution.set_distribution and the backend read its "
        "device_mesh, batch_dim_name and get_*_layout; where it defines distribute_dataset "
        "(3.15: it splits a tf.data.Dataset's global batches between the processes; the "
        "3.16 nightlies moved that into the data adapter) the result is tagged with that "
        "order for BackupAndRestore.",
        ("distribution",), "the class resolves and still declares get_variable_layout",
        _attribute(distribution_base, "get_variable_layout")),
)
