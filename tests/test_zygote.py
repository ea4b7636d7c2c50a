"""Preloaded workers (keras_dist/launching/zygote.py) are the processes a Popen would start.

`keras_dist.testing` forks its workers from a server that already imported TensorFlow;
these tests check, against a fresh interpreter (`preload=False`) where it matters, what
a worker sees: its environment, working directory, `sys.path`, session, random seeds,
exit status, output, and a runtime that is not started yet.
"""

import os
import signal
import sys
import time

import pytest

from keras_dist.launching import zygote
from keras_dist.testing import WorkerError, run_in_subprocess, run_on_workers

pytestmark = [pytest.mark.multiworker, pytest.mark.timeout(300)]


def _what_a_worker_sees(marker):
    import random

    import numpy as np
    from tensorflow.python.eager import context

    print(f"output of {marker}")
    return {
        "env": os.environ.get("KERAS_DIST_ZYGOTE_TEST"),
        "cwd": os.getcwd(),
        "path_head": sys.path[:2],
        "own_session": os.getsid(0) == os.getpid(),
        "runtime_started": context.context_safe() is not None,
        "hash": hash("keras_dist"),
        "random": (random.random(), float(np.random.rand())),
        "argv0": os.path.basename(sys.argv[0]),
        "main": sys.modules["__main__"].__file__.endswith(os.path.join("launching", "worker.py")),
    }


# Slow lane: two fresh interpreters (~20 CPU-seconds); every fast-lane test that starts
# workers runs on preloaded ones, the fast lane's budget pays for keras.distribution.
@pytest.mark.slow
def test_a_preloaded_worker_sees_what_a_fresh_one_sees(tmp_path, monkeypatch, capfd):
    extra = str(tmp_path / "on_the_path")
    os.makedirs(extra)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", extra)
    env = {"KERAS_DIST_ZYGOTE_TEST": "set"}
    preloaded = run_on_workers(_what_a_worker_sees, 2, args=("preloaded",), env=env)
    fresh = run_on_workers(_what_a_worker_sees, 2, args=("fresh",), env=env, preload=False)
    for seen in preloaded + fresh:
        assert seen["env"] == "set"
        assert seen["cwd"] == str(tmp_path)
        assert seen["path_head"] == [str(tmp_path), extra]
        assert seen["own_session"] and seen["main"]
        assert seen["argv0"] == "worker.py"
    # Under a cluster, `import keras_dist` starts TensorFlow's runtime (with collectives):
    # in both kinds of worker alike.
    assert [seen["runtime_started"] for seen in preloaded] == [
        seen["runtime_started"] for seen in fresh]
    # Each worker of a group has its own hash seed (unless PYTHONHASHSEED fixes it) and
    # random state, as fresh ones do.
    for group in (preloaded, fresh):
        if "PYTHONHASHSEED" not in os.environ:
            assert group[0]["hash"] != group[1]["hash"]
        assert group[0]["random"] != group[1]["random"]
    # Two workers forked from one zygote, one after the other: new seeds each time.
    first, second = (run_in_subprocess(_what_a_worker_sees, args=("again",)) for _ in "12")
    assert first["random"] != second["random"]
    output = capfd.readouterr().out
    for marker in ("preloaded", "fresh"):
        assert f"[worker 0] output of {marker}" in output
        assert f"[worker 1] output of {marker}" in output


def _exit_with(how):
    if how == "code":
        sys.exit(3)
    os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.parametrize("how,returncode", [("code", 1), ("signal", -signal.SIGKILL)])
def test_exit_status_reaches_the_launcher(how, returncode):
    # The worker entry point turns SystemExit into an error record and exit code 1.
    with pytest.raises(WorkerError) as raised:
        run_in_subprocess(_exit_with, args=(how,))
    assert raised.value.returncode == returncode


def _tf_cpp_min_log_level():
    return os.environ.get("TF_CPP_MIN_LOG_LEVEL")


def test_a_variable_read_at_import_gets_a_zygote_started_with_it():
    # TensorFlow reads TF_CPP_MIN_LOG_LEVEL when it loads: a worker that asks for
    # another value must not come from a zygote that imported TensorFlow with the old.
    assert run_in_subprocess(_tf_cpp_min_log_level) == "2"
    before = zygote.server_pids()
    assert run_in_subprocess(_tf_cpp_min_log_level, env={"TF_CPP_MIN_LOG_LEVEL": "1"}) == "1"
    started = zygote.server_pids() - before
    assert len(started) == 1
    key = dict(zygote.import_key({"TF_CPP_MIN_LOG_LEVEL": "1", "TF_CONFIG": "{}",
                                  "KERAS_DIST_SLOT": "1", "KERAS_DIST_DISABLE_COMPAT": "x",
                                  "KERAS_BACKEND": "tensorflow", "PATH": "/bin"}))
    assert key == {"TF_CPP_MIN_LOG_LEVEL": "1", "KERAS_BACKEND": "tensorflow"}


def _zygote_of_a_worker_started_by_a_worker():
    return run_in_subprocess(os.getppid)


def test_a_session_shares_its_zygotes_with_its_processes_until_unshare(monkeypatch):
    # conftest.py shares the test session's zygotes; this test's session is its own.
    monkeypatch.delenv(zygote.SHARE_ENV, raising=False)
    folder = zygote.share()
    try:
        server = run_in_subprocess(os.getppid)  # a worker's parent: its zygote
        assert server in zygote.server_pids()
        # A worker's worker (a launcher's, a notebook's) comes from the same zygote.
        assert run_in_subprocess(_zygote_of_a_worker_started_by_a_worker) == server
    finally:
        zygote.unshare(folder)
    assert zygote.SHARE_ENV not in os.environ
    deadline = time.monotonic() + 10
    while zygote.running(server) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not zygote.running(server)


def _op_then_strategy():
    import tensorflow as tf

    import keras_dist

    tf.constant(1.0)  # fine only if `import keras_dist` prepared the collectives already
    return keras_dist.strategy().num_replicas_in_sync


def test_each_worker_imports_keras_dist_with_its_own_cluster():
    # `import keras_dist` reads TF_CONFIG to prepare TensorFlow's collectives, so the
    # zygote must not have imported it with its own (empty) environment.
    assert run_on_workers(_op_then_strategy, 2) == [2, 2]
