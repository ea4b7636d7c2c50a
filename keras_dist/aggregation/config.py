"""`AggregationConfig`: what keras_dist does to gradients, validated once.

Kept apart from `keras_dist.aggregation` (which re-exports it) so the hook module stays
about the hook; it has no TensorFlow dependency and can be built before the runtime starts.
"""

from __future__ import annotations

import dataclasses

from keras_dist.aggregation import ops as gops

__all__ = ["AggregationConfig"]

_IMPLEMENTATIONS = ("auto", "ring", "nccl")


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class AggregationConfig:
    """What keras_dist does to gradients between the backward pass and the update.

    Args:
        clipnorm: Clip by the global norm of the aggregated gradient (single-device
            `global_clipnorm` semantics). None: no clipping.
        compression: None, `"bf16"` or `"fp16"`: the dtype gradients travel in.
        accumulation_steps: Micro-batches per update (1: update every step).
        bytes_per_pack: All-reduce pack size in bytes (0: TensorFlow decides).
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
        if self.clipnorm is not None and not (_is_number(self.clipnorm) and self.clipnorm > 0):
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
        pack = self.bytes_per_pack
        if isinstance(pack, bool) or not isinstance(pack, int) or pack < 0:
            raise ValueError(
                "Argument `bytes_per_pack` must be an integer >= 0 (0 lets TensorFlow "
                f"choose). Received: bytes_per_pack={pack!r}"
            )
        timeout = self.timeout_seconds
        if timeout is not None and not (_is_number(timeout) and timeout > 0):
            raise ValueError(
                "Argument `timeout_seconds` must be a positive number of seconds or None. "
                f"Received: timeout_seconds={timeout!r}"
            )
        if self.implementation not in _IMPLEMENTATIONS:
            raise ValueError(
                f"Argument `implementation` must be one of {list(_IMPLEMENTATIONS)}. "
                f"Received: implementation={self.implementation!r}"
            )
