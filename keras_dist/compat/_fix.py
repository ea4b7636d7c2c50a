"""The shape of one upstream fix: its name, upstream issue, probe and patch."""

from __future__ import annotations

import dataclasses
from typing import Callable


@dataclasses.dataclass(frozen=True)
class Fix:
    """One workaround for an upstream Keras/TensorFlow bug.

    Attributes:
        name: Stable identifier (used by `KERAS_DIST_DISABLE_COMPAT` and `applied()`).
        upstream: The upstream issue(s) the bug is tracked in.
        summary: One sentence: what goes wrong upstream and what keras_dist does.
        symbols: Registry names (`keras_dist.compat.registry`) of what the fix patches.
        probe: Returns `PRESENT`, `FIXED` or `UNKNOWN` for this Keras/TensorFlow.
        apply: Installs the fix (through `_patch.patch`, so `revert()` undoes it).
    """

    name: str
    upstream: str
    summary: str
    symbols: tuple[str, ...]
    probe: Callable[[], str]
    apply: Callable[[], None]
