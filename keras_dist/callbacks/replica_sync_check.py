"""`ReplicaSyncCheck`: bitwise checks that every replica holds the same weights."""

from __future__ import annotations

import keras

from keras_dist import _validation
from keras_dist.callbacks.base import Callback

__all__ = ["ReplicaDivergenceError", "ReplicaSyncCheck"]


class ReplicaDivergenceError(RuntimeError):
    """Raised by `ReplicaSyncCheck` when replicas or workers hold different weights."""


class ReplicaSyncCheck(Callback):
    """Checks that every replica on every worker holds bit-identical weights.

    Synchronous data parallelism keeps all copies of the model identical; a custom
    layer that updates a variable from local data, a non-deterministic op feeding an
    assignment, or a worker restored from a different checkpoint breaks that silently.
    Every `every_n_batches` batches this computes one bitwise checksum per variable on
    each replica, gathers them (one small all-gather) and raises
    `ReplicaDivergenceError` naming the first variable that differs. Model weights and
    the optimizer's variables are checked; per-replica (`ON_READ`) variables such as
    metrics are skipped. All workers must use it with the same settings.

    Args:
        every_n_batches: How often to check (>= 1).
        include_optimizer: Also check the optimizer's variables (momentum, iterations).

    Raises:
        ReplicaDivergenceError: During `fit`, when copies differ.

    Example:
        >>> check = keras_dist.callbacks.ReplicaSyncCheck(every_n_batches=100)
        >>> model.fit(dataset, callbacks=[check])                # doctest: +SKIP
    """

    def __init__(self, every_n_batches=100, include_optimizer=True):
        super().__init__()
        _validation.check_int("every_n_batches", every_n_batches, 1)
        self.every_n_batches = every_n_batches
        self.include_optimizer = include_optimizer
        self._batches_seen = 0
        self._epoch = 0
        self._checksums = None

    def on_train_begin(self, logs=None):
        self._checksums = None  # variables may have changed since the last fit

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        self._batches_seen += 1
        if self._batches_seen % self.every_n_batches == 0:
            self.check(where=f"after batch {batch} of epoch {self._epoch}")

    def check(self, where="now"):
        """Runs the check once (collective: call it on every worker)."""
        strategy = self.model.distribute_strategy
        if strategy.num_replicas_in_sync == 1:
            return
        if self._checksums is None:
            variables = list(self.model.weights)
            if self.include_optimizer and self.model.optimizer is not None:
                variables += list(self.model.optimizer.variables)
            self._checksums = _Checksums(strategy, variables)
        divergent = self._checksums.divergent()
        if divergent:
            (name, replicas), others = divergent[0], [n for n, _ in divergent[1:]]
            also = f" Also differ: {others[:5]}{' ...' if len(others) > 5 else ''}." if (
                others) else ""
            raise ReplicaDivergenceError(
                f"Variable {name!r} differs across replicas {where}: replica(s) "
                f"{replicas} hold values other than replica 0's (of "
                f"{strategy.num_replicas_in_sync} replicas in sync).{also} Every update "
                "must be computed from aggregated values; look for a layer or callback "
                "that assigns a variable from replica-local data, or for a worker that "
                "restored a different checkpoint."
            )


def _bitwise_checksum(value):
    """An int64 checksum of a tensor's bits; equal values give equal checksums."""
    import tensorflow as tf

    dtype = value.dtype
    if dtype.is_floating:
        value = tf.bitcast(value, {2: tf.int16, 4: tf.int32, 8: tf.int64}[dtype.size])
    flat = tf.reshape(tf.cast(value, tf.int64), [-1])
    # Position weights make a swap of two elements change the sum; int64 wraps.
    weights = tf.range(1, tf.size(flat, out_type=tf.int64) + 1, dtype=tf.int64)
    return tf.reduce_sum(flat * weights)


class _Checksums:
    """One checksum per variable on every replica, gathered to every worker."""

    def __init__(self, strategy, variables):
        import tensorflow as tf

        self.names, tf_variables, seen = [], [], set()
        for variable in variables:
            tf_variable = variable.value if isinstance(variable, keras.Variable) else variable
            on_read = tf.VariableSynchronization.ON_READ
            if id(tf_variable) in seen or getattr(tf_variable, "synchronization", None) == on_read:
                continue  # ON_READ variables (metrics) are per-replica by design
            seen.add(id(tf_variable))
            tf_variables.append(tf_variable)
            self.names.append(getattr(variable, "path", None) or variable.name)

        def local_checksums():
            # In replica context a mirrored variable reads as this replica's copy.
            return tf.stack([_bitwise_checksum(tf.convert_to_tensor(v))
                             for v in tf_variables])[tf.newaxis]

        @tf.function
        def gathered():
            return strategy.gather(strategy.run(local_checksums), axis=0)

        self._gathered = gathered

    def divergent(self):
        """[(variable name, ids of replicas differing from replica 0)], in order."""
        table = self._gathered().numpy()  # [replicas, variables]
        differs = (table != table[:1]).any(axis=0)
        return [
            (self.names[column], (table[:, column] != table[0, column]).nonzero()[0].tolist())
            for column in differs.nonzero()[0]
        ]
