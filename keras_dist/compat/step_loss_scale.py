"""Fix: a custom `train_step` reports its loss divided by the number of replicas.

keras-team/keras#14104, tensorflow/tensorflow#55321. The gradient all-reduce of Keras'
TF optimizer is a SUM, so Keras scales every loss it computes in replica context by
1/num_replicas (`keras.src.losses.loss.scale_loss_for_distribution`: `Loss` objects,
`compute_loss`, `add_loss`). Only the built-in `train_step`/`test_step` undo the scaling
before updating their loss tracker. A step of one's own (a GAN, a VAE) that puts such a
loss into a `keras.metrics.Mean` reports 1/N of the global mean in `history`, the
progress bar and `evaluate()`; one that uses a loss *function* (unscaled) reports the
right number but gets N-times gradients.

keras_dist gives the step functions that `fit`, `evaluate` and `train_on_batch` run on
each replica one-device semantics instead:

* losses are not scaled there: each replica's loss is the mean over its own examples, as
  on one device, so whatever a step tracks (`Mean` trackers are on-read sums, averaged
  over replicas when reported) is the global mean;
* `optimizer.apply()` (also `apply_gradients`) multiplies each gradient by 1/N before
  the all-reduce: the same gradients Keras' scaled loss gave (bit-identical for N a
  power of two), now also for losses the step computes with plain functions;
* `tf.nn.compute_average_loss` / `tf.nn.scale_regularization_loss` (TensorFlow's
  idiom, already divided by the global batch / N) are multiplied back by N there.

Outside those step functions -- custom training loops that call `strategy.run`
themselves, following TensorFlow's convention -- Keras' own scaling stays.

The same wrapper turns what a traced, per-replica step cannot do (`.numpy()` on a
tensor, a bare `tf.Variable` created in the step) into errors that name the step and
say what to write instead.
"""

from __future__ import annotations

import contextlib
import functools
import threading

from keras_dist.compat import _internals, _keras_tf, _patch, _probe
from keras_dist.compat._fix import Fix

NAME = "custom_step_loss_scale"
# Upstream divides every loss by the replica count (and relies on a SUM all-reduce).
BUG_PATTERN = r"1\.0 ?/ ?num_replicas"
_state = threading.local()


def _loss_module():
    from keras.src.losses import loss

    return loss


_GRAPH_MARK = "_keras_dist_fit_step"


def _graphs():
    """The graph being built and the graphs it is nested in (cond/while branches)."""
    import tensorflow as tf

    graph = tf.compat.v1.get_default_graph()
    while graph is not None:
        yield graph
        graph = getattr(graph, "outer_graph", None)


def in_step() -> bool:
    """Whether this code runs inside a step function of `fit`/`evaluate`.

    The step's graph is marked, so code that TensorFlow runs in other threads of the
    same graph (a `merge_call`'s `call_for_each_replica`, e.g. a LossScaleOptimizer
    applying its inner optimizer) sees it too; eagerly (`run_eagerly=True`) a
    thread-local counter says it.
    """
    if getattr(_state, "depth", 0) > 0:
        return True
    return any(getattr(graph, _GRAPH_MARK, False) for graph in _graphs())


@contextlib.contextmanager
def _step():
    import tensorflow as tf

    _state.depth = getattr(_state, "depth", 0) + 1
    if not tf.executing_eagerly():
        setattr(tf.compat.v1.get_default_graph(), _GRAPH_MARK, True)
    try:
        yield
    finally:
        _state.depth -= 1


def _replicas() -> int:
    """The replicas in sync when in a replica context of a strategy, else 1."""
    import tensorflow as tf

    if tf.distribute.in_cross_replica_context():
        return 1
    context = tf.distribute.get_replica_context()
    return 1 if context is None else int(context.num_replicas_in_sync)


def probe(function=None) -> str:
    """PRESENT while Keras scales losses by 1/num_replicas for a SUM all-reduce."""
    if not _keras_tf.uses_tensorflow_backend():
        return _probe.FIXED
    function = function or _patch.original(_loss_module(), "scale_loss_for_distribution")
    return _probe.verdict_from_source(function, BUG_PATTERN, required=r"num_replicas")


def _run_steps_per_replica_mean(trainer) -> None:
    original = _patch.original(trainer, "_make_function")

    @functools.wraps(original)
    def _make_function(self, step_function):
        @functools.wraps(step_function)
        def step_with_local_mean_losses(data):
            with _step(), _no_raw_variables(self, step_function):
                try:
                    return step_function(data)
                except (AttributeError, ValueError, TypeError) as error:
                    clearer = _explained(self, step_function, error)
                    if clearer is None:
                        raise
                    raise clearer from error

        return original(self, step_with_local_mean_losses)

    _patch.patch(trainer, "_make_function", _make_function, fix=NAME)


