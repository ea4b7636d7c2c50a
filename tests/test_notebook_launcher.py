"""`notebook_launcher` and `keras_dist.testing`: functions run on real worker processes."""

import json
import os
import signal
import sys
import time

import psutil
import pytest

from keras_dist.launching import zygote
from keras_dist.launching.notebook import WorkerError, notebook_launcher
from keras_dist.testing import run_in_subprocess, run_on_workers

pytestmark = pytest.mark.multiworker


# Module-level functions travel by reference: the workers import this test module.
def task_index():
    return json.loads(os.environ["TF_CONFIG"])["task"]["index"]


def add(a, b, *, scale=1):
    return (a + b) * scale


def fail_on_worker_one():
    if task_index() == 1:
        raise ValueError("boom on the second worker")
    time.sleep(60)  # stopped by the launcher when worker 1 fails


def die_on_worker_one(pid_dir):
    with open(os.path.join(pid_dir, f"{task_index()}.pid"), "w") as file:
        file.write(str(os.getpid()))
    if task_index() == 1:
        while len(os.listdir(pid_dir)) < 2:
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)


def sleep_forever(pid_dir):
    with open(os.path.join(pid_dir, f"{os.getpid()}.pid"), "w") as file:
        file.write(str(os.getpid()))
    time.sleep(120)


def environment_summary():
    return {name: os.environ.get(name) for name in ("TF_CONFIG", "KD_TEST_EXTRA")}


def _assert_gone(pid_dir):
    pids = [int((pid_dir / name).read_text()) for name in os.listdir(pid_dir)]
    assert pids
    for pid in pids:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie"


@pytest.mark.multiworker
@pytest.mark.timeout(90)
def test_results_in_worker_order_closures_args_kwargs_and_env_reach_the_workers():
    # One launch of 3 workers checks what three near-copies each launched for before.
    offset = 40

    def make_counter(start):
        def counter():
            return [start + i for i in range(3)]

        return counter

    counter = make_counter(7)

    def everything(a, b, *, scale):
        return {"index": task_index(), "offset": offset + task_index(), "counter": counter(),
                "add": add(a, b, scale=scale), "env": environment_summary()}

    results = run_on_workers(everything, num_workers=3, args=(1, 2), kwargs={"scale": 10},
                             env={"KD_TEST_EXTRA": "on"})
    assert [r["index"] for r in results] == [0, 1, 2]  # in worker order
    assert [r["offset"] for r in results] == [40, 41, 42]  # a closure, sent by value
    assert [r["counter"] for r in results] == [[7, 8, 9]] * 3
    assert [r["add"] for r in results] == [30] * 3  # args and kwargs
    assert [r["env"]["KD_TEST_EXTRA"] for r in results] == ["on"] * 3
    assert [json.loads(r["env"]["TF_CONFIG"])["task"]["index"] for r in results] == [0, 1, 2]
    # notebook_launcher is the same machinery, by name and by value.
    assert notebook_launcher(add, args=(1, 2), kwargs={"scale": 10}) == [30, 30]


@pytest.mark.multiworker
@pytest.mark.timeout(60)
@pytest.mark.slow
def test_output_streams_into_sys_stdout_with_worker_prefixes(capsys):
    # Preloaded workers (forked, as keras_dist.testing's) print through the same pipe.
    notebook_launcher(lambda: print(f"step done on {task_index()}"), num_workers=2,
                      preload=True)
    out = capsys.readouterr().out
    assert "[worker 0] step done on 0" in out
    assert "[worker 1] step done on 1" in out


@pytest.mark.multiworker
@pytest.mark.timeout(60)
@pytest.mark.slow
def test_exception_in_a_worker_raises_worker_error_with_its_traceback():
    started = time.monotonic()
    with pytest.raises(WorkerError) as raised:
        notebook_launcher(fail_on_worker_one, num_workers=2, preload=True)
    assert time.monotonic() - started < 30  # worker 0 was stopped, not waited for
    error = raised.value
    assert isinstance(error, RuntimeError)
    assert error.worker_index == 1
    assert "ValueError: boom on the second worker" in error.traceback_text
    assert "in fail_on_worker_one" in error.traceback_text
    assert "worker 1" in str(error) and "boom on the second worker" in str(error)


