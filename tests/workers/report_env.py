"""Writes what the launcher gave this worker to OUT_DIR/worker-<index>.json, then exits 0.

Usage: report_env.py OUT_DIR [ARGS...]   (ARGS are recorded, to check pass-through)
"""

import json
import os
import sys

ENV_NAMES = (
    "TF_CONFIG",
    "KERAS_DIST_LAUNCHED",
    "KERAS_DIST_RESTART",
    "PYTHONUNBUFFERED",
    "TF_CPP_MIN_LOG_LEVEL",
    "KD_TEST_EXTRA",
)

out_dir, args = sys.argv[1], sys.argv[2:]
index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
print(f"hello from worker {index}")
print(f"warning from worker {index}", file=sys.stderr)
with open(os.path.join(out_dir, f"worker-{index}.json"), "w") as file:
    json.dump({"argv": args, "env": {name: os.environ.get(name) for name in ENV_NAMES},
               # This script imports no TensorFlow: it is there only in a forked worker.
               "preloaded": "tensorflow" in sys.modules}, file)
