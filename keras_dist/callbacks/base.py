"""The base class of keras_dist's callbacks: a Keras 3 callback tf_keras can also drive.

tf_keras' (legacy Keras 2) `CallbackList` asks each callback whether it implements batch
hooks through private methods Keras 3 callbacks lack; answering them lets the callbacks
that only read the model (warmup, sync checks, backups) run under TF_USE_LEGACY_KERAS=1.
"""

from __future__ import annotations

import keras

__all__ = ["Callback"]


class Callback(keras.callbacks.Callback):
    """`keras.callbacks.Callback` plus the batch-hook queries of tf_keras."""

    def _implements_train_batch_hooks(self) -> bool:
        cls = type(self)
        return (cls.on_train_batch_begin is not keras.callbacks.Callback.on_train_batch_begin
                or cls.on_train_batch_end is not keras.callbacks.Callback.on_train_batch_end)

    def _implements_test_batch_hooks(self) -> bool:
        cls = type(self)
        return (cls.on_test_batch_begin is not keras.callbacks.Callback.on_test_batch_begin
                or cls.on_test_batch_end is not keras.callbacks.Callback.on_test_batch_end)

    def _implements_predict_batch_hooks(self) -> bool:
        cls = type(self)
        return (
            cls.on_predict_batch_begin is not keras.callbacks.Callback.on_predict_batch_begin
            or cls.on_predict_batch_end is not keras.callbacks.Callback.on_predict_batch_end
        )
