"""`LearningRateWarmup`: a linear learning-rate warmup for large global batches."""

from __future__ import annotations

from keras_dist import _validation
from keras_dist.callbacks.base import Callback
from keras_dist.callbacks._optimizer import optimizer_of
from keras_dist.cluster import is_chief

__all__ = ["LearningRateWarmup"]


class LearningRateWarmup(Callback):
    """Warms the learning rate up linearly to `target_lr` over the first updates.

    Large global batches (many replicas) need a large learning rate, and starting at
    it diverges; Goyal et al. (2017) and Horovod's `LearningRateWarmupCallback` start
    at `target_lr / num_replicas` and rise linearly. At update `step` (counted by
    `optimizer.iterations`, so it resumes correctly and counts updates under
    accumulation) the rate is
    `initial_lr + (target_lr - initial_lr) * min(1, (step + 1) / warmup_steps)`.
    Epoch logs get `learning_rate`.

    Args:
        target_lr: The rate to reach (e.g. `keras_dist.scale_learning_rate(base)`).
            None: the optimizer's learning rate when training starts.
        warmup_epochs: Warm up over this many epochs (needs the steps per epoch).
        warmup_steps: Or over this many updates. Give exactly one of the two.
        initial_lr: Starting rate. None: `target_lr / num_replicas_in_sync`.
        steps_per_epoch: Used with `warmup_epochs` when `fit` does not know it.
        verbose: 1 prints (on the chief) when warmup ends.

    Raises:
        ValueError: Invalid arguments, or the optimizer uses a learning-rate schedule.

    Example:
        >>> warmup = keras_dist.callbacks.LearningRateWarmup(warmup_epochs=5)
        >>> model.fit(dataset, epochs=90, callbacks=[warmup])   # doctest: +SKIP
    """

    def __init__(self, target_lr=None, warmup_epochs=None, warmup_steps=None, *,
                 initial_lr=None, steps_per_epoch=None, verbose=0):
        super().__init__()
        if (warmup_epochs is None) == (warmup_steps is None):
            raise ValueError(
                "Pass exactly one of `warmup_epochs` and `warmup_steps`. Received: "
                f"warmup_epochs={warmup_epochs!r}, warmup_steps={warmup_steps!r}"
            )
        if warmup_epochs is not None:
            _validation.check_number("warmup_epochs", warmup_epochs, minimum=0)
        else:
            _validation.check_int("warmup_steps", warmup_steps, 1)
        if target_lr is not None:
            _validation.check_number("target_lr", target_lr, minimum=0)
        if initial_lr is not None:
            _validation.check_number("initial_lr", initial_lr, minimum=0, exclusive=False)
        if steps_per_epoch is not None:
            _validation.check_int("steps_per_epoch", steps_per_epoch, 1)
        self.target_lr = target_lr
        self.warmup_epochs = warmup_epochs
        self.warmup_steps = warmup_steps
        self.initial_lr = initial_lr
        self.steps_per_epoch = steps_per_epoch
        self.verbose = verbose
        self._total_steps = None
        self._done = False

    def _lr_variable(self):
        optimizer = optimizer_of(self.model, "LearningRateWarmup")
        lr = optimizer.learning_rate
        if not hasattr(lr, "assign"):
            raise ValueError(
                "LearningRateWarmup needs a constant learning rate it can set, but the "
                "optimizer uses a schedule or callable. Use a schedule with built-in "
                "warmup instead, e.g. keras.optimizers.schedules.CosineDecay(..., "
                "warmup_target=..., warmup_steps=...)."
            )
        return lr

    def on_train_begin(self, logs=None):
        lr = self._lr_variable()
        if self.target_lr is None:
            self.target_lr = float(lr.numpy())
        if self.initial_lr is None:
            self.initial_lr = self.target_lr / self.model.distribute_strategy.num_replicas_in_sync
        if self.warmup_steps is not None:
            self._total_steps = self.warmup_steps
        else:
            steps = self.steps_per_epoch or (self.params or {}).get("steps")
            if not steps:
                raise ValueError(
                    "LearningRateWarmup(warmup_epochs=...) needs the number of steps per "
                    "epoch, which fit() does not know for this dataset. Pass "
                    "steps_per_epoch= here (or to fit), or use warmup_steps= instead."
                )
            self._total_steps = max(1, round(self.warmup_epochs * steps))
        self._done = False

    def on_train_batch_begin(self, batch, logs=None):
        if self._done:
            return
        step = int(self.model.optimizer.iterations.numpy())
        fraction = min(1.0, (step + 1) / self._total_steps)
        self._lr_variable().assign(
            self.initial_lr + (self.target_lr - self.initial_lr) * fraction
        )
        if fraction >= 1.0:
            self._done = True
            if self.verbose and is_chief():
                print(f"LearningRateWarmup: reached learning rate {self.target_lr:g} "
                      f"after {self._total_steps} updates.")

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs.setdefault("learning_rate", float(self._lr_variable().numpy()))
