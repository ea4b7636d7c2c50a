"""Resuming mid-epoch: read and drop the batches a restored run already trained on."""

from __future__ import annotations

__all__ = ["StepSkipper"]


class StepSkipper:
    """Wraps `model.train_function` to read and drop the first `steps` batches.

    The Keras fit loop has no way to start an epoch part-way, but it calls
    `model.train_function(iterator)` once per `steps_per_execution` batches and passes
    the iterator; taking the batches from it without training advances the input to
    where the interrupted run stopped.
    """

    def __init__(self, function, steps, steps_per_execution):
        self.function = function
        self.remaining = steps
        self.steps_per_execution = max(1, int(steps_per_execution or 1))

    @classmethod
    def install(cls, model, steps):
        function = model.train_function
        while isinstance(function, StepSkipper):  # left over from an aborted fit
            function = function.function
        skipper = cls(function, steps, getattr(model, "steps_per_execution", 1))
        model.train_function = skipper
        return skipper

    def remove(self, model):
        if model.train_function is self:
            model.train_function = self.function
        self.remaining = 0

    def __call__(self, iterator):
        if self.remaining <= 0:
            return self.function(iterator)
        count = min(self.remaining, self.steps_per_execution)
        for _ in range(count):
            if hasattr(iterator, "get_next"):
                iterator.get_next()
            else:
                next(iterator)
        self.remaining -= count
        return {}
