"""Random numbers on a DTensor mesh equal to one device's (dropout, noise, sampling).

Keras's TF random functions are stateless (a seed from a `SeedGenerator`). On a mesh,
DTensor gives a random op the layout its consumer wants, and a sharded random op draws
each device's part with a seed mixed with the device's id: a dropout mask over a
batch-sharded activation differs from one device's (statistically sound, but training is
then not the one-device computation, and changes with the mesh). Here every random
value is drawn whole, replicated, as one device draws it, then used in the layout the
computation needs (slicing, no communication): the same numbers on any mesh. The price:
each device draws the whole random tensor (for dropout, the global batch's mask).
"""

from __future__ import annotations

import functools

from keras_dist.distribution import backend

# Keras's TF backend random functions whose output is a fresh random tensor.
DRAWING = ("normal", "uniform", "truncated_normal", "randint", "categorical", "shuffle",
           "gamma", "binomial", "beta")


def _replicated_args(args, kwargs, mesh):
    import tensorflow as tf

    def place(value):
        if isinstance(value, (tf.Tensor, tf.Variable)):
            return backend.replicate(value, mesh)
        return value

    return tf.nest.map_structure(place, (args, kwargs))


def drawing(function):
    """A Keras TF random function that, on a mesh, draws its whole result on every device."""

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        mesh = backend.current_mesh()
        if mesh is None:
            return function(*args, **kwargs)
        args, kwargs = _replicated_args(args, kwargs, mesh)
        return backend.replicate(function(*args, **kwargs), mesh)

    return wrapper


def dropping(dropout):
    """Keras's TF `dropout`: on a mesh, the mask is drawn whole, the input stays sharded.

    `stateless_dropout(ones) = keep / (1 - rate)` exactly, and `x * (keep / (1 - rate))`
    equals `x / (1 - rate) * keep` bit for bit (keep is 0 or 1): one device's result.
    """

    @functools.wraps(dropout)
    def wrapper(inputs, rate, noise_shape=None, seed=None):
        mesh = backend.current_mesh()
        if mesh is None or rate in (0.0, 1.0):
            return dropout(inputs, rate, noise_shape=noise_shape, seed=seed)
        import tensorflow as tf

        shape = tf.shape(inputs)
        if noise_shape is not None:
            shape = [shape[i] if size is None else size for i, size in enumerate(noise_shape)]
        ones = backend.replicate(tf.ones(shape, inputs.dtype), mesh)
        scaled_keep = backend.replicate(dropout(ones, rate, seed=seed), mesh)
        return inputs * scaled_keep

    return wrapper
