"""Run a Python function on N local workers from a notebook (or any Python program).

`notebook_launcher(fn, num_workers=2)` is `keras-dist launch` for a function: each worker
is a fresh Python process (never a fork, so it works after the caller imported
TensorFlow) with its own `TF_CONFIG`, the function travels there with cloudpickle, the
workers' output streams into the caller's `sys.stdout` prefixed `[worker i]`, and the
return values come back as a list. The wire protocol lives in `keras_dist._worker`.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
from typing import Any, Callable, Mapping, Sequence

from keras_dist import _worker
from keras_dist.launch import _check_int, _launch, _signal_name

__all__ = ["WorkerError", "notebook_launcher"]


class WorkerError(RuntimeError):
    """A worker raised an exception, or died without returning a result.

    Attributes:
        worker_index: Index of the failing worker (its TF_CONFIG task index).
        traceback_text: The worker's formatted traceback, or `None` when it died
            without one (killed by a signal, crashed, `os._exit`).
        returncode: The worker's exit status as `subprocess` reports it (`-N` for
            signal N), or `None` when unknown.
    """

    def __init__(
        self,
        message: str,
        *,
        worker_index: int,
        traceback_text: str | None = None,
        returncode: int | None = None,
    ):
        super().__init__(message)
        self.worker_index = worker_index
        self.traceback_text = traceback_text
        self.returncode = returncode

    def __reduce__(self):
        # Keyword-only arguments: the default exception pickling would lose them.
        return _rebuild_worker_error, (str(self), self.worker_index, self.traceback_text,
                                       self.returncode)


def _rebuild_worker_error(message, worker_index, traceback_text, returncode):
    return WorkerError(message, worker_index=worker_index, traceback_text=traceback_text,
                       returncode=returncode)


def notebook_launcher(
    fn: Callable[..., Any],
    args: Sequence[Any] = (),
    num_workers: int = 2,
    timeout: float | None = None,
    *,
    kwargs: Mapping[str, Any] | None = None,
    env: Mapping[str, str | None] | None = None,
    virtual_devices: int | None = None,
) -> list:
    """Calls `fn(*args, **kwargs)` on `num_workers` local worker processes.

    Use it to try multi-worker training from Jupyter: define the training function in a
    cell (create `keras_dist.strategy()` *inside* it) and launch it here. Functions defined
    in the notebook are sent by value; functions from modules are imported by name in the
    workers, which see the caller's `sys.path`. When one worker fails the others are
    stopped at once.

    Args:
        fn: The function; it and `args`/`kwargs` must be picklable by cloudpickle.
        args: Positional arguments, the same for every worker.
        num_workers: Number of worker processes (>= 1).
        timeout: Seconds before all workers are stopped; `None` waits forever.
        kwargs: Keyword arguments, the same for every worker.
        env: Extra environment variables for the workers (`None` values unset).
        virtual_devices: When set, each worker calls `keras_dist.virtual_devices(k)`
            before unpickling `fn`, so it has k logical devices.

    Returns:
        The return values, ordered by worker index.

    Raises:
        WorkerError: A worker raised (the message names it and contains its traceback)
            or died without a result (the message gives its exit code or signal).
        TimeoutError: `timeout` elapsed; every worker was stopped.
        TypeError: `fn` or its arguments cannot be pickled.
        ValueError: An argument is invalid.

    Example:
        >>> def train(epochs):
        ...     import keras_dist
        ...     strategy = keras_dist.strategy()
        ...     return keras_dist.worker_index()
        >>> keras_dist.notebook_launcher(train, args=(3,), num_workers=2)
        [0, 1]
    """
    return _run_function(
        fn, args=args, kwargs=kwargs, num_workers=num_workers, timeout=timeout, env=env,
        virtual_devices=virtual_devices, caller="notebook_launcher",
    )


def _run_function(
    fn: Callable[..., Any],
    *,
    args: Sequence[Any],
    kwargs: Mapping[str, Any] | None,
    num_workers: int,
    timeout: float | None,
    env: Mapping[str, str | None] | None,
    virtual_devices: int | None,
    caller: str,
    multi_worker: bool = True,
) -> list:
    """The shared core of `notebook_launcher` and `keras_dist.testing`."""
    if not callable(fn):
        raise TypeError(f"{caller}: `fn` must be callable. Received: fn={fn!r}")
    if isinstance(args, (str, bytes)) or not isinstance(args, Sequence):
        raise ValueError(
            f"Argument `args` must be a tuple or list of positional arguments. "
            f"Received: args={args!r}"
        )
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise ValueError(f"Argument `kwargs` must be a mapping. Received: kwargs={kwargs!r}")
    if virtual_devices is not None and (
        isinstance(virtual_devices, bool) or not isinstance(virtual_devices, int)
        or virtual_devices < 1
    ):
        raise ValueError(
            "Argument `virtual_devices` must be an integer >= 1 or None. "
            f"Received: virtual_devices={virtual_devices!r}"
        )
    _check_int("num_workers", num_workers, minimum=1)

    directory = tempfile.mkdtemp(prefix="keras_dist_run_")
    try:
        try:
            payload_path = _worker.write_payload(
                directory, fn, args, kwargs or {}, virtual_devices
            )
        except Exception as error:  # cloudpickle raises many types (TypeError, PicklingError)
            raise TypeError(
                f"{caller}: cannot send {_name(fn)} and its arguments to the workers: "
                f"cloudpickle failed with {type(error).__name__}: {error}. Pass only "
                "picklable arguments (no open files, locks, TF tensors or models; create "
                "those inside the function)."
            ) from error
        result_dir = os.path.join(directory, "results")
        os.mkdir(result_dir)
        child_env = dict(env or {})
        child_env["PYTHONPATH"] = _pythonpath(child_env.get("PYTHONPATH", os.environ.get(
            "PYTHONPATH")))
        result = _launch(
            [sys.executable, "-m", "keras_dist._worker", payload_path, result_dir],
            num_workers,
            env=child_env,
            timeout=timeout,
            set_tf_config=multi_worker,
        )
        records = [_worker.read_result(result_dir, i) for i in range(num_workers)]
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return _collect(records, result, num_workers, caller, timeout)


def _collect(records, result, num_workers, caller, timeout) -> list:
    # When the function finished on every worker, the results are returned even if a
    # worker then failed while the interpreter shut down (TensorFlow's at-exit handlers
    # can crash): the work is done and the values are valid.
    if not all(record and record["status"] == "ok" for record in records):
        if result.timed_out:
            raise TimeoutError(
                f"{caller}: the workers did not finish within timeout={timeout:g} s and "
                "were stopped. Their output above (prefixed [worker i]) shows where they "
                "were; raise `timeout` if the work is just slow."
            )
        failed = result.failed_worker
        if failed is None:  # every worker exited 0, yet one wrote no result (os._exit)
            failed = next(i for i, r in enumerate(records) if not r or r["status"] != "ok")
        _raise_for(failed, records[failed], result, num_workers, caller)
    values = []
    for index, record in enumerate(records):
        try:
            values.append(_worker.load_value(record))
        except Exception as error:
            raise WorkerError(
                f"{caller}: worker {index} returned a value that cannot be unpickled in "
                f"this process: {type(error).__name__}: {error}",
                worker_index=index,
            ) from error
    return values


def _raise_for(index, record, result, num_workers, caller):
    returncode = result.worker_returncodes[index]
    where = f"worker {index} (of {num_workers})"
    if record is not None and record["status"] == "error":
        hint = _worker.PHASE_HINTS.get(record["phase"], "it failed")
        raise WorkerError(
            f"{caller}: {where} failed: {hint}: {record['type']}: {record['message']}\n\n"
            f"Traceback from worker {index}:\n{record['traceback']}",
            worker_index=index,
            traceback_text=record["traceback"],
            returncode=returncode,
        )
    if returncode is not None and returncode < 0:
        how = f"was killed by signal {_signal_name(-returncode)}"
        if -returncode == signal.SIGKILL:
            how += " (often the out-of-memory killer)"
    else:
        how = f"exited with code {returncode}"
    if record is not None:  # finished the function, then died; the others were stopped
        what = f"returned, but then {how}, so the other workers were stopped"
    else:
        what = f"died without returning a result: it {how}"
    raise WorkerError(
        f"{caller}: {where} {what}. Its output above (prefixed [worker {index}]) may "
        "say why.",
        worker_index=index,
        returncode=returncode,
    )


def _pythonpath(existing: str | None) -> str:
    # Functions from importable modules (e.g. pytest test modules, the user's package)
    # are pickled by reference; the worker must find those modules where we found them.
    entries = [os.getcwd() if entry == "" else entry for entry in sys.path]
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    entries.insert(0, package_root)  # so `-m keras_dist._worker` runs even uninstalled
    if existing:
        entries = existing.split(os.pathsep) + entries
    unique = []
    for entry in entries:
        if entry and entry not in unique and os.path.exists(entry):
            unique.append(entry)
    return os.pathsep.join(unique)


def _name(fn) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)
