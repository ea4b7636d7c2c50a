"""How collectives talk: the one communication-options object of keras_dist.

`keras_dist.strategy(implementation=, bytes_per_pack=, timeout_seconds=)` and
`GradientAggregation(...)` / `AggregationConfig` take the same three settings. They are
checked here once (same messages everywhere) and turned into TensorFlow's
`tf.distribute.experimental.CommunicationOptions` here once.
"""

from __future__ import annotations

import dataclasses

from keras_dist import _validation

IMPLEMENTATIONS = ("auto", "ring", "nccl")


@dataclasses.dataclass(frozen=True)
class CommunicationSettings:
    """All-reduce settings shared by the strategy and gradient aggregation.

    Args:
        implementation: `"auto"`, `"ring"` or `"nccl"` collectives.
        bytes_per_pack: All-reduce pack size in bytes (0: TensorFlow decides).
        timeout_seconds: Abort a collective that takes longer (None: wait forever).

    Raises:
        ValueError: A setting is out of range (the message names it).
    """

    implementation: str = "auto"
    bytes_per_pack: int = 0
    timeout_seconds: float | None = None

    def __post_init__(self):
        _validation.check_choice("implementation", self.implementation, IMPLEMENTATIONS)
        if not _validation.is_int(self.bytes_per_pack) or self.bytes_per_pack < 0:
            raise ValueError(_validation.message(
                "bytes_per_pack", "an integer >= 0 (0 lets TensorFlow choose)",
                self.bytes_per_pack))
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
            bytes_per_pack=int(self.bytes_per_pack), timeout_seconds=self.timeout_seconds,
            implementation=implementation)


def communication_options(implementation="auto", bytes_per_pack=0, timeout_seconds=None):
    """Builds `tf.distribute.experimental.CommunicationOptions` from keras_dist's args."""
    return CommunicationSettings(implementation, bytes_per_pack, timeout_seconds).to_tf()