@pytest.mark.multiworker
@pytest.mark.timeout(60)
@pytest.mark.slow
def test_killed_worker_raises_worker_error_and_leaves_nothing(tmp_path):
    with pytest.raises(WorkerError, match=r"worker 1 .*died without returning a result.*"
                                          r"SIGKILL \(9\)") as raised:
        run_on_workers(die_on_worker_one, num_workers=2, args=(str(tmp_path),))
    assert raised.value.worker_index == 1
    assert raised.value.returncode == -signal.SIGKILL
    assert raised.value.traceback_text is None
    _assert_gone(tmp_path)


@pytest.mark.multiworker
@pytest.mark.timeout(60)
def test_timeout_raises_timeout_error_and_stops_the_workers(tmp_path, monkeypatch):
    # Zygotes of this process's own (not the session's, shared with other test processes):
    # the workers are then this process's descendants, found below.
    monkeypatch.delenv(zygote.SHARE_ENV, raising=False)
    # Processes this pytest worker started before (the session's worker pool under -n 0)
    # are not this launch's.
    before = {child.pid for child in psutil.Process().children(recursive=True)}
    with pytest.raises(TimeoutError, match="timeout=3 s"):
        run_on_workers(sleep_forever, num_workers=2, args=(str(tmp_path),), timeout=3)
    # Under a 2-worker TF_CONFIG `import keras_dist` prepares TensorFlow's collectives,
    # which can take longer than 3 s here, so the workers may be stopped before the
    # function wrote its pid files: check that none of our child processes is left.
    if os.listdir(tmp_path):
        _assert_gone(tmp_path)
    # The preloaded worker server (launching/zygote_server.py) stays for the next call; the
    # workers it forked are its children, so they are still found here.
    servers = zygote.server_pids()
    left = [child for child in psutil.Process().children(recursive=True)
            if child.is_running() and child.status() != psutil.STATUS_ZOMBIE
            and child.pid not in servers and child.pid not in before]
    assert not left, left


@pytest.mark.timeout(60)
def test_run_in_subprocess_runs_alone_without_tf_config(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", '{"cluster": {"worker": ["a:1", "b:2"]}}')
    summary = run_in_subprocess(environment_summary)
    assert summary["TF_CONFIG"] is None
    assert run_in_subprocess(add, args=(2, 3), kwargs={"scale": 2}) == 10
    with pytest.raises(WorkerError, match="ZeroDivisionError") as raised:
        run_in_subprocess(lambda: 1 / 0)
    assert raised.value.worker_index == 0


@pytest.mark.timeout(60)
def test_workers_do_not_import_tensorflow_unless_the_function_does():
    # Keeps every fresh worker's start-up fast; TensorFlow is imported by the user's code.
    assert run_in_subprocess(lambda: "tensorflow" in sys.modules, preload=False) is False
    # A preloaded worker was forked after the import, with the runtime not started yet.
    assert run_in_subprocess(_tensorflow_state) == (True, False)


def _tensorflow_state():
    """(TensorFlow imported, its eager context created) when the function starts."""
    from tensorflow.python.eager import context

    return "tensorflow" in sys.modules, context.context_safe() is not None


def test_worker_error_survives_pickling():
    import pickle

    error = WorkerError("worker 1 failed", worker_index=1, traceback_text="tb", returncode=1)
    copy = pickle.loads(pickle.dumps(error))
    assert (str(copy), copy.worker_index, copy.traceback_text, copy.returncode) == (
        "worker 1 failed", 1, "tb", 1)


@pytest.mark.timeout(60)
def test_unpicklable_arguments_and_results_are_reported():
    import threading

    with pytest.raises(TypeError, match="cannot send .* cloudpickle"):
        run_in_subprocess(add, args=(threading.Lock(), 1))
    with pytest.raises(WorkerError, match="cannot be pickled") as raised:
        run_in_subprocess(lambda: threading.Lock())
    assert "lock" in raised.value.traceback_text


@pytest.mark.timeout(60)
def test_functions_sent_by_value_keep_their_source():
    # AutoGraph (tf.function) and tracebacks need the source of notebook-defined code.
    def documented():
        raise KeyError("needs its source")

    with pytest.raises(WorkerError) as raised:
        run_in_subprocess(documented)
    assert 'raise KeyError("needs its source")' in raised.value.traceback_text
    source = run_in_subprocess(lambda: __import__("inspect").getsource(documented))
    assert source.strip().startswith("def documented():")


@pytest.mark.timeout(60)
def test_sys_exit_in_the_function_is_a_failure():
    with pytest.raises(WorkerError, match=r"sys.exit\(4\)"):
        run_in_subprocess(lambda: sys.exit(4))


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"num_workers": 0}, ValueError, "Argument `num_workers` must be an integer >= 1"),
        ({"virtual_devices": 0}, ValueError, "Argument `virtual_devices`"),
        ({"args": 3}, ValueError, "Argument `args`"),
        ({"timeout": -1}, ValueError, "Argument `timeout`"),
    ],
)
def test_invalid_arguments_are_refused(kwargs, error, message):
    with pytest.raises(error, match=message):
        notebook_launcher(task_index, **kwargs)
    with pytest.raises(TypeError, match="`fn` must be callable"):
        notebook_launcher("not a function")


