"""The launcher's side of stall detection: read the workers' progress, call a stall, show
where the stuck ones are.

Each worker of an attempt gets `KERAS_DIST_PROGRESS_FILE` (a file in the attempt's own
temporary directory), which keras_dist's reporter rewrites while the worker is in a Keras
loop (`keras_dist.stall.reporter`). `StallMonitor.poll` reads them twice a second and
applies the shared rule (`keras_dist.stall.policy`); on a stall, `show` asks each worker
that is behind for its Python stacks (`SIGUSR1`, answered by `faulthandler` even while the
worker spins or is blocked in C) and prints them as launcher lines. The caller then stops
the group like any failed attempt, and `--max-restarts` restarts it.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time

import psutil

from keras_dist.stall import policy
from keras_dist.stall.reporter import PROGRESS_FILE_ENV, stack_path

__all__ = ["StallMonitor"]

_READ_EVERY = 0.5  # seconds
_STACK_WAIT = 5.0  # seconds a worker gets to write its stacks


class StallMonitor:
    """Watches one attempt's workers (`None` timeout or a disabled one: never calls)."""

    def __init__(self, num_workers: int, timeout: policy.StallTimeout, tag: str):
        self.timeout, self.tag = timeout, tag
        self.directory = tempfile.mkdtemp(prefix="keras_dist_progress_")
        self.paths = [os.path.join(self.directory, f"worker-{index}.json")
                      for index in range(num_workers)]
        self._detector = policy.Detector(timeout, num_workers, time.monotonic())
        self._records: dict[int, dict | None] = {}
        self._next_read = 0.0

    def env(self, index: int) -> dict[str, str]:
        """What worker `index` needs in its environment to report (nothing when off)."""
        return {PROGRESS_FILE_ENV: self.paths[index]} if self.timeout.enabled else {}

    def poll(self, now: float | None = None) -> policy.Stall | None:
        """The stall, once there is one; cheap to call every few milliseconds."""
        now = time.monotonic() if now is None else now
        if not self.timeout.enabled or now < self._next_read:
            return None
        self._next_read = now + _READ_EVERY
        for index, path in enumerate(self.paths):
            record = _read_json(path)
            if record is not None:
                self._records[index] = record
        return self._detector.observe(self._records, now)

    def show(self, stall: policy.Stall, workers, output) -> dict[int, str]:
        """Prints the stall and each stuck worker's stacks; returns the stacks by index."""
        output.message(f"{self.tag}: stall (no progress for {stall.seconds:.0f} s, stall "
                       f"timeout {self.timeout.describe()}): {stall.message}")
        asked = {}
        for index in stall.behind:
            record = self._records.get(index) or {}
            signum, pid = record.get("stack_signal"), record.get("pid")
            if signum and _in_tree(pid, workers[index].process):
                try:
                    # The size before the signal: a worker on another core may have
                    # written its stacks before a size taken after it.
                    size = os.path.getsize(stack_path(self.paths[index]))
                    os.kill(pid, signum)
                    asked[index] = size
                except OSError:
                    pass
        stacks = {index: _wait_for_stack(stack_path(self.paths[index]), size)
                  for index, size in asked.items()}
        for index in stall.behind:
            text = stacks.get(index)
            if not text:
                output.message(f"{self.tag}: worker {index}'s Python stacks are not "
                               "available (it does not report progress, or did not answer "
                               "in time)")
                continue
            output.message(f"{self.tag}: worker {index}'s Python stacks (all threads, most "
                           "recent call first):")
            for line in text.rstrip().splitlines():
                output.message(f"    {line}")
        return stacks

    def close(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


def _in_tree(pid, process) -> bool:
    """`pid` is the worker's process or one it started (a wrapper script's Python)."""
    if not pid or process.poll() is not None:
        return False
    if pid == process.pid:
        return True
    try:
        return pid in {child.pid for child in psutil.Process(process.pid).children(True)}
    except psutil.Error:
        return False


def _read_json(path: str) -> dict | None:
    try:
        with open(path) as file:
            return json.load(file)
    except (OSError, ValueError):
        return None


def _wait_for_stack(path: str, size_before: int) -> str:
    # faulthandler appends all threads at once from the signal handler; the text is
    # complete once its size stops changing.
    deadline, last = time.monotonic() + _STACK_WAIT, -1
    while time.monotonic() < deadline:
        size = os.path.getsize(path) if os.path.exists(path) else 0
        if size > size_before and size == last:
            break
        last = size
        time.sleep(0.1)
    try:
        with open(path) as file:
            file.seek(size_before)
            return file.read()
    except OSError:
        return ""
