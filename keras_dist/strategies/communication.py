"""How collectives talk: the one communication-options object of keras_dist.

`keras_dist.strategy(implementation=, bytes_per_pack=, timeout_seconds=)` and
`GradientAggregation(...)` / `AggregationConfig` take the same three settings. They are
checked here once (same messages everywhere) and turned into TensorFlow's
`tf.distribute.experimental.CommunicationOptions` here once.

Why `timeout_seconds` has no default: a peer that *dies* is detected without it
(TensorFlow's coordination service fails every survivor's collectives with
`tf.errors.UnavailableError`; measured on CPU, 2 workers: ~6 s for a killed worker, <1 s
for a killed chief), and TensorFlow starts one thread per collective that sleeps for
`timeout_seconds` (measured: ~6 threads per training step of a small model, so 600 s at
10 steps/s keeps ~36,000 threads alive, beyond many containers' pid limits). Set it for
debugging hangs, or where steps are slow enough that the thread count stays small.
"""

from __future__ import annotations

import dataclasses

from keras_dist import _validation

IMPLEMENTATIONS = ("auto", "ring", "nccl")

# `keras_dist.strategy(bytes_per_pack="auto")` (the default): gradients are all-reduced in
# packs of about this many bytes, in reverse layer order, each issued as soon as its
# gradients exist, so communication overlaps the backward pass. Chosen from data by
# benchmarks/buckets.py (README, "Overlap"); 0 is TensorFlow's own default, one pack
# that waits for the last gradient.
DEFAULT_BYTES_PER_PACK = 1 << 20
AUTO = "auto"
# One pack, given per call (aggregation, the benchmarks): there 0 means "the strategy's
# setting", so one pack is asked for with a size no gradient list reaches.
ONE_PACK = 1 << 62


def resolve_bytes_per_pack(bytes_per_pack) -> int:
    """`"auto"` -> keras_dist's measured default; an integer stays what it is."""
    return DEFAULT_BYTES_PER_PACK if bytes_per_pack == AUTO else int(bytes_per_pack)


@dataclasses.dataclass(frozen=True)
class CommunicationSettings:
    """All-reduce settings shared by the strategy and gradient aggregation.

    Args:
        implementation: `"auto"`, `"ring"` or `"nccl"` collectives.
        bytes_per_pack: All-reduce pack size in bytes; `"auto"`: keras_dist's measured
            default (`DEFAULT_BYTES_PER_PACK`); 0: one pack, or, in a per-call setting
            (aggregation), the strategy's setting.
        timeout_seconds: Abort a collective that takes longer (None: wait forever).

    Raises:
        ValueError: A setting is out of range (the message names it).
    """

    implementation: str = "auto"
    bytes_per_pack: int | str = 0
    timeout_seconds: float | None = None

    def __post_init__(self):
        _validation.check_choice("implementation", self.implementation, IMPLEMENTATIONS)
        pack = self.bytes_per_pack
        if pack != AUTO and (not _validation.is_int(pack) or pack < 0):
            raise ValueError(_validation.message(
                "bytes_per_pack", "an integer >= 0 (bytes; 0: one pack in "
                "strategy(), the strategy's setting in aggregation) or 'auto' "
                "(keras_dist's measured default)", pack))
        timeout = self.timeout_seconds
        if timeout is not None and not (_validation.is_number(timeout) and timeout > 0):
            raise ValueError(_validation.message(
                "timeout_seconds", "a positive number of seconds or None", timeout))

    def to_tf(self):
        """The equivalent `tf.distribute.experimental.CommunicationOptions`."""
        import tensorflow as tf

        implementation = {
            "auto": tf.distribute.experimental.CommunicationImplementation.AUTO,
            "ring": tf.distribute.experimental.CommunicationImplementation.RING,
            "nccl": tf.distribute.experimental.CommunicationImplementation.NCCL,
        }[self.implementation]
        return tf.distribute.experimental.CommunicationOptions(
            bytes_per_pack=resolve_bytes_per_pack(self.bytes_per_pack),
            timeout_seconds=self.timeout_seconds,
            implementation=implementation)


def communication_options(implementation="auto", bytes_per_pack=0, timeout_seconds=None):
    """Builds `tf.distribute.experimental.CommunicationOptions` from keras_dist's args."""
    return CommunicationSettings(implementation, bytes_per_pack, timeout_seconds).to_tf()
