"""How one worker's stock-writer save is paired with the chief's, and who waits for whom.

The pairing rule (stated for users in docs/stock_writers.md):

* **Pairs.** Each process counts its saves of each file name. The chief's n-th save of a
  file named `B` pairs with every other worker's n-th save of a file named `B`, in
  whatever directory (one shared path pairs with itself; a worker's own `mkdtemp()`
  directory pairs with the chief's).
* **Arrival.** A worker announces its n-th save of `B` when the call begins. By program
  order it is then done with whatever it did with the file of save n-1 (loading it back,
  typically).
* **The chief replaces a file only once it is free.** The chief's n-th save of `B` writes
  aside (a hidden sibling) at once, but moves it onto the path only once every worker
  that takes part in saves of `B` has arrived at its own n-th save. So a worker's load
  of save n-1 never overlaps the chief's replacing it with save n. (The race this
  closes: the chief never waited, so after `save(p); load(p); save(p)` it could swap a
  SavedModel directory while a slower worker was still loading the previous one, and
  the worker's load mixed two saves' files: "Found 8 Python objects that were not bound
  to checkpointed values".)
* **The others return when the chief's file is complete.** The chief publishes
  "started" and then "done" (or its error) for each pair; the other workers return from
  save n only after "done" of save n.
* **Who takes part.** A worker that made a first save of `B`. The chief finds out at its
  second save of `B`: it waits up to `FIRST_PAIRING_GRACE_SECONDS` for the worker's
  first one. A worker that never makes one (`if is_chief(): model.save(p)`: saves made
  on the chief only) is then not waited for again for that name, so such scripts run
  as before; the chief's first save of a name never waits.

Everything goes through TensorFlow's coordination service (`keras_dist.compat.
coordination`), which runs in the chief: a chief that dies ends every wait.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import threading

ENV_SWITCH = "KERAS_DIST_STOCK_WRITERS"
ENV_TIMEOUT = "KERAS_DIST_STOCK_WRITERS_TIMEOUT"
# How long one process waits for another to reach a paired save; a mismatch (a save
# the chief never makes) is an error after this. Once the chief has started, its write
# is waited for as long as it takes.
_DEFAULT_TIMEOUT_SECONDS = 600.0
_WRITE_WAIT_SECONDS = 24 * 3600.0
# How long the chief's second save of a name waits for a worker's first save of it
# before taking the saves of that name for chief-only ones (see the module doc).
FIRST_PAIRING_GRACE_SECONDS = 20.0
_KEY_ROOT = "keras_dist/stock_writers"

_log = logging.getLogger("keras_dist")
_counts: collections.Counter = collections.Counter()
_takes_part: dict[tuple[str, int], bool] = {}
_lock = threading.Lock()


class StockWriterError(RuntimeError):
    """A paired save did not complete: the chief's failed, or a worker never made its own."""


@dataclasses.dataclass(frozen=True)
class Pair:
    """This process's `number`-th save of a file named `name`."""

    name: str
    number: int

    def key(self, *parts: str) -> str:
        return "/".join((_KEY_ROOT, str(self.number), self.name, *parts))


def next_pair(path: str) -> Pair:
    """Counts this process's next save of a file named like `path`."""
    name = os.path.basename(os.path.abspath(path.rstrip(os.sep) or path))
    with _lock:
        _counts[name] += 1
        return Pair(name, _counts[name])


def timeout_seconds() -> float:
    """How long a worker waits for another to reach a paired save."""
    raw = os.environ.get(ENV_TIMEOUT, "").strip()
    if not raw:
        return _DEFAULT_TIMEOUT_SECONDS
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise ValueError(
            f"{ENV_TIMEOUT} must be a positive number of seconds (how long workers wait "
            f"for each other to make the same save). Received: {ENV_TIMEOUT}={raw!r}")
    return value


# -- another worker's side -----------------------------------------------------------
def arrive(pair: Pair) -> None:
    """Tells the chief this worker began `pair`'s save (it is done with the last file)."""
    from keras_dist import _runtime
    from keras_dist.compat import coordination

    coordination.set_value(pair.key("arrived", str(_runtime.worker_index())), "1")


