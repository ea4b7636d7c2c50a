"""Ops DTensor cannot lay out, written with ops it can, for code traced on a mesh.

`keras.ops.slice_update` is XLA's `DynamicUpdateSlice` on TensorFlow, which DTensor's
layout propagation does not implement ("'tf.XlaDynamicUpdateSlice' op does not implement
layout propagation"): keras-hub's KV cache and its samplers use it on every generated
token, so `generate()` failed on any mesh. On a mesh it is computed as a select between
the operand and the update padded to the operand's shape (the same values, XLA's index
clamping included): elementwise ops and a pad, which DTensor lays out like the operand.
"""

from __future__ import annotations

import functools

from keras_dist.distribution import backend


def updating_slices(slice_update):
    """Keras's TF `slice_update`, rewritten on a mesh."""

    @functools.wraps(slice_update)
    def wrapper(inputs, start_indices, updates):
        if backend.current_mesh() is None:
            return slice_update(inputs, start_indices, updates)
        return select_update(inputs, start_indices, updates)

    return wrapper


def select_update(inputs, start_indices, updates):
    """`inputs` with `updates` written at `start_indices` (XLA's clamping), by a select."""
    import tensorflow as tf

    inputs = tf.convert_to_tensor(inputs)
    updates = tf.cast(tf.convert_to_tensor(updates), inputs.dtype)
    rank = inputs.shape.rank
    operand_shape = tf.shape(inputs)
    update_shape = tf.shape(updates)
    if isinstance(start_indices, (list, tuple)):
        starts = tf.stack([tf.cast(index, tf.int32) for index in start_indices])
    else:
        starts = tf.cast(tf.convert_to_tensor(start_indices), tf.int32)
    # XLA clamps each start so that the update lies inside the operand.
    starts = tf.clip_by_value(starts, 0, tf.maximum(operand_shape - update_shape, 0))
    ends = starts + update_shape
    padded = tf.pad(updates, tf.stack([starts, operand_shape - ends], axis=1))
    # The pads are computed, so TensorFlow loses the static shape; DTensor needs it (an
    # all-gather of a dimension of unknown size fails inside a while loop).
    padded.set_shape(inputs.shape)
    inside = None
    static = inputs.shape.as_list()
    for dim in range(rank):
        size = static[dim] if static[dim] is not None else operand_shape[dim]
        positions = tf.range(size)
        here = (positions >= starts[dim]) & (positions < ends[dim])
        here = tf.reshape(here, [-1 if d == dim else 1 for d in range(rank)])
        here.set_shape([static[dim] if d == dim else 1 for d in range(rank)])
        inside = here if inside is None else inside & here
    from tensorflow.experimental import dtensor

    result = tf.where(inside, padded, inputs)
    result.set_shape(inputs.shape)
    return dtensor.relayout_like(result, updates)
