"""The registry's building blocks: `Internal`, the checks, and the writer/start-up entries.

Split from `keras_dist.compat.registry` (which assembles `INTERNALS` and answers
`problems()` / `check()`) to keep each module readable.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable

from keras_dist.compat import _keras_tf, _patch, _probe


@dataclasses.dataclass(frozen=True)
class Internal:
    """One private upstream symbol keras_dist uses.

    Attributes:
        name: Dotted name, by role (`keras.TFTrainer` is the TF backend's trainer class,
            `TensorFlowTrainer` in Keras <= 3.15, `Trainer` in the 3.16 nightlies).
        why: What keras_dist does with it.
        used_by: The keras_dist features (check groups) that need it.
        how: How the check decides, in words.
        check: Returns None when the symbol is there as expected, else what is wrong.
    """

    name: str
    why: str
    used_by: tuple[str, ...]
    how: str
    check: Callable[[], str | None]


def _attribute(owner_fn: Callable[[], object], attribute: str) -> Callable[[], str | None]:
    def check():
        owner = owner_fn()
        if owner is None:
            return "its owner is not available (is KERAS_BACKEND 'tensorflow'?)"
        if _patch.original(owner, attribute) is None:
            return f"{getattr(owner, '__name__', owner)} has no attribute {attribute!r}"
        return None

    return check


def _code_mentions(owner_fn, method: str, pattern: str) -> Callable[[], str | None]:
    """The upstream `owner.method` still contains `pattern` (a regex) in its code."""

    def check():
        owner = owner_fn()
        if owner is None:
            return "its owner is not available (is KERAS_BACKEND 'tensorflow'?)"
        function = _patch.original(owner, method)
        if isinstance(function, property):
            function = function.fget
        source = _probe.source_of(function)
        if source is None:
            return f"the code of {getattr(owner, '__name__', owner)}.{method} cannot be read"
        if not re.search(pattern, re.sub(r"\s+", " ", source)):
            return (f"{getattr(owner, '__name__', owner)}.{method} no longer uses "
                    f"{pattern.replace(chr(92), '')!r}")
        return None

    return check


def _all(*checks) -> Callable[[], str | None]:
    def check():
        for one in checks:
            problem = one()
            if problem:
                return problem
        return None

    return check


def _tf_path(path: str) -> Callable[[], str | None]:
    def check():
        import tensorflow as tf

        value = tf
        for part in path.split("."):
            value = getattr(value, part, None)
            if value is None:
                return f"tf.{path} does not exist"
        return None

    return check


def _tf_data_classes() -> str | None:
    import sys

    import tensorflow  # noqa: F401  (loads tf.data's op modules)

    known = {
        name
        for module_name, module in list(sys.modules.items())
        if module_name.startswith("tensorflow.python.data.") and module is not None
        for name in vars(module)
    }
    # Several names exist only in some releases; losing the core ones would switch the
    # "already batched" warning off silently.
    missing = sorted({"_BatchDataset", "_PrefetchDataset"} - known)
    if missing:
        return f"tf.data no longer defines {missing}"
    return None


def _base_trainer():
    import keras

    for base in keras.Model.__mro__:
        if base.__module__ == "keras.src.trainers.trainer":
            return base
    return None


def _base_optimizer():
    from keras.src.optimizers import base_optimizer

    return base_optimizer.BaseOptimizer


_LSO = _keras_tf.loss_scale_optimizer_class
_TRAINER = _keras_tf.trainer_class
_TRAINER_MODULE = _keras_tf.trainer_module
_TF_OPTIMIZER = _keras_tf.tf_optimizer_class


def _keras_module(module: str):
    def resolve():
        import importlib

        return importlib.import_module(module)

    return resolve


def _keras_callback(name: str):
    def resolve():
        import keras

        return getattr(keras.callbacks, name)

    return resolve


def _tf_checkpoint_class():
    from tensorflow.python.checkpoint import checkpoint

    return checkpoint.Checkpoint


def _tf_context_class():
    from tensorflow.python.eager import context

    return context.Context


# Stock writers (compat.writers) and keras_dist.barrier (compat.coordination).
_WRITER_INTERNALS = (
    Internal(
        "keras.ModelCheckpoint._save_model",
        "Probed by the stock_writers_multi_worker fix: it still saves through "
        "`self.model.save`/`save_weights`, which the fix makes multi-worker safe.",
        ("strategy",), "its code still calls `self.model.save`",
        _code_mentions(_keras_callback("ModelCheckpoint"), "_save_model",
                       r"self\.model\.save")),
    Internal(
        "keras.BackupAndRestore._save_model",
        "Patched: the chief saves the backup, other workers save weights to a removed "
        "temporary directory.",
        ("strategy",), "`on_epoch_end` still calls it",
        _code_mentions(_keras_callback("BackupAndRestore"), "on_epoch_end",
                       r"self\._save_model\(")),
    Internal(
        "keras.file_utils.makedirs",
        "Patched: `exist_ok` under a multi-worker strategy (callbacks check, then create).",
        ("strategy",), "attribute lookup on keras.src.utils.file_utils",
        _attribute(_keras_module("keras.src.utils.file_utils"), "makedirs")),
    Internal(
        "keras.TensorBoard._log_write_dir",
        "Other workers' event files go to a private directory set before `set_model`.",
        ("strategy",), "`set_model` still derives it from `self.log_dir`",
        _code_mentions(_keras_callback("TensorBoard"), "set_model",
                       r"self\._log_write_dir = self\.log_dir")),
    Internal(
        "tf.Checkpoint._write",
        "Patched: `save` and `write` both write through it (redirected on other workers).",
        ("strategy",), "`save` still calls it",
        _code_mentions(_tf_checkpoint_class, "save", r"self\._write\(")),
    Internal(
        "tf.python.saved_model.save",
        "Patched where `tf.saved_model.save` is defined (and in every loaded copy): "
        "TensorFlow loads a fresh `tf.saved_model` module on the first import of "
        "`tensorflow.saved_model...` (Keras' `model.export` does), copying it from there.",
        ("strategy",), "attribute lookup on tensorflow.python.saved_model.save",
        _attribute(_keras_module("tensorflow.python.saved_model.save"), "save")),
    Internal(
        "tf.python.saved_model.load",
        "Patched where `tf.saved_model.load` is defined (and in every loaded copy), as "
        "`save`: maps `experimental_io_device='/job:localhost'` to this worker.",
        ("strategy",), "attribute lookup on tensorflow.python.saved_model.load",
        _attribute(_keras_module("tensorflow.python.saved_model.load"), "load")),
    Internal(
        "tf.context.wait_at_barrier",
        "keras_dist.barrier() waits in the coordination service's barrier.",
        ("barrier",), "attribute lookup on tensorflow.python.eager.context.Context",
        _attribute(_tf_context_class, "wait_at_barrier")),
    Internal(
        "tf.context.coordination_service",
        "keras_dist.barrier() tells whether this process has a coordination service.",
        ("barrier",), "`configure_coordination_service` still sets what it reads",
        _code_mentions(_tf_context_class, "configure_coordination_service",
                       r"self\._coordination_service_config =")),
    Internal(
        "tf.context.set_config_key_value",
        "The chief publishes 'my file is complete' for stock writers.",
        ("strategy",), "attribute lookup on tensorflow.python.eager.context.Context",
        _attribute(_tf_context_class, "set_config_key_value")),
    Internal(
        "tf.context.get_config_key_value",
        "Other workers wait for the chief's 'complete' (a blocking get).",
        ("strategy",), "attribute lookup on tensorflow.python.eager.context.Context",
        _attribute(_tf_context_class, "get_config_key_value")),
    Internal(
        "tf.context.delete_config_key_value",
        "The stall watchdog rewrites each worker's progress record (a key cannot be "
        "overwritten).",
        ("stall",), "attribute lookup on tensorflow.python.eager.context.Context",
        _attribute(_tf_context_class, "delete_config_key_value")),
)

# Start-up under a multi-worker TF_CONFIG / Slurm job (keras_dist.startup.early_init): the
# settings MultiWorkerMirroredStrategy applies, applied at `import keras_dist` so ops made
# before `strategy()` work, and the first op meeting the peers with a deadline.
_STARTUP_INTERNALS = (
    Internal(
        "tf.context.configure_collective_ops",
        "Set at import: collective leader, scoped allocator, device filters (as MWMS).",
        ("startup",), "attribute lookup on tensorflow.python.eager.context.Context",
        _attribute(_tf_context_class, "configure_collective_ops")),
    Internal(
        "tf.context.configure_coordination_service",
        "Set at import: the coordination service MWMS configures (dead peers -> errors).",
        ("startup",), "attribute lookup on tensorflow.python.eager.context.Context",
        _attribute(_tf_context_class, "configure_coordination_service")),
    Internal(
        "tf.context.enable_collective_ops",
        "Records this task's ServerDef at import; the first op starts the server.",
        ("startup",), "attribute lookup on tensorflow.python.eager.context.Context",
        _attribute(_tf_context_class, "enable_collective_ops")),
    Internal(
        "tf.context.ensure_initialized",
        "Wrapped once: the first op meets the peers (deadline, missing workers named, "
        "SIGTERM honoured) before TensorFlow starts the server; then restored.",
        ("startup",), "attribute lookup on tensorflow.python.eager.context.Context",
        _attribute(_tf_context_class, "ensure_initialized")),
    Internal(
        "tf.multi_worker_util.collective_leader / coordination_leader",
        "The leaders MWMS computes, so the values set at import are TensorFlow's own.",
        ("startup",), "attribute lookups on tensorflow.python.distribute.multi_worker_util",
        _all(_attribute(_keras_module("tensorflow.python.distribute.multi_worker_util"),
                        "collective_leader"),
             _attribute(_keras_module("tensorflow.python.distribute.multi_worker_util"),
                        "coordination_leader"))),
    Internal(
        "tsl coordination_config_pb2.CoordinatedJob",
        "The coordinated jobs (chief, worker) of the coordination service set at import.",
        ("startup",), "attribute lookup on tensorflow.compiler.xla.tsl.protobuf."
        "coordination_config_pb2",
        _attribute(_keras_module(
            "tensorflow.compiler.xla.tsl.protobuf.coordination_config_pb2"),
            "CoordinatedJob")),
)


def _epoch_iterator():
    """Keras' backend-independent `EpochIterator` (its epoch loop over the input)."""
    try:
        from keras.src.trainers import epoch_iterator
    except ImportError:
        return None
    return getattr(epoch_iterator, "EpochIterator", None)


def _tf_epoch_iterator():
    """The TF trainer's `TFEpochIterator` (None off the TensorFlow backend)."""
    module = _keras_tf.trainer_module()
    return getattr(module, "TFEpochIterator", None) if module is not None else None