def wait_for_chief(pair: Pair, path: str) -> None:
    """Returns once the chief's save paired with `pair` is complete.

    Raises:
        StockWriterError: The chief did not reach that save within `timeout_seconds()`,
            or its write failed.
    """
    from keras_dist import _runtime
    from keras_dist.compat import coordination

    timeout = timeout_seconds()
    if not _wait_for_key(pair.key("started"), timeout, path):
        raise StockWriterError(
            f"Worker {_runtime.worker_index()} saved {path!r}, its save number "
            f"{pair.number} of a file named {pair.name!r}, but the chief made no save "
            f"number {pair.number} of a file named {pair.name!r} within {timeout:g} s. "
            f"{_RULE} Set {ENV_TIMEOUT} (seconds) to wait longer for a chief that is slow "
            f"to get there, or {ENV_SWITCH}=0 to turn keras_dist's stock-writer handling "
            "off.")
    try:
        value = coordination.get_value(pair.key("done"), _WRITE_WAIT_SECONDS)
    except Exception as error:
        raise StockWriterError(
            f"The chief started its save paired with {path!r} but did not report it "
            f"complete ({type(error).__name__}: {error}).") from None
    if value != "done":
        raise StockWriterError(f"The chief failed to write its file paired with {path!r}: "
                               f"{value}")


# -- the chief's side ----------------------------------------------------------------
def started(pair: Pair, path: str) -> None:
    from keras_dist.compat import coordination

    coordination.set_value(pair.key("started"), os.path.abspath(path))


def finished(pair: Pair, error: BaseException | None = None) -> None:
    from keras_dist.compat import coordination

    coordination.set_value(
        pair.key("done"), "done" if error is None else f"error: {type(error).__name__}: "
        f"{error}")


def wait_for_other_workers(pair: Pair, path: str) -> None:
    """Returns once every worker that takes part in saves of `pair.name` began this one.

    Raises:
        StockWriterError: A worker that made earlier saves of this name did not make
            this one within `timeout_seconds()`.
    """
    from keras_dist import _runtime

    if pair.number == 1:
        return
    timeout = timeout_seconds()
    for worker in range(1, _runtime.num_workers()):
        if not _worker_takes_part(pair.name, worker, path, timeout):
            continue
        if not _wait_for_key(pair.key("arrived", str(worker)), timeout, path):
            raise StockWriterError(
                f"The chief's save of {path!r}, its save number {pair.number} of a file "
                f"named {pair.name!r}, waits for worker {worker} to make its own save "
                f"number {pair.number} of that name (so that it is done with the file the "
                f"last one left there), but it made none within {timeout:g} s. {_RULE} "
                "A save made on the chief only after saves made by every worker breaks "
                "that: save on every worker (keras_dist.chief_path(path) keeps the "
                f"others' files private), or use another file name. Set {ENV_TIMEOUT} "
                "(seconds) to wait longer for a slow worker.")


def _worker_takes_part(name: str, worker: int, path: str, timeout: float) -> bool:
    with _lock:
        known = _takes_part.get((name, worker))
    if known is None:
        first = Pair(name, 1).key("arrived", str(worker))
        known = _wait_for_key(first, min(FIRST_PAIRING_GRACE_SECONDS, timeout), path)
        with _lock:
            _takes_part[(name, worker)] = known
        if not known:
            _log.info("keras_dist: worker %d made no save of a file named %r; the chief's "
                      "saves of that name are taken for chief-only ones and do not wait "
                      "for it.", worker, name)
    return known


def _wait_for_key(key: str, timeout: float, path: str) -> bool:
    """True once `key` is set; False when `timeout` passed first."""
    from keras_dist import _runtime
    from keras_dist.compat import coordination

    try:
        coordination.get_value(key, timeout)
        return True
    except Exception as error:
        text = f"{type(error).__name__}: {error}"
        if "deadline" in text.lower() or "timed out" in text.lower():
            return False
        raise StockWriterError(
            f"Worker {_runtime.worker_index()} saved {path!r} and could not hear from the "
            f"other workers about the paired save ({text}).") from None


_RULE = ("keras_dist pairs each worker's save with the chief's save of the same file name, "
         "in order (the n-th with the n-th), and the chief replaces a file only once every "
         "worker is done with the last one: every worker must make the same saves with the "
         "same file names in the same order (a save made on one worker only, or a file name "
         "that differs per worker, breaks that).")
