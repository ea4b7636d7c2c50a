"""Fix: optimizers see a sparse gradient's repeated ids summed, as the dense gradient has them.

Upstream behaviour (no Keras 3 issue was found; `docs/upstream/sparse_duplicates.md` is the
report ready to file): an embedding looked up at repeated ids gets a `tf.IndexedSlices`
gradient with one row per lookup, so an id seen k times has k rows. Keras 3's TensorFlow
optimizer hands it to `update_step` as it is, and the Keras ops in `update_step` work row
by row (`TFOptimizer.assign_add` scatter-adds each row): any state that is not linear in
the gradient sees each row on its own instead of their sum. Adam's second moment gets
`g1**2 + g2**2` instead of `(g1 + g2)**2`, and its first moment subtracts `m` once per row
(`(g1 - m) + (g2 - m)`); RMSprop's mean square, Adagrad's accumulator, Adamax's maximum,
Nadam, AdamW, Lion, Ftrl, LAMB alike. For an id seen 6 times Adam's first step is ~2.4x too
large. Keras 2's optimizers summed the rows first (`_deduplicate_indexed_slices`); Keras 3
on JAX and torch trains on dense gradients and is right, and so is a `keras.distribution`
mesh (its gradients are dense).

What keras_dist does (two patches, both only on `IndexedSlices`, dense gradients untouched):

* `TFOptimizer._distributed_tf_update_step`: each sparse gradient is summed per id
  (`tf.unique` + `unsorted_segment_sum`) right before `update_step`, on every device. That
  is after every reduction: the all-reduce of a sparse gradient gathers the replicas' rows,
  so repeated ids also come from different replicas and workers; after
  `GradientAggregation` (which gathers too), `LossScaleOptimizer` (its inner optimizer
  updates here) and any custom `train_step` (`apply_gradients` ends here). The gradient
  stays sparse: O(unique ids x dim) memory, no dense table. Plain `SGD` (with or without
  momentum, linear in the gradient) is left as it is: summing first changes nothing there.
* `Optimizer._clip_gradients`: with `clipnorm`, `global_clipnorm` or `clipvalue` set, the
  rows are summed before clipping too, so a norm (or a clipped value) is the dense
  gradient's, not one that counts a repeated id's rows separately. (With the
  clip_after_all_reduce fix this runs after the all-reduce; the fix is applied first so
  that one wraps this one.)

Legacy Keras 2 (`tf_keras`) is not touched: its optimizers already sum duplicates.
Applied by `keras_dist.strategy()` with the other fixes (on one device too), not by
`import keras_dist`: importing a library changes no numerics of plain Keras. Plain Keras
users can apply it alone with `keras_dist.compat.apply(["sparse_duplicates_summed"])`.
"""

from __future__ import annotations

import functools

from keras_dist.compat import _keras_tf, _patch, _probe
from keras_dist.compat._fix import Fix
from keras_dist.compat._internals import _base_optimizer

NAME = "sparse_duplicates_summed"
# Upstream hands each gradient to `update_step` as it comes ...
_UPDATES_AS_IS = r"self\.update_step\( ?grad ?, ?var"
# ... and nothing on the way sums repeated ids.
_SUMS_DUPLICATES = r"(unique|deduplicate|segment_sum)"


def _tf_optimizer():
    return _keras_tf.tf_optimizer_class()


def probe(update_function=None, apply_functions=None) -> str:
    """PRESENT while upstream updates with each sparse gradient as it comes, its repeated
    ids unsummed on the way (`update_step` <- `_distributed_tf_update_step` <-
    `_backend_update_step` <- `_backend_apply_gradients`)."""
    owner = _tf_optimizer()
    if owner is None:
        return _probe.FIXED  # JAX/torch: dense gradients
    update_function = update_function or _patch.original(owner, "_distributed_tf_update_step")
    if apply_functions is None:
        base = _base_optimizer()
        apply_functions = [_patch.original(owner, "_backend_update_step"),
                           _patch.original(base, "_backend_apply_gradients"),
                           _patch.original(base, "apply")]
    for function in [update_function, *apply_functions]:
        source = _probe.source_of(function)
        if source is None:
            return _probe.UNKNOWN
        if _probe.verdict_from_source(function, _SUMS_DUPLICATES) == _probe.PRESENT:
            return _probe.FIXED
    return _probe.verdict_from_source(update_function, _UPDATES_AS_IS,
                                      required=r"update_step")


def summed(grad):
    """`grad` with the rows of each repeated id summed (a dense gradient as it is)."""
    import tensorflow as tf

    if not isinstance(grad, tf.IndexedSlices):
        return grad
    ids, positions = tf.unique(grad.indices)
    values = tf.math.unsorted_segment_sum(grad.values, positions, tf.shape(ids)[0])
    return tf.IndexedSlices(values, ids, grad.dense_shape)


def _linear_in_the_gradient(optimizer) -> bool:
    """Plain SGD (momentum, Nesterov): summing the rows first changes nothing."""
    import keras

    return type(optimizer) is keras.optimizers.SGD


def _clips(optimizer) -> bool:
    return any(getattr(optimizer, option, None) for option in
               ("clipnorm", "global_clipnorm", "clipvalue"))


def _apply() -> None:
    owner, base = _tf_optimizer(), _base_optimizer()
    upstream_update = _patch.original(owner, "_distributed_tf_update_step")
    upstream_clip = _patch.original(base, "_clip_gradients")

    @functools.wraps(upstream_update)
    def _distributed_tf_update_step(self, distribution, grads_and_vars, learning_rate):
        if _linear_in_the_gradient(self):
            return upstream_update(self, distribution, grads_and_vars, learning_rate)

        # Upstream's loop, with each device's gradient summed per id before its update.
        def update(var, grad, learning_rate):
            return self.update_step(summed(grad), var, learning_rate)

        for grad, var in grads_and_vars:
            distribution.extended.update(var, update, args=(grad, learning_rate),
                                         group=False)
        return None

    @functools.wraps(upstream_clip)
    def _clip_gradients(self, grads):
        if _clips(self):
            grads = [summed(grad) for grad in grads]
        return upstream_clip(self, grads)

    _patch.patch(owner, "_distributed_tf_update_step", _distributed_tf_update_step, fix=NAME)
    _patch.patch(base, "_clip_gradients", _clip_gradients, fix=NAME)


FIX = Fix(
    name=NAME,
    upstream="none found (Keras 2: optimizer_v2._deduplicate_indexed_slices); report "
    "ready in docs/upstream/sparse_duplicates.md",
    summary="sparse (IndexedSlices) gradients have the rows of repeated ids summed before "
    "every non-linear optimizer update and before clipping, as the dense gradient has them.",
    symbols=("keras.TFOptimizer._distributed_tf_update_step",
             "keras.Optimizer._clip_gradients"),
    probe=probe,
    apply=_apply,
)
