"""Run a function on N local worker processes: the one core of `notebook_launcher` and
`keras_dist.testing`.

The parent pickles the call (`keras_dist.launching.worker`), starts the workers through
`local.run_group` (so they get the same TF_CONFIG, output handling and fail-fast stop as
`keras-dist launch`), reads their result files and returns the values or raises
`WorkerError` naming the failing worker.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import sys
import tempfile
from typing import Any, Callable, Mapping, Sequence

from keras_dist import _validation
from keras_dist.launching import worker as _worker
from keras_dist.launching.local import run_group
from keras_dist.launching.options import Options
from keras_dist.launching.processes import signal_name

__all__ = ["WorkerError", "run_function"]  # and the pieces launching.pool shares


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


def run_function(caller: str, fn: Callable[..., Any], args: Sequence[Any],
                 kwargs: Mapping[str, Any] | None, num_workers: int, options: Options,
                 virtual_devices: int | None = None) -> list:
    """Calls `fn(*args, **kwargs)` on `num_workers` workers; the values by worker index."""
    check_call(caller, fn, args, kwargs, virtual_devices)
    _validation.check_int("num_workers", num_workers, minimum=1)
    _validation.check_optional_number("timeout", options.timeout, minimum=0, unit="seconds")
    directory = tempfile.mkdtemp(prefix="keras_dist_run_")
    try:
        payload_path = payload(caller, directory, fn, args, kwargs, virtual_devices)
        result_dir = os.path.join(directory, "results")
        os.mkdir(result_dir)
        env = dict(options.env or {})
        env["PYTHONPATH"] = pythonpath(env.get("PYTHONPATH", os.environ.get("PYTHONPATH")))
        command = [sys.executable, "-m", "keras_dist.launching.worker", payload_path,
                   result_dir]
        result = run_group(command, num_workers, dataclasses.replace(options, env=env))
        # After shrinking (`min_workers`) the last attempt ran fewer workers.
        records = [_worker.read_result(result_dir, i, f"attempt-{result.restarts}-worker-")
                   for i in range(result.num_workers)]
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return _collect(records, result, result.num_workers, caller, options.timeout)


def check_call(caller, fn, args, kwargs, virtual_devices) -> None:
    if not callable(fn):
        raise TypeError(f"{caller}: `fn` must be callable. Received: fn={fn!r}")
    if isinstance(args, (str, bytes)) or not isinstance(args, Sequence):
        raise ValueError(_validation.message("args", "a tuple or list of positional "
                                             "arguments", args))
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise ValueError(_validation.message("kwargs", "a mapping", kwargs))
    if virtual_devices is not None:
        _validation.check_int("virtual_devices", virtual_devices, minimum=1,
                              hint="Pass None to use the devices as they are.")


def payload(caller, directory, fn, args, kwargs, virtual_devices) -> str:
    try:
        return _worker.write_payload(directory, fn, args, kwargs or {}, virtual_devices)
    except Exception as error:  # cloudpickle raises many types (TypeError, PicklingError)
        raise TypeError(
            f"{caller}: cannot send {_name(fn)} and its arguments to the workers: "
            f"cloudpickle failed with {type(error).__name__}: {error}. Pass only "
            "picklable arguments (no open files, locks, TF tensors or models; create "
            "those inside the function)."
        ) from error


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
        if result.stalled:
            raise_stall(result, caller)
        failed = result.failed_worker
        if failed is None:  # every worker exited 0, yet one wrote no result (os._exit)
            failed = next(i for i, r in enumerate(records) if not r or r["status"] != "ok")
        raise_for(failed, records[failed], result.worker_returncodes, num_workers, caller)
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


def raise_stall(result, caller):
    """Raises the WorkerError for a launch whose last attempt stalled."""
    stuck = result.stalled_workers
    stacks = "\n".join(f"Python stacks of worker {index} (all threads, most recent call "
                       f"first):\n{text.rstrip() or '(not available)'}"
                       for index, text in zip(stuck, result.stall_stacks))
    raise WorkerError(
        f"{caller}: {result.message.split(': ', 1)[-1]}. The workers were stopped; with "
        f"`max_restarts` and `keras_dist.callbacks.BackupAndRestore` the run resumes from "
        f"its backup.\n\n{stacks}",
        worker_index=stuck[0],
        traceback_text=result.stall_stacks[0] or None,
        returncode=result.worker_returncodes[stuck[0]],
    )


def raise_for(index, record, returncodes, num_workers, caller):
    """Raises the WorkerError for worker `index`'s failed or missing result record."""
    returncode = returncodes[index]
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
        how = f"was killed by signal {signal_name(-returncode)}"
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


def pythonpath(existing: str | None) -> str:
    # Functions from importable modules (e.g. pytest test modules, the user's package)
    # are pickled by reference; the worker must find those modules where we found them.
    entries = [os.getcwd() if entry == "" else entry for entry in sys.path]
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
        __file__))))
    entries.insert(0, package_root)  # so `-m keras_dist.launching.worker` runs uninstalled
    if existing:
        entries = existing.split(os.pathsep) + entries
    unique = []
    for entry in entries:
        if entry and entry not in unique and os.path.exists(entry):
            unique.append(entry)
    return os.pathsep.join(unique)


def _name(fn) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)
