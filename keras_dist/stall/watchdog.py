"""The stall watchdog inside each worker of a multi-worker job started without the launcher.

Under Kubernetes (TFJob), Slurm or Ray Train nobody outside the workers watches them, so
each worker does: a daemon thread publishes its progress record
(`keras_dist.stall.progress`) in TensorFlow's coordination service (the key-value store
that MultiWorkerMirroredStrategy runs on the chief), reads everyone's, and applies the
shared rule (`keras_dist.stall.policy`). The first worker to see a stall publishes a
verdict; then

* every worker that is behind prints the verdict and its own Python stacks (all threads);
* every other worker prints the verdict, naming the stuck peer(s);
* each says so in the store, and exits with `STALL_EXIT_CODE` once every worker has (or
  after a few seconds): a worker that left early would fail its peers' collectives
  before they could say who was stuck,

so the scheduler sees the job fail and restarts it, and `BackupAndRestore` resumes it
exactly. `os._exit` is the only way out: the main thread is blocked in a collective (or
is the stuck one). Started only in a multi-worker job with the coordination service and
detection on (`KERAS_DIST_STALL_TIMEOUT` is not 0).
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import threading
import time
import warnings

from keras_dist.stall import policy
from keras_dist.stall import progress as _progress

__all__ = ["STALL_EXIT_CODE", "start_if_wanted"]

# EX_TEMPFAIL (sysexits.h): a temporary failure, the job is invited to run again.
STALL_EXIT_CODE = 75
_PREFIX = "keras_dist/stall"
_READ_TIMEOUT = 0.05  # seconds to wait for a key that is not there (yet)
_ACK_WAIT = 10.0  # how long the others wait for the stuck workers to print their stacks


def start_if_wanted() -> bool:
    """Starts the watchdog thread when this process is one of a multi-worker job."""
    from keras_dist import _runtime
    from keras_dist.compat import coordination

    cluster = _runtime.cluster()
    if not cluster.is_multi_worker:
        return False
    timeout = policy.stall_timeout()
    if not timeout.enabled or not coordination.available():
        return False
    from keras_dist.compat import registry

    try:
        registry.check("stall")
    except registry.CompatError as error:  # never break fit: say what is off instead
        warnings.warn(f"keras_dist's stall watchdog is off in this process: {error}",
                      RuntimeWarning, stacklevel=2)
        return False
    watchdog = _Watchdog(cluster.worker_index, cluster.num_workers, timeout)
    threading.Thread(target=watchdog.run, daemon=True, name="keras-dist-stall-watchdog").start()
    return True


class _Watchdog:
    def __init__(self, index: int, num_workers: int, timeout: policy.StallTimeout):
        self.index, self.num_workers = index, num_workers
        # The key-value store serves every worker's reads: look less often in big jobs.
        self.interval = max(1.0, num_workers / 8)
        self.detector = policy.Detector(timeout, num_workers, time.monotonic())
        self.records: dict[int, dict | None] = {}
        self._published = None

    def run(self) -> None:
        from keras_dist.compat import coordination

        while True:
            try:
                self._publish(coordination)
                verdict = self._verdict(coordination)
                if verdict is None:
                    self._read_peers(coordination)
                    stall = self.detector.observe(self.records, time.monotonic())
                    if stall is not None:
                        verdict = self._decide(coordination, stall)
            except Exception:  # the service is gone: the job is ending anyway
                return
            if verdict is not None:
                self._act(coordination, verdict)
            time.sleep(self.interval)

    def _publish(self, coordination) -> None:
        record = _progress.current().record()
        if record == self._published:
            return
        key = f"{_PREFIX}/progress/{self.index}"
        try:
            coordination.delete_value(key)
        except Exception:
            pass
        coordination.set_value(key, json.dumps(record))
        self._published = record
        self.records[self.index] = record

    def _read_peers(self, coordination) -> None:
        for index in range(self.num_workers):
            if index == self.index:
                continue
            try:
                text = coordination.get_value(f"{_PREFIX}/progress/{index}", _READ_TIMEOUT)
            except Exception:
                continue  # not published yet, or being rewritten: keep the last seen
            self.records[index] = json.loads(text)

    def _verdict(self, coordination) -> dict | None:
        try:
            return json.loads(coordination.get_value(f"{_PREFIX}/verdict", 0.001))
        except Exception:
            return None

    def _decide(self, coordination, stall: policy.Stall) -> dict:
        verdict = {"behind": list(stall.behind), "message": stall.message,
                   "by": self.index}
        try:
            coordination.set_value(f"{_PREFIX}/verdict", json.dumps(verdict))
        except Exception:  # another worker decided first: its verdict stands
            return self._verdict(coordination) or verdict
        return verdict

    def _act(self, coordination, verdict: dict) -> None:
        behind = verdict["behind"]
        names = ", ".join(f"worker {index}" for index in behind)
        head = (f"keras_dist: stall (found by worker {verdict['by']}, stall timeout "
                f"{self.detector.timeout.describe()}): {verdict['message']}.")
        if self.index in behind:
            print(f"{head}\nkeras_dist: this worker ({self.index}) is behind; its Python "
                  "stacks (all threads), most recent call first:", file=sys.stderr,
                  flush=True)
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        else:
            print(f"{head}\nkeras_dist: worker {self.index} stops, as every worker does, "
                  f"so that the job is restarted (the stuck one: {names}); "
                  "BackupAndRestore resumes it.", file=sys.stderr, flush=True)
        try:
            coordination.set_value(f"{_PREFIX}/ack/{self.index}", "1")
        except Exception:
            pass
        deadline = time.monotonic() + _ACK_WAIT
        for index in range(self.num_workers):
            try:
                coordination.get_value(f"{_PREFIX}/ack/{index}",
                                       max(0.001, deadline - time.monotonic()))
            except Exception:
                pass
        sys.stdout.flush()
        os._exit(STALL_EXIT_CODE)
