"""Both ends of the run-a-function protocol behind `notebook_launcher` and `keras_dist.testing`.

The parent writes one payload file and starts, through `keras_dist.launching`, N copies of

    python -m keras_dist.launching.worker PAYLOAD_PATH RESULT_DIR

Each worker (its index is `TF_CONFIG`'s task index, 0 without TF_CONFIG):

1. reads the payload: a plain pickle of `{"version", "virtual_devices", "sources", "call"}`,
   where `call` is the cloudpickled `(fn, args, kwargs)`. Two layers so that virtual
   devices are configured *before* unpickling `fn`, which may import a module that imports
   TensorFlow;
2. calls `keras_dist.virtual_devices(k)` when asked;
3. registers `sources` in `linecache`, unpickles and calls `fn(*args, **kwargs)`;
4. writes `RESULT_DIR/worker-<index>.pkl` atomically (write, then rename): a plain pickle of
   `{"status": "ok", "value": <cloudpickled return value>}` or
   `{"status": "error", "phase", "type", "message", "traceback"}`, and exits 0 or 1.

A missing result file therefore means the worker died (killed, crashed, `os._exit`); the
parent reports its exit code or signal instead. This module must stay light: it imports
TensorFlow only through `fn` or `virtual_devices`.
"""

from __future__ import annotations

import io
import json
import linecache
import marshal
import os
import pickle
import sys
import traceback
import types
from typing import Any, Callable, Mapping, Sequence

import cloudpickle

PAYLOAD_VERSION = 1

# What went wrong in which phase, said to the user in WorkerError's message.
PHASE_HINTS = {
    "load": "could not load the function in the worker process. Functions defined in a "
    "notebook or `__main__` travel by value; functions from modules are imported by name, "
    "so their module must be importable in the worker (the caller's sys.path is passed "
    "on through PYTHONPATH)",
    "virtual_devices": "could not set up the requested virtual devices before running "
    "the function",
    "call": "the function raised an exception",
    "result": "the function returned a value that cannot be pickled to send it back",
}


def write_payload(
    directory: str,
    fn: Callable[..., Any],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    virtual_devices: int | None,
) -> str:
    """Pickles the call into `directory/payload.pkl` and returns the path."""
    buffer = io.BytesIO()
    pickler = _Pickler(buffer)
    pickler.dump((fn, tuple(args), dict(kwargs)))
    payload = {
        "version": PAYLOAD_VERSION,
        "virtual_devices": virtual_devices,
        "sources": pickler.sources,
        "call": buffer.getvalue(),
    }
    path = os.path.join(directory, "payload.pkl")
    with open(path, "wb") as file:
        pickle.dump(payload, file)
    return path


class _Pickler(cloudpickle.Pickler):
    """cloudpickle that keeps the file names of functions it sends by value.

    cloudpickle renames their code's file to "<dynamic-code>", so in the worker
    `inspect.getsource` fails: AutoGraph cannot convert a `tf.function` defined in a
    notebook cell (it silently runs it as plain Python) and tracebacks show no source.
    The workers run this same interpreter, so `marshal` carries code objects exactly;
    source that exists only in this process's `linecache` (Jupyter cells) travels along.
    """

    def __init__(self, file):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.sources: dict[str, list[str]] = {}

    def reducer_override(self, obj):
        if isinstance(obj, types.CodeType):
            filename = obj.co_filename
            if filename not in self.sources and not os.path.isfile(filename):
                lines = linecache.getlines(filename)
                if lines:
                    self.sources[filename] = lines
            return marshal.loads, (marshal.dumps(obj),)
        return super().reducer_override(obj)


def load_value(record: dict) -> Any:
    """The return value in an `"ok"` result record."""
    return cloudpickle.loads(record["value"])


def result_path(result_dir: str, index: int, prefix: str = "worker-") -> str:
    return os.path.join(result_dir, f"{prefix}{index}.pkl")


def read_result(result_dir: str, index: int, prefix: str = "worker-") -> dict | None:
    """The result record of worker `index`, or `None` when it wrote none."""
    try:
        with open(result_path(result_dir, index, prefix), "rb") as file:
            return pickle.load(file)
    except FileNotFoundError:
        return None


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the payload's function in this worker; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 2:
        sys.stderr.write(
            "usage: python -m keras_dist.launching.worker PAYLOAD_PATH RESULT_DIR\n")
        return 2
    payload_path, result_dir = argv
    record = run_payload(payload_path)
    # One file per attempt (`KERAS_DIST_RESTART`): a restarted group's results never
    # mix with an earlier attempt's.
    attempt = os.environ.get("KERAS_DIST_RESTART", "0")
    write_atomically(result_path(result_dir, task_index(), f"attempt-{attempt}-worker-"),
                     record)
    if record["status"] == "error":
        # Also in the streamed log, so it is visible even before the parent raises.
        sys.stderr.write(record["traceback"])
        sys.stderr.flush()
        return 1
    sys.stdout.flush()
    return 0


def run_payload(payload_path: str) -> dict:
    """Loads the payload at `payload_path`, runs it, and returns its result record."""
    phase = "load"
    try:
        with open(payload_path, "rb") as file:
            payload = pickle.load(file)
        if payload.get("version") != PAYLOAD_VERSION:
            raise RuntimeError(
                f"payload version {payload.get('version')!r} != {PAYLOAD_VERSION}: the "
                "parent and the worker run different keras_dist versions"
            )
        if payload["virtual_devices"]:
            phase = "virtual_devices"
            setup_virtual_devices(payload["virtual_devices"])
            phase = "load"
        for filename, lines in payload.get("sources", {}).items():
            # mtime None: linecache.checkcache() keeps the entry although no file exists.
            linecache.cache[filename] = (sum(map(len, lines)), None, lines, filename)
        fn, args, kwargs = cloudpickle.loads(payload["call"])
        phase = "call"
        value = fn(*args, **kwargs)
        phase = "result"
        return {"status": "ok", "value": cloudpickle.dumps(value)}
    except SystemExit as error:
        # Exiting from inside the function would otherwise look like a silent success.
        return _error_record(phase, error, f"the function called sys.exit({error.code!r})")
    except Exception as error:  # noqa: BLE001 - every failure is reported to the parent
        return _error_record(phase, error, traceback.format_exc())


def _error_record(phase: str, error: BaseException, traceback_text: str) -> dict:
    return {
        "status": "error",
        "phase": phase,
        "type": type(error).__name__,
        "message": str(error),
        "traceback": traceback_text if traceback_text.endswith("\n") else traceback_text + "\n",
    }


def write_atomically(path: str, record: dict) -> None:
    # The parent may read the directory right after a kill: never leave half a file.
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(temporary, "wb") as file:
        pickle.dump(record, file)
    os.replace(temporary, path)


def task_index() -> int:
    # Deliberately not ClusterConfig: this must work before (and without) anything else
    # in keras_dist is imported, and the launcher wrote this TF_CONFIG itself.
    raw = os.environ.get("TF_CONFIG", "").strip()
    if not raw:
        return 0
    try:
        return int(json.loads(raw)["task"]["index"])
    except (ValueError, KeyError, TypeError):
        return 0


def setup_virtual_devices(count: int) -> None:
    import importlib

    try:
        devices = importlib.import_module("keras_dist.devices")
        virtual_devices = devices.virtual_devices
    except (ImportError, AttributeError) as error:
        raise RuntimeError(
            f"virtual_devices={count} needs keras_dist.devices.virtual_devices, which is "
            f"not available: {error}"
        ) from error
    virtual_devices(count)


if __name__ == "__main__":
    sys.exit(main())
