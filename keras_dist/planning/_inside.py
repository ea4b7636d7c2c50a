"""Entry point of the process behind a simulated link: `python -m keras_dist.planning._inside
CALL RESULT` loads `(fn, kwargs)` from the cloudpickle file CALL and writes `(ok, value)`
(value: the return value, or the traceback text) to RESULT."""

from __future__ import annotations

import sys
import traceback


def main(call_path: str, result_path: str) -> int:
    import cloudpickle

    with open(call_path, "rb") as file:
        fn, kwargs = cloudpickle.load(file)
    try:
        outcome = (True, fn(**kwargs))
    except BaseException:  # noqa: BLE001 - sent back to the caller, which raises
        outcome = (False, traceback.format_exc())
    with open(result_path, "wb") as file:
        cloudpickle.dump(outcome, file)
    return 0 if outcome[0] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
