"""Offline stand-ins for the tutorials' downloads, and the one size knob the tests turn.

The tutorials download MNIST / Fashion-MNIST; tests have no network. These helpers return
arrays and datasets of the same shapes and dtypes, built from scikit-learn's bundled
8x8 digits (upscaled 3x and padded to 28x28), so the models still have something to learn.
"""

from __future__ import annotations

import os

import numpy as np

# The tutorials compute their global batch from a per-replica (or per-worker) batch. The
# tests run the one-device reference with this multiplier at 2, so that its global batch
# equals the one of the runs with 2 replicas and their weights can be compared.
BATCH_MULTIPLIER_ENV = "KERAS_DIST_TUTORIAL_BATCH_MULTIPLIER"


def batch_multiplier() -> int:
    return int(os.environ.get(BATCH_MULTIPLIER_ENV, "1"))


def _digit_images(count: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    digits = load_digits()
    order = np.random.RandomState(seed).permutation(len(digits.images))
    order = np.resize(order, count)
    small = digits.images[order]  # (count, 8, 8), values 0..16
    large = np.kron(small, np.ones((1, 3, 3)))  # (count, 24, 24)
    large = np.pad(large, ((0, 0), (2, 2), (2, 2)))  # (count, 28, 28), like MNIST
    images = np.round(large * (255.0 / 16.0)).astype(np.uint8)
    return images, digits.target[order].astype(np.uint8)


def mnist_load_data(num_train: int, num_test: int):
    """Like `keras.datasets.mnist.load_data()`: ((x_train, y_train), (x_test, y_test)).

    Images are uint8 of shape (N, 28, 28), labels uint8 of shape (N,).
    """
    images, labels = _digit_images(num_train + num_test, seed=0)
    return ((images[:num_train], labels[:num_train]),
            (images[num_train:], labels[num_train:]))


class _Split:
    def __init__(self, num_examples: int):
        self.num_examples = num_examples


class _Info:
    def __init__(self, num_train: int, num_test: int):
        self.splits = {"train": _Split(num_train), "test": _Split(num_test)}


def tfds_mnist(num_train: int, num_test: int):
    """Like `tfds.load(name='mnist', with_info=True, as_supervised=True)`.

    Returns ({'train': ds, 'test': ds}, info) with elements (uint8 (28, 28, 1), int64 label)
    and `info.splits[split].num_examples`.
    """
    import tensorflow as tf

    (x_train, y_train), (x_test, y_test) = mnist_load_data(num_train, num_test)
    datasets = {
        "train": tf.data.Dataset.from_tensor_slices(
            (x_train[..., None], y_train.astype(np.int64))),
        "test": tf.data.Dataset.from_tensor_slices(
            (x_test[..., None], y_test.astype(np.int64))),
    }
    return datasets, _Info(num_train, num_test)