# What a step written for eager code does that a traced, per-replica step cannot.
_EXPLAINED = (
    (AttributeError, ("numpy",),
     "calls `.numpy()` (or another eager-only method) on a tensor. Under a strategy the "
     "step is traced once by tf.function and runs on every replica, so its tensors are "
     "symbolic: compute with keras.ops / tf ops and return tensors (fit logs them); "
     "print with tf.print; to debug on one device, compile(run_eagerly=True)"),
    (ValueError, ("tf.Variable", "first call"),
     "creates a variable on every call. Variables must be created once: in `__init__` "
     "or `build()` (or `add_weight`), not inside the step"),
    (TypeError, ("symbolic", "numpy"),
     "converts a tensor to a NumPy value (np.array, float(), a Python `if` on a tensor). "
     "Under a strategy the step is traced by tf.function and runs per replica: use "
     "keras.ops / tf ops (tf.cond for branches)"),
)


def _created_by_keras() -> bool:
    """Whether the variable being created comes from Keras (a layer, an optimizer, a
    metric builds lazily on the first step: fine) rather than a bare `tf.Variable`."""
    import sys

    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename.replace("\\", "/")
        if "/tensorflow/" not in path and path != __file__:
            # The nearest caller outside TensorFlow decides.
            return any(part in path for part in ("/keras/", "/keras_hub/", "/keras_dist/"))
        frame = frame.f_back
    return True


@contextlib.contextmanager
def _no_raw_variables(model, step_function):
    """Inside a fit step, a bare `tf.Variable(...)` is an error naming the step."""
    import tensorflow as tf

    def creator(next_creator, **kwargs):
        if not _created_by_keras():
            step = getattr(step_function, "__name__", "the step")
            raise ValueError(
                f"{type(model).__name__}.{step} creates a variable "
                f"({kwargs.get('name') or 'tf.Variable'}) inside the step. The step is "
                "traced by tf.function and runs on every replica: create variables once, "
                "in `__init__` or `build()` (self.add_weight / keras.Variable), and only "
                "assign to them in the step.")
        return next_creator(**kwargs)

    with tf.variable_creator_scope(creator):
        yield


def _explained(model, step_function, error):
    """A clearer error naming the step, for the mistakes `_EXPLAINED` lists."""
    text = str(error)
    for kind, words, advice in _EXPLAINED:
        if isinstance(error, kind) and all(word in text for word in words):
            step = getattr(step_function, "__name__", "the step")
            return type(error)(f"{type(model).__name__}.{step} {advice}. (Original error: "
                               f"{type(error).__name__}: {text.splitlines()[0]})")
    return None


def _unscaled_in_steps(owner, name: str, rescale=None) -> None:
    original = _patch.original(owner, name)

    @functools.wraps(original)
    def function(value, *args, **kwargs):
        if not in_step():
            return original(value, *args, **kwargs)
        if rescale is None:
            return value
        result = original(value, *args, **kwargs)
        replicas = _replicas()
        return result if replicas == 1 else result * replicas

    _patch.patch(owner, name, function, fix=NAME)


def _scaled(gradient, factor):
    """`gradient * factor` for a dense gradient, an `IndexedSlices` one, or None."""
    import tensorflow as tf

    if gradient is None:
        return None
    if isinstance(gradient, tf.IndexedSlices):
        return tf.IndexedSlices(gradient.values * tf.cast(factor, gradient.values.dtype),
                                gradient.indices, gradient.dense_shape)
    return gradient * tf.cast(factor, gradient.dtype)


def _gradients_divided_in_steps(optimizer_class) -> None:
    original = _patch.original(optimizer_class, "apply")

    @functools.wraps(original)
    def apply(self, grads, trainable_variables=None):
        replicas = _replicas() if in_step() else 1
        if replicas > 1:
            grads = [_scaled(g, 1.0 / replicas) for g in grads]
        return original(self, grads, trainable_variables)

    _patch.patch(optimizer_class, "apply", apply, fix=NAME)


def apply() -> None:
    import tensorflow as tf

    loss_module = _loss_module()
    _run_steps_per_replica_mean(_keras_tf.trainer_class())
    _unscaled_in_steps(loss_module, "scale_loss_for_distribution")
    _unscaled_in_steps(loss_module, "unscale_loss_for_distribution")
    _unscaled_in_steps(tf.nn, "compute_average_loss", rescale=True)
    _unscaled_in_steps(tf.nn, "scale_regularization_loss", rescale=True)
    _gradients_divided_in_steps(_internals._base_optimizer())


FIX = Fix(
    name=NAME,
    upstream="keras-team/keras#14104, tensorflow/tensorflow#55321",
    summary="Inside fit/evaluate's steps each replica's loss is its local mean (what a "
    "custom train_step tracks is the global mean) and the optimizer divides gradients "
    "by the replica count instead.",
    symbols=("keras.TFTrainer._make_function", "keras.losses.scale_loss_for_distribution",
             "keras.losses.unscale_loss_for_distribution", "keras.Optimizer.apply"),
    probe=probe,
    apply=apply,
)
