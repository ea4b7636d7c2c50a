"""Writes a '\\r' progress bar like Keras' (no newline until the end), for the launcher tests.

Usage: progress.py STEPS SECONDS_PER_STEP   (each worker writes the same bar)
"""

import sys
import time

steps, pause = int(sys.argv[1]), float(sys.argv[2])
for step in range(1, steps + 1):
    # Keras' dynamic display: backspaces over the old bar, '\r', the new bar.
    sys.stdout.write("\b" * 12 + f"\rstep {step}/{steps}")
    sys.stdout.flush()
    time.sleep(pause)
sys.stdout.write("\n")
print("done", flush=True)
