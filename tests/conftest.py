"""Shared test set-up: the lanes' marker guard and the shared worker pool.

Kept light: importing TensorFlow here would slow every test. Helpers that test modules
and worker functions share (initial weights, max-diff, TFRecord files) are in
`tests/helpers.py`, importable in worker processes too.

Lanes (markers registered in setup.cfg; README's Development section): the README's
`python -m pytest` runs every test not marked `slow`; `python -m pytest -m slow` runs the
rest. A test that starts processes (local workers, a subprocess, a notebook kernel) must
be marked `multiworker`, one that starts a Ray cluster `ray`: the guard below fails it
otherwise, so a slow test cannot hide in the fast lane unmarked.
"""

import functools
import os
import re
import subprocess
import sys
import threading

import pytest

from keras_dist.launching import zygote

# Quiets TensorFlow's C++ start-up logs in this process and, inherited, in the workers.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

PROCESS_MARKERS = ("multiworker", "ray")
# Short probes libraries run on first use (Python's `platform` runs `uname -p` when
# TensorFlow is imported): not processes a test starts.
_PROBES = {"uname", "ldconfig", "lscpu", "nvidia-smi"}
_running: dict = {"item": None}
_popen_init = subprocess.Popen.__init__
_spawn = zygote.spawn
_SHARED_ZYGOTES = pytest.StashKey[str]()


def _starts_processes(item) -> bool:
    return any(item.get_closest_marker(name) for name in PROCESS_MARKERS)


def _guarded_popen_init(self, *args, **kwargs):
    _check_marked(*args, **kwargs)
    _popen_init(self, *args, **kwargs)


def _check_marked(*args, **kwargs):
    item = _running["item"]
    # Only the test's own thread: a background thread of an earlier (marked) test's
    # fixture may still be starting its workers.
    command = args[0] if args else kwargs.get("args")
    program = command[0] if isinstance(command, (list, tuple)) and command else command
    if (item is not None and threading.current_thread() is threading.main_thread()
            and not _starts_processes(item)
            and os.path.basename(str(program)) not in _PROBES):
        pytest.fail(
            f"{item.nodeid} starts a process ({command!r}) but is not marked "
            "@pytest.mark.multiworker (or @pytest.mark.ray for a Ray cluster). Mark it, "
            "and mark it @pytest.mark.slow too unless it belongs in the fast lane.",
            pytrace=False)


def _guarded_spawn(argv, env):
    # Workers forked by the preloaded server (keras_dist.launching.zygote) are processes a
    # test starts too, though no Popen of this process starts them.
    _check_marked(argv)
    return _spawn(argv, env)


def pytest_configure(config):
    subprocess.Popen.__init__ = _guarded_popen_init
    zygote.spawn = _guarded_spawn
    # One set of preloaded worker servers for the whole session: its test processes
    # (pytest-xdist's, which inherit the variable) and the launchers they start.
    if zygote.SHARE_ENV not in os.environ:
        config.stash[_SHARED_ZYGOTES] = zygote.share()


def pytest_unconfigure(config):
    subprocess.Popen.__init__ = _popen_init
    zygote.spawn = _spawn
    if _SHARED_ZYGOTES in config.stash:
        zygote.unshare(config.stash[_SHARED_ZYGOTES])


def _ray_running() -> bool:
    ray = sys.modules.get("ray")
    return bool(ray is not None and ray.is_initialized())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _running["item"] = item
    ray_before = _ray_running()
    try:
        yield
    finally:
        _running["item"] = None
    if not ray_before and _ray_running() and not item.get_closest_marker("ray"):
        raise pytest.fail.Exception(
            f"{item.nodeid} started a Ray cluster but is not marked @pytest.mark.ray.",
            pytrace=False)


@pytest.fixture
def no_strategy_made(monkeypatch):
    """This test sees a process where `keras_dist.strategy()` was never called.

    keras_dist functions with `strategy=None` (and `keras_dist.is_chief()` and the like)
    use the strategy `keras_dist.strategy()` returned last in the process; modules that ran
    before in the same pytest worker (which ones depends on xdist's scheduling) may have
    made one.
    """
    import keras_dist._runtime  # noqa: F401  (loaded: `keras_dist.strategy` is a function)

    monkeypatch.setattr(sys.modules["keras_dist._runtime"], "_created", [])


@pytest.fixture(scope="session")
def worker_pool():
    """Two local workers (`MultiWorkerMirroredStrategy` on loopback), shared by the session.

    Calls run in the same two processes one after another (`keras_dist.testing.
    WorkerPool`): use it for functions that work with `keras_dist.strategy()`'s default
    arguments and need nothing of their own (no other strategy arguments, no virtual
    devices, no killed worker, no environment set before TensorFlow starts); those use
    `run_on_workers`. Session-scoped, so module-scoped fixtures can use it too.
    """
    from keras_dist.testing import WorkerPool

    pool = WorkerPool(num_workers=2)
    yield pool
    pool.close()


# Test modules that take longest, started first so that the two test processes finish
# together (pytest-xdist hands out whole modules in this order -- the modules on the
# shared worker pool as one, placed by its first module here -- the rest follow in
# collection order). Measured: each module's wall time in the slow lane.
LONGEST_FIRST = ("test_tutorials", "test_stall", "test_fine_tuning", "test_custom_steps",
                 "test_stock_optimizer",
                 "test_sparse_gradients", "test_fault_tolerance", "test_ray",
                 "test_elastic_launch", "test_parallel_pipeline", "test_notebook_launcher",
                 "test_keras_distribution", "test_benchmarks", "test_rendezvous",
                 "test_notebooks")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "worker_pool" in item.fixturenames and not item.get_closest_marker("multiworker"):
            raise pytest.UsageError(f"{item.nodeid} uses worker_pool (directly or through a "
                                    "fixture) but is not marked @pytest.mark.multiworker.")
    rank = {name: index for index, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.module.__name__, len(rank)))  # stable


# Modules that share another module's once-per-process results run in its process.
SHARES_PROCESS_WITH = {"tests/test_parallel_sharded.py": "tests/test_parallel_pipeline.py"}


@functools.lru_cache(maxsize=None)
def _uses_the_pool(module_path: str) -> bool:
    try:
        with open(module_path) as file:
            return re.search(r"\bworker_pool\b", file.read()) is not None
    except OSError:
        return False


def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist: whole modules per test process; the modules on the shared worker pool
    all in one (one pool per test process, started once)."""
    from xdist.scheduler import LoadScopeScheduling

    root = str(config.rootpath)

    class ModulesAndPool(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            module = nodeid.split("::", 1)[0]
            module = SHARES_PROCESS_WITH.get(module, module)
            return "worker_pool" if _uses_the_pool(os.path.join(root, module)) else module

    config.option.loadscopereorder = False  # keep LONGEST_FIRST's order
    return ModulesAndPool(config, log)
