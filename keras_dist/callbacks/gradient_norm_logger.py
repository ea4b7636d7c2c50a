"""`GradientNormLogger`: the global norm of the aggregated gradient, in the logs."""

from __future__ import annotations

from keras_dist import aggregation
from keras_dist.callbacks.base import Callback
from keras_dist.callbacks._optimizer import install_aggregation, optimizer_of

__all__ = ["GradientNormLogger"]


class GradientNormLogger(Callback):
    """Adds `gradient_norm` (global norm of the aggregated gradient) to the logs.

    The epoch value is the mean over the epoch's updates; with `update_freq="batch"`
    each batch's logs also get the latest update's norm. The norm is taken after the
    all-reduce and before clipping, so it is the norm single-device training would see.
    If no `GradientAggregation` callback installed keras_dist's aggregation, this one
    installs it with default settings (plain all-reduce, same weights as stock Keras).

    Args:
        update_freq: `"epoch"` or `"batch"`.

    Example:
        >>> logger = keras_dist.callbacks.GradientNormLogger()
        >>> history = model.fit(x, y, callbacks=[logger])       # doctest: +SKIP
        >>> history.history["gradient_norm"]                     # doctest: +SKIP
    """

    def __init__(self, update_freq="epoch"):
        super().__init__()
        if update_freq not in ("epoch", "batch"):
            raise ValueError(
                "Argument `update_freq` must be 'epoch' or 'batch'. "
                f"Received: update_freq={update_freq!r}"
            )
        self.update_freq = update_freq

    def _aggregator(self):
        return aggregation.get_aggregator(self.model.optimizer)

    def on_train_begin(self, logs=None):
        if aggregation.get_aggregator(optimizer_of(self.model, "GradientNormLogger")) is None:
            install_aggregation(self.model, aggregation.AggregationConfig(), "GradientNormLogger")

    def on_epoch_begin(self, epoch, logs=None):
        self._aggregator().mean_gradient_norm(reset=True)

    def on_train_batch_end(self, batch, logs=None):
        if self.update_freq == "batch" and logs is not None:
            logs["gradient_norm"] = self._aggregator().gradient_norm

    def on_epoch_end(self, epoch, logs=None):
        if logs is None:
            return
        aggregator = self._aggregator()
        mean = aggregator.mean_gradient_norm()
        logs["gradient_norm"] = aggregator.gradient_norm if mean is None else mean
