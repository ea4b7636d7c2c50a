"""A worker group where one worker fails while the others hang, for the launcher tests.

Usage: fail_one.py OUT_DIR [--fail-worker I] [--code C | --signal NAME]
                   [--fail-attempts N] [--ignore-sigterm] [--grandchild]

In a failing attempt (KERAS_DIST_RESTART < N; every attempt by default) every other worker
writes OUT_DIR/attempt-<a>-worker-<i>.pid (and, with --grandchild, starts a sleeping child
process and writes its pid to ...-grandchild.pid), then sleeps; worker I waits for those
files, so the test knows which pids must be gone afterwards, and then fails. In later
attempts every worker exits 0. --fail-worker -1 makes every worker just sleep.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import time

parser = argparse.ArgumentParser()
parser.add_argument("out_dir")
parser.add_argument("--fail-worker", type=int, default=1)
parser.add_argument("--code", type=int, default=3)
parser.add_argument("--signal", default=None)
parser.add_argument("--fail-attempts", type=int, default=1_000_000)
parser.add_argument("--ignore-sigterm", action="store_true")
parser.add_argument("--grandchild", action="store_true")
args = parser.parse_args()

tf_config = json.loads(os.environ["TF_CONFIG"])
index = tf_config["task"]["index"]
num_workers = len(tf_config["cluster"]["worker"])
attempt = int(os.environ["KERAS_DIST_RESTART"])
print(f"worker {index} attempt {attempt} started", flush=True)
if attempt >= args.fail_attempts:
    sys.exit(0)


def pid_file(worker, kind="worker"):
    suffix = "" if kind == "worker" else "-grandchild"
    return os.path.join(args.out_dir, f"attempt-{attempt}-worker-{worker}{suffix}.pid")


def write_atomically(path, text):
    with open(path + ".tmp", "w") as file:
        file.write(text)
    os.replace(path + ".tmp", path)


if index != args.fail_worker:
    if args.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # inherited by the grandchild too
    if args.grandchild:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        write_atomically(pid_file(index, "grandchild"), str(child.pid))
    write_atomically(pid_file(index), str(os.getpid()))
    time.sleep(120)
    sys.exit(0)

deadline = time.monotonic() + 60
expected = [pid_file(i) for i in range(num_workers) if i != index]
if args.grandchild:
    expected += [pid_file(i, "grandchild") for i in range(num_workers) if i != index]
while not all(os.path.exists(path) for path in expected) and time.monotonic() < deadline:
    time.sleep(0.02)
print(f"worker {index} failing now", flush=True)
if args.signal:
    os.kill(os.getpid(), getattr(signal, args.signal))
    time.sleep(10)
sys.exit(args.code)
