"""Every private Keras/TensorFlow symbol keras_dist touches, why, and how it is checked.

Private names change without notice between releases. Each entry says which keras_dist
feature depends on the symbol, and carries a check that runs without initialising the
TensorFlow runtime (a lookup, or a look at the upstream code that must still use the
symbol the way keras_dist relies on). `check("aggregation")` runs the entries one
feature needs and raises `CompatError` naming every symbol that is missing or changed,
with the Keras/TensorFlow versions: a changed internal must never quietly change what
training computes. `docs/ARCHITECTURE.md` renders this table (`render_markdown()`).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable, Iterable

from keras_dist.compat import _keras_tf, _patch, _probe


class CompatError(RuntimeError):
    """A Keras/TensorFlow internal keras_dist depends on is missing or has changed."""


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

    from keras_dist.data import sources as _data_sources

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
)

# Start-up under a multi-worker TF_CONFIG / Slurm job (keras_dist._early_init): the
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

INTERNALS: tuple[Internal, ...] = (
    Internal(
        "keras.TFTrainer._maybe_symbolic_build",
        "Patched by the symbolic_build_multi_worker fix (keras#20585).",
        ("strategy",), "attribute lookup on the TF trainer class",
        _attribute(_TRAINER, "_maybe_symbolic_build")),
    Internal(
        "keras.TFTrainer._distribute_strategy",
        "The symbolic_build fix asks whether the model was built under a strategy.",
        ("strategy",), "the trainer's `distribute_strategy` property reads it",
        _code_mentions(_TRAINER, "distribute_strategy", r"_distribute_strategy")),
    Internal(
        "keras.trainer.reduce_per_replica",
        "Patched by the reduce_per_replica_scalar fix (keras#20585); the trainer looks "
        "it up in its module at call time.",
        ("strategy",), "attribute lookup on keras.src.backend.tensorflow.trainer",
        _attribute(_TRAINER_MODULE, "reduce_per_replica")),
    Internal(
        "keras.trainer._collective_all_reduce_multi_worker",
        "The reduce_per_replica fix uses upstream's own multi-worker test.",
        ("strategy",), "attribute lookup on keras.src.backend.tensorflow.trainer",
        _attribute(_TRAINER_MODULE, "_collective_all_reduce_multi_worker")),
    Internal(
        "keras.LossScaleOptimizer._tf_apply",
        "Probed by the loss_scale_finite_across_replicas fix (keras#18691).",
        ("strategy", "aggregation"), "attribute lookup",
        _attribute(_LSO, "_tf_apply")),
    Internal(
        "keras.LossScaleOptimizer.check_finite",
        "Patched by the loss-scale fix: all-reduces the non-finite flag.",
        ("strategy", "aggregation"),
        "attribute lookup, and `_tf_apply` still decides through it",
        _all(_attribute(_LSO, "check_finite"),
             _code_mentions(_LSO, "_tf_apply", r"check_finite"))),
    Internal(
        "keras.Optimizer._backend_apply_gradients",
        "The aggregation hook replaces it per optimizer instance to run keras_dist's "
        "pipeline (accumulate, compress, all-reduce, clip) before Keras' update.",
        ("aggregation",), "`apply()` still calls it",
        _code_mentions(_base_optimizer, "apply", r"self\._backend_apply_gradients\(")),
    Internal(
        "keras.TFOptimizer._all_reduce_sum_gradients",
        "The aggregation hook makes it the identity (gradients arrive reduced). If Keras "
        "renamed it, gradients would be all-reduced twice and scaled by N: an error.",
        ("aggregation",), "`_backend_update_step` still calls it",
        _code_mentions(_TF_OPTIMIZER, "_backend_update_step",
                       r"self\._all_reduce_sum_gradients\(")),
    Internal(
        "keras.TFOptimizer._distribution_strategy",
        "install() falls back to the strategy the optimizer was created under.",
        ("aggregation",), "`TFOptimizer.__init__` still sets it",
        _code_mentions(_TF_OPTIMIZER, "__init__", r"self\._distribution_strategy =")),
    Internal(
        "keras.Optimizer._iterations",
        "Accumulation un-counts micro-steps so `iterations` counts updates.",
        ("aggregation",), "`apply()` still increments it",
        _code_mentions(_base_optimizer, "apply", r"self\._iterations\.assign_add\(")),
    Internal(
        "keras.Optimizer._trainable_variables",
        "Accumulators are sized from the variables the optimizer was built with.",
        ("aggregation",), "`build()` still sets it",
        _code_mentions(_base_optimizer, "build", r"self\._trainable_variables =")),
    Internal(
        "keras.Optimizer._get_variable_index",
        "Maps a variable to its accumulator.",
        ("aggregation",), "attribute lookup",
        _attribute(_base_optimizer, "_get_variable_index")),
    *(Internal(
        f"keras.Optimizer.{name}",
        f"The stock-option fixes (compat.optimizer_options) call it as Keras' "
        f"`_backend_apply_gradients` does: {why}.",
        ("strategy",), "`_backend_apply_gradients` still calls it",
        _all(_attribute(_base_optimizer, name),
             _code_mentions(_base_optimizer, "_backend_apply_gradients", rf"self\.{pattern}\(")))
      for name, why, pattern in (
          ("_clip_gradients", "clipping moves to after the all-reduce", "_clip_gradients"),
          ("_backend_update_step", "the accumulated update (it all-reduces)", "_backend_update_step"),
          ("_apply_weight_decay", "weight decay in the accumulated update", "_apply_weight_decay"),
          ("_backend_increment_gradient_accumulators", "accumulation without communication", "_backend_increment_gradient_accumulators"),
          ("_backend_reset_gradient_accumulators", "reset after the accumulated update", "_backend_reset_gradient_accumulators"),
          ("_update_model_variables_moving_average", "EMA after every micro-step", "_update_model_variables_moving_average"),
          ("_overwrite_model_variables_with_average_value", "EMA overwrite (called directly, "
           "or through _backend_maybe_overwrite_model_variables in the 3.16 nightlies)",
           "(_overwrite_model_variables_with_average_value|"
           "_backend_maybe_overwrite_model_variables)"),
      )),
    Internal(
        "keras.Optimizer._accumulated_gradients",
        "The optimizer_conds_cross_replica fix reads Keras' own accumulators.",
        ("strategy",), "`build()` still creates them",
        _code_mentions(_base_optimizer, "build", r"self\._accumulated_gradients =")),
    Internal(
        "keras.Trainer._loss_tracker",
        "Throughput reads the running loss without a collective; PipelineModel reports "
        "the whole batch's loss in it (compat.pipeline_internals).",
        ("callbacks", "parallel"), "`compile()` still creates it",
        _code_mentions(_base_trainer, "compile", r"self\._loss_tracker =")),
    Internal(
        "keras.Trainer._compute_loss",
        "PipelineModel computes Keras' own loss of the whole batch from the micro-batches' "
        "predictions (compat.pipeline_internals), as Keras' `train_step` does.",
        ("parallel",), "the TF trainer's `train_step` still calls it",
        _code_mentions(_TRAINER, "train_step", r"self\._compute_loss\(")),
    Internal(
        "keras.Optimizer.add_variable_from_reference",
        "Replaced on a PipelineModel's optimizer instance by the pipeline_slot_placement "
        "fix (probe: does it still only colocate?): creates each slot on "
        "its stage's device; Keras' TF optimizer only colocates, which is lost when "
        "`fit` creates the slots inside its traced train step.",
        ("parallel",), "`add_optimizer_variables` still creates slots through it",
        _code_mentions(_base_optimizer, "add_optimizer_variables",
                       r"self\.add_variable_from_reference\(")),
    Internal(
        "keras.Trainer._initial_epoch",
        "BackupAndRestore resumes `fit` at the restored epoch (Keras' own mechanism).",
        ("checkpointing",), "the TF trainer's `fit()` still reads it",
        _code_mentions(_TRAINER, "fit", r"self\._initial_epoch")),
    Internal(
        "keras.TFTrainer.train_function",
        "BackupAndRestore wraps it once to skip the batches already trained on.",
        ("checkpointing",), "`fit()` still calls `self.train_function(iterator)`",
        _code_mentions(_TRAINER, "fit", r"self\.train_function\(")),
    Internal(
        "tf.__internal__.distribute.strategy_supports_no_merge_call",
        "Aggregation picks a replica-context cond or a merge_call like Keras does.",
        ("aggregation",), "attribute lookup",
        _tf_path("__internal__.distribute.strategy_supports_no_merge_call")),
    Internal(
        "tf.data private dataset classes and `_input_dataset`",
        "distribute_dataset warns when handed an already batched dataset.",
        ("data",), "class names looked up in tf.data's op modules",
        _tf_data_classes),
    *_WRITER_INTERNALS,
    *_STARTUP_INTERNALS,
)

_BY_NAME = {internal.name: internal for internal in INTERNALS}


def problems(groups: Iterable[str] | None = None,
             names: Iterable[str] | None = None) -> dict[str, str]:
    """{symbol: what is wrong} for the entries that `groups` use, or those `names`.

    With neither, every entry is checked.
    """
    wanted_groups = None if groups is None else set(groups)
    wanted_names = None if names is None else set(names)
    found = {}
    for internal in INTERNALS:
        if wanted_groups is not None and not wanted_groups & set(internal.used_by):
            continue
        if wanted_names is not None and internal.name not in wanted_names:
            continue
        try:
            problem = internal.check()
        except Exception as error:  # a check must report, never crash the caller
            problem = f"check failed: {type(error).__name__}: {error}"
        if problem:
            found[internal.name] = problem
    return found


_checked: set[str] = set()


def check(*groups: str) -> None:
    """Raises `CompatError` if an internal that `groups` need is missing or changed.

    Each group is checked once per process (the answer cannot change).
    """
    todo = [group for group in groups if group not in _checked]
    if not todo:
        return
    found = problems(groups=todo)
    if found:
        raise CompatError(_message(f"run {', '.join(todo)}", found))
    _checked.update(todo)


def _message(what: str, found: dict[str, str], remedy: str = "") -> str:
    details = "\n".join(f"  - {name}: {problem}" for name, problem in found.items())
    return (
        f"keras_dist cannot {what} safely on {_keras_tf.versions()}: these "
        f"Keras/TensorFlow internals it relies on are missing or changed:\n{details}\n"
        f"{remedy}Install a Keras release keras_dist supports (keras 3.15.1, or the "
        "keras-nightly pinned in keras_dist's constraints/keras-nightly.txt) and report "
        "the change to the keras_dist developers."
    )


def render_markdown() -> str:
    """The registry as a Markdown table (docs/ARCHITECTURE.md embeds it)."""
    rows = ["| internal | used by | why | checked by |", "|---|---|---|---|"]
    for internal in INTERNALS:
        rows.append(f"| `{internal.name}` | {', '.join(internal.used_by)} | "
                    f"{internal.why} | {internal.how} |")
    return "\n".join(rows)


def get(name: str) -> Internal:
    return _BY_NAME[name]