def all_reduce_task_numbers():
    import tensorflow as tf

    # The real engine over the launcher's TF_CONFIG: one gRPC all-reduce on loopback.
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    contribution = float(task_index() + 1)

    @tf.function
    def step():
        return tf.distribute.get_replica_context().all_reduce("sum", tf.constant(contribution))

    summed = strategy.experimental_local_results(strategy.run(step))[0]
    return strategy.num_replicas_in_sync, float(summed)


@pytest.mark.multiworker
@pytest.mark.timeout(300)
@pytest.mark.slow
def test_multi_worker_all_reduce_after_the_caller_imported_tensorflow():
    import tensorflow as tf  # the parent's runtime is initialised; workers are fresh

    assert float(tf.reduce_sum(tf.constant([1.0]))) == 1.0
    assert run_on_workers(all_reduce_task_numbers, timeout=240) == [(2, 3.0), (2, 3.0)]


def logical_cpu_count():
    import tensorflow as tf

    return len(tf.config.list_logical_devices("CPU"))


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_virtual_devices_are_set_up_before_the_function_runs():
    assert run_in_subprocess(logical_cpu_count, virtual_devices=4) == 4


NOTEBOOK_CELL = """
import json, os
from keras_dist import notebook_launcher

def where_am_i(greeting):
    # Defined in the kernel's __main__: cloudpickle sends it by value.
    index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    print(greeting, index)
    return index

print("RESULT", notebook_launcher(where_am_i, args=("hello from",), num_workers=2))
"""

NOTEBOOK_FAILING_CELL = """
import inspect
from keras_dist import WorkerError

def broken():
    raise ValueError("raised in a notebook cell")

try:
    notebook_launcher(broken, num_workers=1)
except WorkerError as error:
    print("TRACEBACK", error.traceback_text)
print("SOURCE", notebook_launcher(lambda: inspect.getsource(where_am_i), num_workers=1)[0])
"""

NOTEBOOK_PROGRESS_CELL = """
import sys, time

def progress():
    for step in range(1, 4):
        sys.stdout.write(f"\\rstep {step}/3")  # Keras' dynamic progress bar
        sys.stdout.flush()
        time.sleep(0.2)
    sys.stdout.write("\\n")

notebook_launcher(progress, num_workers=2)
"""


@pytest.mark.multiworker
@pytest.mark.timeout(180)
@pytest.mark.slow
def test_notebook_launcher_in_a_real_jupyter_kernel():
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    repo_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_code_cell(NOTEBOOK_CELL),
                      nbformat.v4.new_code_cell(NOTEBOOK_FAILING_CELL),
                      nbformat.v4.new_code_cell(NOTEBOOK_PROGRESS_CELL)]
    client = nbclient.NotebookClient(
        notebook, timeout=120, kernel_name="python3", resources={"metadata": {"path": repo_root}}
    )
    client.execute()
    first, second, third = (
        "".join(output.get("text", "") for output in cell.outputs
                if output.get("output_type") == "stream")
        for cell in notebook.cells
    )
    assert "[worker 0] hello from 0" in first
    assert "[worker 1] hello from 1" in first
    assert "RESULT [0, 1]" in first
    # The cell's source travelled with the function: tracebacks and inspect see it.
    assert 'raise ValueError("raised in a notebook cell")' in second
    assert "SOURCE def where_am_i(greeting):" in second
    # In Jupyter the chief's '\r' updates are forwarded live, each with its prefix; the
    # other worker's bar ends as one line.
    assert "\r[worker 0] step 1/3" in third and "\r[worker 0] step 3/3" in third
    assert "[worker 1] step 3/3\n" in third and "[worker 1] step 1/3" not in third
