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
    """`inputs` with `updates` written at `start_indices` (XLA's clamping), by a select.

    Every shape stays static (DTensor cannot all-gather a dimension of unknown size): the
    update is spread to the operand's shape by a gather per dimension, not a computed pad.
    """
    import tensorflow as tf

    inputs = tf.convert_to_tensor(inputs)
    updates = tf.cast(tf.convert_to_tensor(updates), inputs.dtype)
    rank = inputs.shape.rank
    operand_shape, update_shape = tf.shape(inputs), tf.shape(updates)
    if isinstance(start_indices, (list, tuple)):
        starts = tf.stack([tf.cast(index, tf.int32) for index in start_indices])
    else:
        starts = tf.cast(tf.convert_to_tensor(start_indices), tf.int32)
    # XLA clamps each start so that the update lies inside the operand.
    starts = tf.clip_by_value(starts, 0, tf.maximum(operand_shape - update_shape, 0))
    static, update_static = inputs.shape.as_list(), updates.shape.as_list()
    spread, inside = updates, None
    for dim in range(rank):
        size = static[dim] if static[dim] is not None else operand_shape[dim]
        offsets = tf.range(size) - starts[dim]
        here = (offsets >= 0) & (offsets < update_shape[dim])
        here = tf.reshape(here, [-1 if d == dim else 1 for d in range(rank)])
        inside = here if inside is None else inside & here
        if static[dim] is None or static[dim] != update_static[dim]:
            spread = tf.gather(spread, tf.clip_by_value(offsets, 0, update_shape[dim] - 1),
                               axis=dim)
    # A blend, not a select: DTensor's SelectV2 all-gathers an operand whose layout
    # differs and then fails to fit it to the output's shards ("Cannot broadcast input
    # shape [4,12,4,4] into final shape [4,12,1,4]"). With a 0/1 mask, x * 1 + y * 0 == x
    # exactly for finite values (a non-finite value in the operand outside the update
    # would become NaN: the cache and token buffers hold none).
    keep = tf.cast(tf.logical_not(inside), inputs.dtype)
    take = tf.cast(inside, inputs.dtype)
    return inputs * keep + spread * take


def einsum_as_one_op(einsum):
    """Keras's TF `einsum`: on a mesh, one `Einsum` op that DTensor expands as a whole.

    Off the mesh Keras rewrites some equations as transposes and matmuls (faster kernels);
    on a mesh, DTensor cannot expand a transpose whose output is more sharded than its
    input ("TransposeOp SPMD needs communication"), which the rewrite meets in keras-hub's
    attention over a KV cache.
    """

    @functools.wraps(einsum)
    def wrapper(subscripts, *operands, **kwargs):
        if backend.current_mesh() is None or kwargs or len(operands) != 2:
            return einsum(subscripts, *operands, **kwargs)
        import tensorflow as tf

        x, y = (tf.convert_to_tensor(operand) for operand in operands)
        if x.dtype != y.dtype:
            return einsum(subscripts, *operands, **kwargs)
        return tf.einsum(subscripts, x, y)

    return wrapper


def converting_dtensors(convert_to_numpy):
    """Keras's TF `convert_to_numpy`: a DTensor (e.g. `generate()`'s tokens on a mesh)
    gives its whole value."""

    @functools.wraps(convert_to_numpy)
    def wrapper(x):
        if backend.is_dtensor(x):
            x = backend.whole(x)
        return convert_to_numpy(x)

    return wrapper
