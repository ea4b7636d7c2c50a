"""This process's progress in Keras's loops: the heartbeat the stall detector reads.

One `Progress` per process, updated by `keras_dist.stall.keras_loops` from Keras's
`CallbackList` (every `fit`, `evaluate` and `predict`, whatever the callbacks) and by
keras_dist's `BackupAndRestore` around a save or restore. An update is a few attribute
stores (no lock, no I/O, no TensorFlow op, no collective): `keras_dist.stall.reporter`
publishes a snapshot from its own thread.

The record (`Progress.record()`), a JSON-able dict:

* `step`: train steps finished in this process (plus the optimizer's iterations when
  `fit` began, so a resumed run counts on from its backup);
* `events`: progress events so far (a batch, epoch, loop, save or restore began or
  ended); `events_since_step`: those since the last train step ended -- workers of a
  synchronous job pass the same events in the same order, so this pair is comparable;
* `phase` and `detail`: where it is (`"train step"`, `"callbacks"` and the hook,
  `"evaluation"`, `"predict"`, `"backup save"`, `"backup restore"`, `"start-up"`,
  `"between steps"`, `"outside Keras loops"`);
* `loop`: the innermost Keras loop running (`"fit"`, `"evaluate"`, `"predict"`) or None;
* `slow`: a phase with the start-up budget (before the first batch of a loop or of an
  epoch ended: tracing, an input iterator filling its buffers; a backup save or restore);
* `slowest_step`: the longest train step so far in seconds (those first batches left out).
"""

from __future__ import annotations

import contextlib
import os
import time

__all__ = ["Progress", "current", "phase"]

OUTSIDE = "outside Keras loops"


class _Loop:
    __slots__ = ("kind", "batch_done")

    def __init__(self, kind: str):
        self.kind = kind
        self.batch_done = False  # its first batch (tracing, compilation) is behind it


class Progress:
    """Where this process is; see the module docstring for the record."""

    def __init__(self):
        self.pid = os.getpid()
        self.step = 0
        self.events = 0
        self.events_since_step = 0
        self.phase = OUTSIDE
        self.detail: str | None = None
        self.slowest_step = 0.0
        self._loops: list[_Loop] = []
        self._explicit_slow = 0  # nesting depth of `phase(..., slow=True)`
        self._step_began: float | None = None

    # -- the events ----------------------------------------------------------------------

    def event(self, phase: str, detail: str | None = None) -> None:
        """One progress event, and where the process is now."""
        self.events += 1
        self.events_since_step += 1
        self.phase, self.detail = phase, detail

    def where(self, phase: str, detail: str | None = None) -> None:
        """Where the process is now, without progress (a hook returned)."""
        self.phase, self.detail = phase, detail

    def loop_began(self, kind: str) -> None:
        self._loops.append(_Loop(kind))

    def loop_ended(self) -> None:
        if self._loops:
            self._loops.pop()

    def loops_ended_to(self, depth: int) -> None:
        """`fit`/`evaluate`/`predict` returned or raised: the loops it began are over."""
        if len(self._loops) > depth:
            del self._loops[depth:]
            self.where(OUTSIDE if not self._loops else "between steps",
                       self._loops[-1].kind if self._loops else None)

    def epoch_began(self) -> None:
        # An epoch's first batch re-creates the input iterator (a shuffle buffer fills,
        # files open): it gets the start-up budget, and is no measure of a step.
        if self._loops:
            self._loops[-1].batch_done = False

    def batch_began(self) -> None:
        self._step_began = time.monotonic()

    def batch_ended(self, train: bool) -> None:
        loop = self._loops[-1] if self._loops else None
        if train:
            began, self._step_began = self._step_began, None
            if began is not None and loop is not None and loop.batch_done:
                self.slowest_step = max(self.slowest_step, time.monotonic() - began)
            self.step += 1
            self.events_since_step = 0
        if loop is not None:
            loop.batch_done = True

    def step_is(self, step: int | None) -> None:
        """The optimizer's count as a loop or epoch starts (None: keep counting)."""
        if step is not None:
            self.step, self.events_since_step = step, 0

    @property
    def depth(self) -> int:
        return len(self._loops)

    @property
    def in_first_batch(self) -> bool:
        """The innermost loop has not finished a batch of this loop or epoch."""
        return bool(self._loops) and not self._loops[-1].batch_done

    @property
    def loop(self) -> str | None:
        return self._loops[-1].kind if self._loops else None

    @property
    def slow(self) -> bool:
        return bool(self._explicit_slow) or any(not loop.batch_done for loop in self._loops)

    def record(self) -> dict:
        """A snapshot for the detector (see the module docstring)."""
        return {"pid": self.pid, "step": self.step, "events": self.events,
                "events_since_step": self.events_since_step, "phase": self.phase,
                "detail": self.detail, "loop": self.loop, "slow": self.slow,
                "slowest_step": round(self.slowest_step, 6)}


_current: Progress | None = None


def current() -> Progress:
    """This process's `Progress` (a fresh one in a forked child)."""
    global _current
    if _current is None or _current.pid != os.getpid():
        _current = Progress()
    return _current


@contextlib.contextmanager
def phase(name: str, detail: str | None = None, *, slow: bool = False):
    """Marks a phase that begins and ends with a progress event (a backup save, say).

    `slow=True` gives it the start-up budget (`keras_dist.stall.policy`). Where it ends,
    the process is back where it was.
    """
    progress = current()
    before = (progress.phase, progress.detail)
    progress.event(name, detail)
    progress._explicit_slow += slow
    try:
        yield progress
    finally:
        progress._explicit_slow -= slow
        progress.event(*before)
