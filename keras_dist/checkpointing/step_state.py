"""The state a model with its own `train_step` creates only when `fit` first traces it.

A GAN's `d_optimizer` and `g_optimizer` (and its loss trackers) get their variables on
the first training step, and a model without `call()` is never marked built. A backup
must still save such a model, and a restore must load into variables that exist before
the first step trains. `build_step_state` traces the model's own `train_step` once,
without running it, to learn which variables each optimizer updates, and builds the
optimizers on them: what `fit`'s first step would create, with nothing trained.
"""

from __future__ import annotations

__all__ = ["step_optimizers", "unbuilt_step_optimizers", "build_step_state", "mark_built"]


def step_optimizers(model) -> dict:
    """{attribute: optimizer} a model with its own `train_step` keeps besides `optimizer`.

    A GAN's `compile(d_optimizer=..., g_optimizer=...)` stores its optimizers as
    attributes; Keras' own `train_step` uses `model.optimizer` alone (then this is empty).
    """
    import keras

    if type(model).train_step is keras.Model.train_step:
        return {}
    return {name: value for name, value in vars(model).items()
            if name != "optimizer" and isinstance(value, keras.optimizers.Optimizer)}


def unbuilt_step_optimizers(model) -> list[str]:
    """Attributes holding optimizers a custom `train_step` has not built yet."""
    return [name for name, optimizer in step_optimizers(model).items()
            if not optimizer.built]


def mark_built(model) -> None:
    """Marks a model without `call()` built once every layer it holds is.

    Keras refuses `save_weights`/`load_weights` for a model that is not built, and a
    model without `call()` (a GAN, a VAE) never becomes built: its step calls its parts.
    """
    from keras_dist.compat.build_without_call import defines_call

    if model.built or defines_call(model):
        return
    layers = list(model._flatten_layers(include_self=False))
    if layers and all(layer.built for layer in layers):
        model.built = True


def build_step_state(model, iterator) -> None:
    """Builds the optimizers `model.train_step` builds on its first step, training nothing.

    Traces the step once on the input's element spec (no batch is read, nothing runs)
    with each unbuilt optimizer's `apply` recording the variables it is handed, then
    builds each optimizer on them in cross-replica context (in the model's
    `keras.distribution` distribution, if any), as Keras builds `model.optimizer` for a
    model that has `call()`.

    `iterator`: the iterator `fit` passes to `model.train_function`.
    """
    import tensorflow as tf

    strategy = model.distribute_strategy
    unbuilt = [step_optimizers(model)[name] for name in unbuilt_step_optimizers(model)]
    if not unbuilt:
        mark_built(model)
        return
    seen: dict[int, list] = {}

    def recorder(optimizer):
        def apply(grads, trainable_variables=None):
            if trainable_variables is not None:
                known = seen.setdefault(id(optimizer), [])
                known += [v for v in trainable_variables if all(v is not k for k in known)]
        return apply

    @tf.function(autograph=False)
    def trace_only(data_iterator):
        data = (data_iterator.get_next() if hasattr(data_iterator, "get_next")
                else next(data_iterator))
        return strategy.run(model.train_step, args=(data,))

    for optimizer in unbuilt:
        object.__setattr__(optimizer, "apply", recorder(optimizer))
    try:
        trace_only.get_concrete_function(iterator)
    finally:
        for optimizer in unbuilt:
            optimizer.__dict__.pop("apply", None)
    from keras_dist.distribution.training import distribution_of

    # Under a keras.distribution distribution the slots are laid out on its mesh, as the
    # step's own build (in the distribution's scope) lays them out.
    distribution = distribution_of(model)
    with distribution.scope() if distribution is not None else strategy.scope():
        for optimizer in unbuilt:
            if id(optimizer) in seen and not optimizer.built:
                optimizer.build(seen[id(optimizer)])
    mark_built(model)
