"""Gradient accumulators of `keras_dist.aggregation` (`accumulation_steps=k > 1`).

One replica-local float32 accumulator per trainable variable (`ON_READ`, `SUM`): each
replica adds its micro-batch gradient into its own copy, with no communication, and
the aggregation reads the average every k-th micro-step.

Sparse gradients (`tf.IndexedSlices`, from embedding lookups) are added **sparsely**:
a scatter-add of the looked-up rows into the replica's own copy. `ON_READ` variables
refuse `scatter_add` in replica context, so the rows go through the replica's own
variable handle (`ResourceScatterAdd`), which is what `scatter_add` would do on a plain
variable. Densifying instead (`tf.convert_to_tensor(slices)`, then `assign_add`)
materialises a zero-filled table-sized tensor per replica per micro-step; on a
30k x 128 table (14.6 MB) with 4096 tokens per replica that is 14.6 MB of temporaries
instead of none, and 1.4-1.8x the micro-step time on 2 CPU replicas (see
`benchmarks/sparse_accumulation.py`; process RSS is too coarse to show the temporary). The accumulator itself is dense (the sum of k
micro-batches touches up to k times the rows), so the averaged gradient leaves here
dense and is all-reduced once per update like any dense gradient.
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["accumulate", "make_accumulators", "read_and_reset"]

SPARSE, DENSE = "sparse", "dense"


def make_accumulators(optimizer, accumulation_steps: int) -> list:
    """One zero-filled replica-local accumulator per trainable variable of `optimizer`.

    Create them in the strategy's scope. 16-bit variables get float32 accumulators so
    that k micro-batch gradients add up without rounding.

    Raises:
        ValueError: The optimizer is not built (its variables are not known yet).
    """
    import tensorflow as tf

    if accumulation_steps == 1:
        return []
    if not optimizer.built:
        raise ValueError(
            "accumulation_steps > 1 needs a built optimizer to size its accumulators. "
            "Build the model (e.g. start it with keras.Input) and call "
            "optimizer.build(model.trainable_variables) first."
        )
    accumulators = []
    for variable in optimizer._trainable_variables:
        dtype = tf.as_dtype(variable.dtype)
        if dtype.is_floating and dtype.size < 4:
            dtype = tf.float32
        accumulators.append(tf.Variable(
            tf.zeros(variable.shape, dtype), trainable=False,
            name="keras_dist_accumulator",
            synchronization=tf.VariableSynchronization.ON_READ,
            aggregation=tf.VariableAggregation.SUM,
        ))
    return accumulators


def accumulate(accumulators: Sequence, grads: Sequence, sparse: str = SPARSE) -> None:
    """Adds each gradient to its accumulator (replica context; `None` is skipped).

    Args:
        accumulators: From `make_accumulators`, in the order of `grads`.
        grads: Dense tensors or `tf.IndexedSlices` (duplicate indices add up).
        sparse: `"sparse"` scatter-adds `IndexedSlices` rows; `"dense"` densifies them
            first (kept for the benchmark that justifies the default).

    Raises:
        ValueError: `sparse` is neither, or a gradient's shape does not match.
    """
    import tensorflow as tf

    if sparse not in (SPARSE, DENSE):
        raise ValueError(
            f"Argument `sparse` must be 'sparse' or 'dense'. Received: sparse={sparse!r}"
        )
    for accumulator, grad in zip(accumulators, grads):
        if grad is None:
            continue
        if isinstance(grad, tf.IndexedSlices) and sparse == SPARSE:
            _scatter_add(accumulator, grad)
            continue
        dense = tf.convert_to_tensor(grad) if isinstance(grad, tf.IndexedSlices) else grad
        if dense.shape.is_fully_defined() and dense.shape != accumulator.shape:
            raise ValueError(
                f"A gradient of shape {dense.shape} cannot be accumulated into a "
                f"variable of shape {accumulator.shape}. Received gradients in a "
                "different order or for different variables than the optimizer's."
            )
        accumulator.assign_add(tf.cast(dense, accumulator.dtype))


def _scatter_add(accumulator, slices) -> None:
    import tensorflow as tf

    rows = slices.values.shape[1:]
    if rows.is_fully_defined() and rows != accumulator.shape[1:]:
        raise ValueError(
            f"Sparse gradient rows of shape {rows} cannot be accumulated into a variable "
            f"of shape {accumulator.shape} (rows of shape {accumulator.shape[1:]}). "
            "Received gradients in a different order or for different variables than "
            "the optimizer's."
        )
    # In replica context `handle` is this replica's own copy of the ON_READ variable
    # (DistributedVariable.handle); scatter_add itself is refused on ON_READ variables.
    tf.raw_ops.ResourceScatterAdd(
        resource=accumulator.handle,
        indices=slices.indices,
        updates=tf.cast(slices.values, accumulator.dtype),
    )


def read_and_reset(accumulators: Sequence, accumulation_steps: int) -> list:
    """The averages `sum / k` (replica-local), then zeroes the accumulators."""
    import tensorflow as tf

    averaged = [accumulator.read_value() / accumulation_steps
                for accumulator in accumulators]
    with tf.control_dependencies(averaged):
        for accumulator in accumulators:
            accumulator.assign(tf.zeros_like(accumulator))
    return averaged
