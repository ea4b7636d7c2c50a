"""What the gradient callbacks share: the model's Keras 3 optimizer, and installing
keras_dist's aggregation hook on it."""

from __future__ import annotations

import keras

from keras_dist import aggregation


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


def install_aggregation(model, config, caller):
    """Installs `config` on the model's optimizer; re-makes a stale train function.

    `fit` makes (but does not yet trace) the train function before `on_train_begin`;
    a function traced by an earlier `fit` would keep the old aggregation, so it is
    rebuilt whenever the installation changes.
    """
    optimizer = optimizer_of(model, caller)
    if not optimizer.built and model.trainable_variables:
        # Under the default strategy fit defers this to tracing; the accumulators
        # need the variables now.
        with model.distribute_strategy.scope():
            optimizer.build(model.trainable_variables)
    before = aggregation.get_aggregator(optimizer)
    installed = aggregation.install(optimizer, config, strategy=model.distribute_strategy)
    if installed is not before:
        model.make_train_function(force=True)
    return installed
