"""Shrinking a worker group instead of stopping (`keras-dist launch --min-workers M`).

A failed group restarts at full size. A slot (a worker index of the first attempt) that
fails again before its restarted group came up -- before any worker met all its peers
(`keras_dist.startup.group_up`), i.e. a host that is gone -- is dropped from the next
restart, down to `min_workers`. The workers are renumbered 0..M-1 in `TF_CONFIG`;
`KERAS_DIST_SLOT` keeps each worker's slot. A script with a fixed global batch and
`keras_dist.callbacks.BackupAndRestore` resumes exactly on the smaller group.
"""

from __future__ import annotations

import dataclasses

from keras_dist import _validation

__all__ = ["Group", "check_min_workers"]


def check_min_workers(min_workers, num_workers: int) -> None:
    """`min_workers` must be None or 1..num_workers (a usage error otherwise)."""
    if min_workers is None:
        return
    _validation.check_int("min_workers", min_workers, minimum=1)
    if min_workers > num_workers:
        raise ValueError(_validation.message(
            "min_workers", f"at most the number of workers ({num_workers})", min_workers,
            "It is the smallest group to shrink to; pass a value between 1 and the "
            "number of workers, or None to never shrink"))


@dataclasses.dataclass
class Group:
    """The worker slots of the next attempt, and the shrink rule (`min_workers`)."""

    slots: list[int]
    min_workers: int
    dropped: list[int] = dataclasses.field(default_factory=list)
    last_failed_slot: int | None = None

    def after_failure(self, failed: int, came_up: bool, restarts: int, max_restarts: int,
                      reason: str) -> str:
        """Decides the next attempt's slots; returns what to print (after the tag)."""
        slot = self.slots[failed]
        again = slot == self.last_failed_slot and not came_up
        self.last_failed_slot = slot
        if again and len(self.slots) > self.min_workers:
            self.slots.remove(slot)
            self.dropped.append(slot)
            self.last_failed_slot = None
            return (f"worker slot {slot} failed again before the group came up "
                    f"({reason}); dropped slot {slot}, {len(self.slots)} worker(s) "
                    f"continue (restart {restarts} of {max_restarts})")
        return (f"restarting worker group (restart {restarts} of "
                f"{max_restarts}) after {reason}")
