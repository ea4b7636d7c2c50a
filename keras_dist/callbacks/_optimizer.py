"""What the gradient callbacks share: the model's Keras 3 optimizer, and installing
keras_dist's aggregation hook on it."""

from __future__ import annotations

import keras

from keras_dist import aggregation
from keras_dist.checkpointing.step_state import step_optimizers


def optimizer_of(model, caller):
    """The compiled model's Keras 3 optimizer; a clear error for tf_keras or no optimizer."""
    if not isinstance(model, keras.Model):
        raise TypeError(
            f"{caller} hooks the gradient all-reduce of Keras 3 optimizers, but the model "
            f"is a {type(model).__module__}.{type(model).__name__} (legacy Keras 2 / "
            "tf_keras, TF_USE_LEGACY_KERAS=1). tf_keras all-reduces inside its own "
            "optimizer and keras_dist cannot hook it: drop this callback under tf_keras "
            "(clip with the optimizer's global_clipnorm, which tf_keras applies after "
            "its all-reduce), or move the model to Keras 3."
        )
    if getattr(model, "optimizer", None) is None:
        raise ValueError(
            f"{caller} needs a compiled model with an optimizer. Call "
            "model.compile(optimizer=...) before model.fit()."
        )
    return model.optimizer


def _install_one(model, optimizer, name, config, caller):
    if not optimizer.built:
        if name == "optimizer" and model.trainable_variables:
            # Under the default strategy fit defers this to tracing; the accumulators
            # need the variables now.
            with model.distribute_strategy.scope():
                optimizer.build(model.trainable_variables)
        elif config.accumulation_steps > 1:
            raise ValueError(
                f"{caller}(accumulation_steps={config.accumulation_steps}) sizes its "
                f"accumulators from the variables `model.{name}` updates, and that "
                "optimizer is not built yet (a custom train_step builds it on its first "
                f"step), so it cannot be installed here. Let `fit` install it (the "
                "GradientAggregation callback builds such optimizers on the first step), "
                f"or build it first: `model.{name}.build(<the variables it updates>)`.")
    return aggregation.install(optimizer, config, strategy=model.distribute_strategy)


def install_aggregations(model, config, caller, *, remake: bool = True) -> dict:
    """Installs `config` on every optimizer the model trains with; {attribute: aggregator}.

    `model.optimizer`, and for a model with its own step (a GAN's `d_optimizer` and
    `g_optimizer`) each optimizer it keeps as an attribute too (an unused default from
    a bare `compile()` gets a hook that never runs).
    `fit` makes (but does not yet trace) the train function before `on_train_begin`;
    a function traced by an earlier `fit` would keep the old aggregation, so it is
    rebuilt whenever an installation changes (`remake=False`: the caller knows the
    function was not traced yet).
    """
    optimizers = {"optimizer": optimizer_of(model, caller), **step_optimizers(model)}
    installed, changed = {}, False
    for name, optimizer in optimizers.items():
        before = aggregation.get_aggregator(optimizer)
        installed[name] = _install_one(model, optimizer, name, config, caller)
        changed = changed or installed[name] is not before
    if changed and remake:
        model.make_train_function(force=True)
    return installed


def install_aggregation(model, config, caller):
    """`install_aggregations` for callers that read one aggregator: `model.optimizer`'s,
    or the first of a custom step's optimizers."""
    return next(iter(install_aggregations(model, config, caller).values()))
