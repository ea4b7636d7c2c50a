"""Worker 1 raises; worker 0 then prints a cascade of errors as TensorFlow's survivors do.

Worker 0 waits in a pretend collective; on SIGTERM (the launcher stopping it) it prints the
"Collective ops is aborted" traceback survivors print, and exits 1. The launcher's last
lines must still name worker 1 and end with worker 1's own traceback.
"""

import json
import os
import signal
import sys
import time

index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]


def cascade(signum, frame):
    print("Traceback (most recent call last):\n  File \"train.py\", line 9, in <module>\n"
          "tensorflow.python.framework.errors_impl.UnavailableError: Collective ops is "
          "aborted by: another worker failed", file=sys.stderr, flush=True)
    sys.exit(1)


if index == 0:
    signal.signal(signal.SIGTERM, cascade)
    print("worker 0 in a collective", flush=True)
    time.sleep(60)
else:
    time.sleep(0.5)
    raise ValueError("the root cause, on worker 1")
