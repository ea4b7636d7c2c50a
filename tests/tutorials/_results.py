"""Writes what a tutorial script ended with as JSON, for tests/test_tutorials.py to compare.

Not part of any tutorial: each script calls `write_result(...)` once at its end. The path
is the script's first argument, else $KERAS_DIST_TUTORIAL_RESULT; a `{worker}` in it
becomes this worker's task index (0 without TF_CONFIG), so launched workers do not
overwrite each other. Without a path nothing is written.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

RESULT_ENV = "KERAS_DIST_TUTORIAL_RESULT"


def _task_index() -> int:
    # Read TF_CONFIG directly: the harness must not depend on the package under test.
    config = json.loads(os.environ.get("TF_CONFIG") or "{}")
    return int(config.get("task", {}).get("index", 0))


def flat_weights(model) -> list[float]:
    """All of a model's weights (`get_weights()` order), flattened to one float list."""
    return [float(value) for array in model.get_weights() for value in np.ravel(array)]


def _plain(value):
    if isinstance(value, dict):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if hasattr(value, "numpy"):
        value = value.numpy()
    if isinstance(value, np.ndarray):
        return _plain(value.tolist())
    if isinstance(value, (np.floating, float)):
        return float(value)
    if isinstance(value, (np.integer, int, bool, np.bool_)):
        return value.item() if hasattr(value, "item") else value
    if isinstance(value, bytes):
        return value.decode()
    return value


def write_result(strategy, *, weights=None, losses=None, metrics=None, values=None) -> None:
    """Writes the result JSON.

    Args:
        strategy: The tutorial's strategy (its replica count and task are recorded).
        weights: {label: model}; each model's flattened weights.
        losses: {label: list of losses} (e.g. `history.history["loss"]`).
        metrics: {label: number}.
        values: {label: any JSON-able value} the tutorial computed.
    """
    path = sys.argv[1] if len(sys.argv) > 1 else os.environ.get(RESULT_ENV)
    if not path:
        return
    resolver = getattr(strategy, "cluster_resolver", None)
    result = {
        "replicas": int(strategy.num_replicas_in_sync),
        "strategy": type(strategy).__name__,
        "task": [getattr(resolver, "task_type", None), getattr(resolver, "task_id", None)],
        "weights": {label: flat_weights(model) for label, model in (weights or {}).items()},
        "losses": _plain(losses or {}),
        "metrics": _plain(metrics or {}),
        "values": _plain(values or {}),
    }
    path = path.format(worker=_task_index())
    with open(path + ".tmp", "w") as file:
        json.dump(result, file)
    os.replace(path + ".tmp", path)
