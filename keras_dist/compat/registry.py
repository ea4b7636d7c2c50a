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

from typing import Iterable

from keras_dist.compat import _keras_tf
from keras_dist.compat._internals import (  # noqa: F401 (Internal: re-exported)
    Internal,
    _attribute,
    _code_mentions,
    _all,
    _tf_path,
    _tf_data_classes,
    _base_trainer,
    _base_optimizer,
    _epoch_iterator,
    _tf_epoch_iterator,
    _keras_module,
    _LSO,
    _TRAINER,
    _TRAINER_MODULE,
    _TF_OPTIMIZER,
    _WRITER_INTERNALS,
    _STARTUP_INTERNALS,
)
from keras_dist.compat._distribution_internals import _DISTRIBUTION_INTERNALS


class CompatError(RuntimeError):
    """A Keras/TensorFlow internal keras_dist depends on is missing or has changed."""


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
        "keras.Trainer._symbolic_build",
        "Patched by the build_models_without_call fix (keras#20164): skipped for models "
        "without call(), as Keras does without a strategy. The symbolic_build_multi_worker "
        "fix calls it with an iterator it reads a batch from only when something is unbuilt.",
        ("strategy",), "the TF trainer's `_maybe_symbolic_build` still calls it; it reads "
        "`next(...)` of its iterator only when `data_batch is None`",
        _all(_attribute(_base_trainer, "_symbolic_build"),
             _code_mentions(_TRAINER, "_maybe_symbolic_build", r"self\._symbolic_build\("),
             _code_mentions(_base_trainer, "_symbolic_build",
                            r"if data_batch is None:\s+for _, _, \w+ in iterator:"))),
    Internal(
        "keras.TFTrainer._make_function",
        "Patched by the custom_step_loss_scale fix (keras#14104): the step it wraps runs "
        "with per-replica mean losses.",
        ("strategy",), "`make_train_function` still passes `train_step` through it",
        _code_mentions(_TRAINER, "make_train_function",
                       r"self\._make_function\( ?self\.train_step ?\)")),
    *(Internal(
        f"keras.losses.{name}",
        "Patched by the custom_step_loss_scale fix: the identity inside fit's steps. "
        "Keras looks it up in its module at call time.",
        ("strategy",), f"attribute lookup; {where} still calls it",
        _all(_attribute(_keras_module("keras.src.losses.loss"), name),
             _code_mentions(owner, method, rf"\b{name}\(")))
      for name, owner, method, where in (
          ("scale_loss_for_distribution", _keras_module("keras.src.losses.loss"),
           "reduce_values", "`reduce_values` (every `Loss`'s mean reduction)"),
          ("unscale_loss_for_distribution", _TRAINER, "train_step",
           "the TF trainer's `train_step`"))),
    Internal(
        "keras.Optimizer.apply",
        "Patched by the custom_step_loss_scale fix: divides gradients by the replica "
        "count inside fit's steps (where losses are no longer scaled).",
        ("strategy",), "`apply_gradients` still calls it",
        _code_mentions(_base_optimizer, "apply_gradients", r"self\.apply\(")),
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
        "keras.TFOptimizer._distributed_tf_update_step",
        "The sparse_duplicates_summed fix replaces it with upstream's loop that sums a "
        "sparse gradient's repeated ids on each device before `update_step`.",
        ("strategy",), "`_backend_update_step` still updates through it, and it through "
        "`update_step` per variable",
        _all(_code_mentions(_TF_OPTIMIZER, "_backend_update_step",
                            r"self\._distributed_tf_update_step"),
             _code_mentions(_TF_OPTIMIZER, "_distributed_tf_update_step",
                            r"distribution\.extended\.update\("),
             _code_mentions(_TF_OPTIMIZER, "_distributed_tf_update_step",
                            r"self\.update_step\("))),
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
        "keras.EpochIterator._enumerate_iterator",
        "The input_epoch fix's probe reads it: the epoch loop starts each epoch of the "
        "input (after the callbacks' on_epoch_begin) without telling it which. The "
        "one_iterator_per_epoch fix wraps it (on TFEpochIterator) and its probe reads it.",
        ("strategy",), "attribute lookup; it still calls `data_adapter.on_epoch_begin`",
        _all(_attribute(_epoch_iterator, "_enumerate_iterator"),
             _code_mentions(_epoch_iterator, "_enumerate_iterator",
                            r"data_adapter\.on_epoch_begin\(")),
    ),
    Internal(
        "keras.TFEpochIterator._distributed_dataset",
        "The input_epoch fix notes the input a fit trains on (the epoch iterator made "
        "before its callbacks start), so BackupAndRestore can check its order.",
        ("strategy",), "`__init__` still sets it from the data adapter's dataset",
        _code_mentions(_tf_epoch_iterator, "__init__", r"self\._distributed_dataset =")),
    Internal(
        "keras.TFEpochIterator._get_iterator",
        "The one_iterator_per_epoch fix makes the iterator the epoch loop asks for after "
        "an epoch's last step only where a step reads it.",
        ("strategy",), "the epoch loop still makes its iterators with "
        "`iter(self._get_iterator())`",
        _all(_attribute(_tf_epoch_iterator, "_get_iterator"),
             _code_mentions(_epoch_iterator, "_enumerate_iterator",
                            r"iter\(self\._get_iterator\(\)\)"))),
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
    *_DISTRIBUTION_INTERNALS,
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
