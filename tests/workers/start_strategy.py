"""Creates keras_dist.strategy() under the TF_CONFIG it was given, as a scheduler's pod would.

Usage: start_strategy.py [--startup-timeout S] [--record-sigterm] [--op-first] [--collective]

--record-sigterm installs a SIGTERM handler that only records the signal, as TensorFlow's
preemption handler does, to check that the wait for peers still ends on SIGTERM.
--op-first runs a TensorFlow op before keras_dist.strategy() (the tutorials' "data before
strategy" order): the op starts the server, so the wait for peers happens there.
--collective: after the strategy, worker 1 crashes (exits at once) and worker 0 enters an all-reduce that
can never finish (to check that SIGTERM still ends worker 0 promptly).
"""

import argparse
import os
import signal
import sys
import time

parser = argparse.ArgumentParser()
parser.add_argument("--startup-timeout", type=float, default=None)
parser.add_argument("--record-sigterm", action="store_true")
parser.add_argument("--op-first", action="store_true")
parser.add_argument("--collective", action="store_true")
args = parser.parse_args()

if args.record_sigterm:
    signal.signal(signal.SIGTERM, lambda signum, frame: print("SIGTERM recorded", flush=True))

import keras_dist  # noqa: E402

started = time.monotonic()
try:
    if args.op_first:
        import tensorflow as tf

        print("running an op before keras_dist.strategy()", flush=True)
        tf.constant(1.0)
    print("calling keras_dist.strategy()", flush=True)
    strategy = keras_dist.strategy(startup_timeout_seconds=args.startup_timeout)
except BaseException as error:
    print(f"{type(error).__name__} after {time.monotonic() - started:.1f} s", flush=True)
    raise
print(f"strategy ready after {time.monotonic() - started:.1f} s: "
      f"{strategy.num_replicas_in_sync} replicas", flush=True)
if args.collective:
    import tensorflow as tf

    if keras_dist.worker_index() == 1:
        print("worker 1 crashes", flush=True)
        os._exit(1)  # gone at once, as a crashed or killed peer

    @tf.function
    def step():
        return tf.distribute.get_replica_context().all_reduce("sum", tf.constant(1.0))

    print("worker 0 enters the all-reduce", flush=True)
    strategy.run(step)
    print("the all-reduce returned", flush=True)
sys.exit(0)
