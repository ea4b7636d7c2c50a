"""Creates keras_dist.strategy() under the TF_CONFIG it was given, as a scheduler's pod would.

Usage: start_strategy.py [--startup-timeout S] [--record-sigterm]

--record-sigterm installs a SIGTERM handler that only records the signal, as TensorFlow's
preemption handler does, to check that the wait for peers still ends on SIGTERM.
"""

import argparse
import signal
import sys
import time

parser = argparse.ArgumentParser()
parser.add_argument("--startup-timeout", type=float, default=None)
parser.add_argument("--record-sigterm", action="store_true")
args = parser.parse_args()

if args.record_sigterm:
    signal.signal(signal.SIGTERM, lambda signum, frame: print("SIGTERM recorded", flush=True))

import keras_dist  # noqa: E402

started = time.monotonic()
print("calling keras_dist.strategy()", flush=True)
try:
    strategy = keras_dist.strategy(startup_timeout_seconds=args.startup_timeout)
except BaseException as error:
    print(f"{type(error).__name__} after {time.monotonic() - started:.1f} s", flush=True)
    raise
print(f"strategy ready after {time.monotonic() - started:.1f} s: "
      f"{strategy.num_replicas_in_sync} replicas", flush=True)
sys.exit(0)
