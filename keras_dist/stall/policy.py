"""When a worker group is stalled, and who is behind: the one rule the launcher and the
in-worker watchdog share.

A **stall** is: while at least one worker is inside a Keras loop (`fit`, `evaluate`,
`predict`), no worker made progress for the budget. Progress is any event of a loop (a
batch or epoch began or ended, the loop began or ended, a backup save or restore began or
ended), so `evaluate` between epochs, a `BackupAndRestore` save and a slow but
progressing worker are progress, and a worker stuck in a callback, a data loader or a
collective is not. Outside Keras's loops (custom training loops, an idle worker pool)
keras_dist cannot see steps and never calls a stall.

The budget (`StallTimeout`):

* `S` is `--stall-timeout` / `KERAS_DIST_STALL_TIMEOUT` when given (0 turns detection
  off), else the default: `max(300 s, 20 x the slowest train step seen so far)`, so short
  steps are covered within 300 s and slow ones (torch's 10-minute NCCL default allows the
  same) are never cut short;
* while any worker is in a slow phase -- start-up (before the first batch of its loop or
  of an epoch ended: tracing, compilation, an input iterator filling its buffers), a
  backup restore or save -- the budget is
  `max(S, the start-up timeout)` (`KERAS_DIST_STARTUP_TIMEOUT`, 600 s by default: the one
  that bounds meeting the peers).

Who is behind: workers of a synchronous job pass the same events in the same order, so
the workers at the lowest position -- (train steps finished, events since the last one) --
are the ones the others wait for; when all stand at the same position, all are named.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Mapping

from keras_dist import _validation

__all__ = ["DEFAULT_STALL_TIMEOUT", "ENV_NAME", "Detector", "Stall", "StallTimeout",
           "check_stall_timeout", "stall_timeout"]

ENV_NAME = "KERAS_DIST_STALL_TIMEOUT"
DEFAULT_STALL_TIMEOUT = 300.0
# The default grows with the slowest step: a step this many times slower than any seen
# is not a slow step but a stuck one.
SLOWEST_STEP_FACTOR = 20.0


@dataclasses.dataclass(frozen=True)
class StallTimeout:
    """The stall budget of a job.

    Attributes:
        seconds: `S` as given (`--stall-timeout`, `KERAS_DIST_STALL_TIMEOUT`), or `None`
            for the default rule; 0 turns stall detection off.
        startup_seconds: The start-up timeout: slow phases get `max(S, startup_seconds)`.
    """

    seconds: float | None = None
    startup_seconds: float = 600.0

    @property
    def enabled(self) -> bool:
        return self.seconds != 0

    def budget(self, slowest_step: float = 0.0, slow_phase: bool = False) -> float:
        """Seconds without progress that make a stall (`inf` when detection is off)."""
        if not self.enabled:
            return math.inf
        base = (self.seconds if self.seconds is not None
                else max(DEFAULT_STALL_TIMEOUT, SLOWEST_STEP_FACTOR * slowest_step))
        return max(base, self.startup_seconds) if slow_phase else base

    def describe(self) -> str:
        if not self.enabled:
            return "off"
        if self.seconds is None:
            return (f"max({DEFAULT_STALL_TIMEOUT:g} s, {SLOWEST_STEP_FACTOR:g} x the "
                    "slowest step)")
        return f"{self.seconds:g} s"


def stall_timeout(seconds: float | None = None, *, startup_seconds: float | None = None,
                  environ: Mapping[str, str] | None = None) -> StallTimeout:
    """The job's `StallTimeout`: `seconds`, else `KERAS_DIST_STALL_TIMEOUT`, else the default.

    Args:
        seconds: The stall timeout in seconds (>= 0; 0 turns detection off), or `None`.
        startup_seconds: The start-up budget; `None` reads `KERAS_DIST_STARTUP_TIMEOUT`
            (default 600 s), as the rendezvous does.
        environ: The environment to read (default `os.environ`).

    Raises:
        ValueError: `seconds` or the variable is not a number >= 0.
    """
    from keras_dist.startup.rendezvous import startup_timeout

    environ = os.environ if environ is None else environ
    value = check_stall_timeout(seconds)
    if value is None:
        value = _from_env(environ.get(ENV_NAME))
    if startup_seconds is None:
        startup_seconds = startup_timeout(None, environ=environ)
    return StallTimeout(value, float(startup_seconds))


def check_stall_timeout(seconds) -> float | None:
    """The `stall_timeout` argument checked (None, or seconds >= 0), as every launcher takes it."""
    return _validation.check_optional_number("stall_timeout", seconds, minimum=0,
                                             exclusive=False, unit="seconds",
                                             hint="Pass 0 to turn stall detection off.")


def _from_env(text: str | None) -> float | None:
    if text is None or not text.strip():
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise ValueError(
            f"Environment variable {ENV_NAME} must be a number of seconds >= 0 (0 turns "
            f"stall detection off). Received: {ENV_NAME}={text!r}. Unset it for the "
            f"default, {StallTimeout().describe()}.")
    return value


@dataclasses.dataclass(frozen=True)
class Stall:
    """A detected stall.

    Attributes:
        behind: Indices of the workers the others wait for.
        message: One line naming them and where every worker is, e.g. `"worker 1 made
            no progress for 31 s after step 30 (in callbacks, on_train_batch_end);
            worker 0 waits in step 31"`.
        seconds: How long the group made no progress.
    """

    behind: tuple[int, ...]
    message: str
    seconds: float


class Detector:
    """Feeds on the workers' progress records over time; says when they stalled.

    A record is the dict `keras_dist.stall.progress` publishes (`None` for a worker that
    has not published one: still starting, or not using Keras's loops). Times are the
    observer's own monotonic clock, so records from other hosts need no clock agreement.
    """

    def __init__(self, timeout: StallTimeout, num_workers: int, now: float):
        self.timeout = timeout
        self.num_workers = num_workers
        self._events: list[int | None] = [None] * num_workers
        self._changed = [now] * num_workers  # when each worker last made progress
        self._progress = now  # when any worker last did (or the group was unwatched)

    def observe(self, records: Mapping[int, dict | None], now: float) -> Stall | None:
        """Takes the latest records; returns the `Stall` once the budget is exceeded."""
        full = [records.get(index) for index in range(self.num_workers)]
        for index, record in enumerate(full):
            events = None if record is None else record.get("events")
            if events != self._events[index]:
                self._events[index] = events
                self._changed[index] = self._progress = now
        if not any(record and record.get("loop") for record in full):
            self._progress = now  # nobody in a Keras loop: nothing to time
            return None
        slowest = max((record.get("slowest_step") or 0.0) for record in full if record)
        slow_phase = any(record is None or record.get("slow") for record in full)
        budget = self.timeout.budget(slowest, slow_phase)
        waited = now - self._progress
        if waited <= budget:
            return None
        behind = _behind(full)
        return Stall(tuple(behind), self._message(full, behind, now), waited)

    def _message(self, records, behind, now) -> str:
        parts = []
        for index in behind:
            idle = now - self._changed[index]
            parts.append(f"worker {index} made no progress for {idle:.0f} s"
                         f"{_where(records[index], stuck=True)}")
        for index, record in enumerate(records):
            if index not in behind:
                parts.append(f"worker {index} waits{_where(record, stuck=False)}")
        return "; ".join(parts)


def position(record: dict | None) -> tuple[int, int]:
    """A worker's place in the common sequence of events: (steps done, events since)."""
    if record is None:
        return (-1, 0)
    return (int(record.get("step", 0)), int(record.get("events_since_step", 0)))


def _behind(records) -> list[int]:
    positions = [position(record) for record in records]
    lowest = min(positions)
    return [index for index, place in enumerate(positions) if place == lowest]


def _where(record: dict | None, stuck: bool) -> str:
    if record is None:
        return " (in start-up: it has not begun a Keras loop)"
    phase, detail, step = record.get("phase", "?"), record.get("detail"), record.get("step", 0)
    if phase == "train step":
        return f" in step {step + 1}" + (" (in its train step)" if stuck else "")
    after = f" after step {step}" if step else ""
    if stuck:
        return f"{after} (in {phase}, {detail})" if detail else f"{after} (in {phase})"
    return f" in {phase} ({detail}){after}" if detail else f" in {phase}{after}"
