"""Runs several tutorial scripts one after another in this process (one mode per run).

Starting TensorFlow (and a multi-worker cluster) costs seconds per process, so the tests
run every tutorial of one mode in one process, or in one `keras-dist launch` worker group:

    python run_tutorials.py OUT_DIR [--virtual-devices 2] NAME...
    keras-dist launch --workers 2 run_tutorials.py OUT_DIR NAME...

For each NAME the driver seeds Python, NumPy and TensorFlow (so one-device and distributed
runs shuffle the same way), changes into OUT_DIR/work/NAME (shared by the workers, as a
shared filesystem is), runs tests/tutorials/NAME.py as `__main__` with the result path
OUT_DIR/NAME.worker{worker}.json, and records "ok" or the traceback in
OUT_DIR/status.worker<i>.json. In one process a failing tutorial does not stop the next;
a launched worker stops at the first failure (its peers may be blocked in a collective,
so the launcher must stop the group), and the caller starts the rest again. A tutorial
that runs longer than $KERAS_DIST_TUTORIAL_TIMEOUT seconds (default 120) is taken for a
hang: every thread's stack goes to OUT_DIR/hang.worker<i>.txt and the process exits 1.
"""

import keras_dist  # first: before any TensorFlow op

import argparse
import faulthandler
import json
import os
import runpy
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
TIMEOUT_ENV = "KERAS_DIST_TUTORIAL_TIMEOUT"


def _task_index() -> int:
    config = json.loads(os.environ.get("TF_CONFIG") or "{}")
    return int(config.get("task", {}).get("index", 0))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("names", nargs="+")
    parser.add_argument("--virtual-devices", type=int, default=None)
    args = parser.parse_args(argv)
    if args.virtual_devices:
        keras_dist.virtual_devices(args.virtual_devices)
    multi_worker = bool(json.loads(os.environ.get("TF_CONFIG") or "{}"))
    out_dir = os.path.abspath(args.out_dir)
    status_path = os.path.join(out_dir, f"status.worker{_task_index()}.json")
    status = {}
    hang_file = open(os.path.join(out_dir, f"hang.worker{_task_index()}.txt"), "w")
    timeout = float(os.environ.get(TIMEOUT_ENV, "120"))
    if HERE not in sys.path:
        sys.path.insert(0, HERE)
    import keras

    # Full tracebacks: the failures are read by people fixing keras_dist, not by users.
    keras.config.disable_traceback_filtering()
    for name in args.names:
        workdir = os.path.join(out_dir, "work", name)
        os.makedirs(workdir, exist_ok=True)
        keras.utils.set_random_seed(0)
        saved_argv, saved_cwd = sys.argv, os.getcwd()
        sys.argv = [os.path.join(HERE, name + ".py"),
                    os.path.join(out_dir, name + ".worker{worker}.json")]
        os.chdir(workdir)
        start = time.monotonic()
        hang_file.seek(0)
        hang_file.truncate()
        hang_file.write(f"{name} ran longer than {timeout:g} s; stacks:\n")
        hang_file.flush()
        faulthandler.dump_traceback_later(timeout, exit=True, file=hang_file)
        try:
            runpy.run_path(sys.argv[0], run_name="__main__")
            status[name] = {"status": "ok"}
        except BaseException:  # noqa: B902  (SystemExit from a script is a failure too)
            status[name] = {"status": "failed", "error": traceback.format_exc()}
            print(f"run_tutorials: {name} FAILED\n{status[name]['error']}", flush=True)
        finally:
            faulthandler.cancel_dump_traceback_later()
            sys.argv = saved_argv
            os.chdir(saved_cwd)
        status[name]["seconds"] = round(time.monotonic() - start, 1)
        with open(status_path + ".tmp", "w") as file:
            json.dump(status, file, indent=1)
        os.replace(status_path + ".tmp", status_path)
        if status[name]["status"] != "ok" and multi_worker:
            sys.stdout.flush()
            os._exit(1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
