"""`AggregationConfig`: what keras_dist does to gradients, validated once.

Kept apart from `keras_dist.aggregation` (which re-exports it) so the hook module stays
about the hook; it has no TensorFlow dependency and can be built before the runtime starts.
"""

from __future__ import annotations

import dataclasses

from keras_dist import _validation
from keras_dist.strategies.communication import CommunicationSettings
from keras_dist.aggregation import ops as gops

__all__ = ["AggregationConfig"]


@dataclasses.dataclass(frozen=True)
class AggregationConfig:
    """What keras_dist does to gradients between the backward pass and the update.

    Args:
        clipnorm: Clip by the global norm of the aggregated gradient (single-device
            `global_clipnorm` semantics). None: no clipping.
        compression: None, `"bf16"` or `"fp16"`: the dtype gradients travel in.
        accumulation_steps: Micro-batches per update (1: update every step).
        bytes_per_pack: All-reduce bucket size in bytes (0: the strategy's, by default
            keras_dist's measured bucket size; see `keras_dist.strategy`).
        timeout_seconds: Abort an all-reduce that takes longer (None: wait forever).
        implementation: `"auto"`, `"ring"` or `"nccl"` collectives.

    Raises:
        ValueError: An argument is out of range.
    """

    clipnorm: float | None = None
    compression: str | None = None
    accumulation_steps: int = 1
    bytes_per_pack: int = 0
    timeout_seconds: float | None = None
    implementation: str = "auto"

    def __post_init__(self):
        if self.clipnorm is not None and not (_validation.is_number(self.clipnorm) and self.clipnorm > 0):
            raise ValueError(
                "Argument `clipnorm` must be a number > 0 or None. "
                f"Received: clipnorm={self.clipnorm!r}"
            )
        if self.compression not in gops.COMPRESSIONS:
            raise ValueError(
                "Argument `compression` must be one of None, 'bf16', 'fp16'. "
                f"Received: compression={self.compression!r}"
            )
        steps = self.accumulation_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(
                "Argument `accumulation_steps` must be an integer >= 1. "
                f"Received: accumulation_steps={steps!r}"
            )
        self.communication  # the checks shared with keras_dist.strategy()

    @property
    def communication(self) -> CommunicationSettings:
        """The all-reduce settings, the same object `keras_dist.strategy()` checks."""
        return CommunicationSettings(self.implementation, self.bytes_per_pack,
                                     self.timeout_seconds)
