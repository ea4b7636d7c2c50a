"""keras_dist.testing.WorkerPool: workers started once that run one call after another.

One pool of 2 real workers (TF_CONFIG on loopback ports, as under `keras-dist launch`)
goes through every case in order: reuse, isolation between calls, an error raised on one
worker, an unpicklable call, a worker that dies (the pool starts new processes).
"""

import os
import threading
import time

import pytest

from keras_dist.testing import WorkerError, WorkerPool

pytestmark = pytest.mark.multiworker


def _identity(marker=None):
    import json

    if marker:
        os.environ["KD_POOL_MARKER"] = marker
    return {"pid": os.getpid(), "index": json.loads(os.environ["TF_CONFIG"])["task"]["index"],
            "marker": os.environ.get("KD_POOL_MARKER"), "cwd": os.getcwd()}


def _raise_on_worker_1():
    import json

    if json.loads(os.environ["TF_CONFIG"])["task"]["index"] == 1:
        raise ValueError("boom on worker 1")
    return "fine"


def _exit_on_worker_1():
    import json

    if json.loads(os.environ["TF_CONFIG"])["task"]["index"] == 1:
        os._exit(3)
    return "fine"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_pool_reuses_its_workers_isolates_calls_and_recovers_from_a_dead_one(tmp_path):
    with WorkerPool(num_workers=2) as pool:
        first = pool.run(_identity, kwargs={"marker": "set-by-call-1"})
        assert [r["index"] for r in first] == [0, 1]
        assert [r["marker"] for r in first] == ["set-by-call-1"] * 2
        second = pool.run(_identity)
        # The same processes, but the environment the last call changed is restored.
        assert [r["pid"] for r in second] == [r["pid"] for r in first]
        assert [r["marker"] for r in second] == [None, None]

        with pytest.raises(WorkerError, match="boom on worker 1") as raised:
            pool.run(_raise_on_worker_1)
        assert raised.value.worker_index == 1
        # Every worker answered: the pool keeps its processes.
        assert [r["pid"] for r in pool.run(_identity)] == [r["pid"] for r in first]

        with pytest.raises(TypeError, match="cannot send"):
            pool.run(_identity, args=(threading.Lock(),))
        assert [r["pid"] for r in pool.run(_identity)] == [r["pid"] for r in first]

        with pytest.raises(WorkerError, match="worker 1") as died:
            pool.run(_exit_on_worker_1)
        assert died.value.worker_index == 1
        # A worker died: the next call runs on new processes.
        third = pool.run(_identity)
        assert [r["index"] for r in third] == [0, 1]
        assert not {r["pid"] for r in third} & {r["pid"] for r in first}
        assert pool.starts == 2


def test_bad_arguments_are_refused_clearly():
    with pytest.raises(ValueError, match="num_workers"):
        WorkerPool(num_workers=0)
    with pytest.raises(ValueError, match="virtual_devices"):
        WorkerPool(virtual_devices=0)
    with pytest.raises(TypeError, match="callable"):
        WorkerPool().run("not a function")


def _private_dir():
    from keras_dist.checkpointing import stock_writers

    return stock_writers.private_dir("pooltest", remove_at_exit=True)


@pytest.mark.timeout(120)
def test_a_stopped_pool_leaves_no_private_directory():
    # Pool workers end with os._exit (no atexit): they remove their private directories
    # (non-chief callback outputs) themselves.
    with WorkerPool(num_workers=1) as pool:
        (directory,) = pool.run(_private_dir)
        assert os.path.isdir(directory)
    deadline = time.monotonic() + 30
    while os.path.exists(directory) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(directory)
