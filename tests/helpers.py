"""Helpers shared by test modules and by the functions they send to workers.

A plain module (not conftest.py) so that worker processes can import it by name: the
launcher passes the test process's sys.path on, and pytest puts tests/ on it.
"""

from __future__ import annotations

import numpy as np


def initial_weights() -> list:
    """Fixed weights of the reference MLP Dense(16) -> Dense(4) on 8 inputs."""
    rng = np.random.default_rng(1)
    return [
        (rng.normal(size=(8, 16)) * 0.5).astype("float32"), np.zeros(16, "float32"),
        (rng.normal(size=(16, 4)) * 0.5).astype("float32"), np.zeros(4, "float32"),
    ]


def max_diff(a, b) -> float:
    """The largest absolute difference between two lists of arrays (in float64)."""
    return max(float(np.max(np.abs(np.asarray(p, "float64") - np.asarray(q, "float64"))))
               for p, q in zip(a, b))


def write_tfrecords(directory, num_files: int, per_file: int) -> list[str]:
    """`num_files` TFRecord files of `per_file` examples each, with ids 0, 1, 2, ... in order."""
    import tensorflow as tf

    paths = []
    for file_index in range(num_files):
        path = str(directory / f"part-{file_index:02d}.tfrecord")
        with tf.io.TFRecordWriter(path) as writer:
            for offset in range(per_file):
                value = tf.train.Int64List(value=[file_index * per_file + offset])
                example = tf.train.Example(features=tf.train.Features(
                    feature={"id": tf.train.Feature(int64_list=value)}))
                writer.write(example.SerializeToString())
        paths.append(path)
    return paths


def start_workers_first(request, used_by: str, fn, timeout: float):
    """`fn` on 2 workers in the background, when a selected test uses fixture `used_by`.

    For a module that compares a 2-worker run with a multi-device subprocess: the workers
    start first, so the processes share the machine instead of taking turns. Returns
    `keras_dist.testing.Running` (`.result()` waits), or None when no selected test needs
    the workers.
    """
    from keras_dist.testing import start_on_workers

    if not any(used_by in item.fixturenames for item in request.session.items):
        return None
    return start_on_workers(fn, num_workers=2, timeout=timeout)
