"""Where Keras' TensorFlow backend keeps the internals keras_dist touches.

Keras renames things between releases (`TensorFlowTrainer` became `Trainer` in the 3.16
nightlies), so every lookup of a Keras-private object goes through here, by role rather
than by one spelling of its name.
"""

from __future__ import annotations


def keras_version() -> tuple[int, int, int]:
    """Keras' version as three integers (pre-release suffixes dropped)."""
    import keras

    parts = []
    for piece in keras.__version__.split(".")[:3]:
        digits = "".join(c for c in piece.split("dev")[0] if c.isdigit())
        parts.append(int(digits or 0))
    return tuple((parts + [0, 0, 0])[:3])


def versions() -> str:
    """'Keras X, TensorFlow Y' for error messages."""
    import keras
    import tensorflow as tf

    return f"Keras {keras.__version__}, TensorFlow {tf.__version__}"


def uses_tensorflow_backend() -> bool:
    import keras

    return keras.backend.backend() == "tensorflow"


def trainer_module():
    """`keras.src.backend.tensorflow.trainer`, or None on another backend."""
    if not uses_tensorflow_backend():
        return None
    from keras.src.backend.tensorflow import trainer

    return trainer


def trainer_class():
    """The TensorFlow backend's trainer class (a base of `keras.Model`), or None.

    Found by its module among `keras.Model`'s bases, so a rename upstream does not
    lose it.
    """
    import keras

    module = trainer_module()
    if module is None:
        return None
    for base in keras.Model.__mro__:
        if base.__module__ == module.__name__:
            return base
    return None


def loss_scale_optimizer_class():
    if not uses_tensorflow_backend():
        return None
    import keras

    return keras.optimizers.LossScaleOptimizer


def tf_optimizer_class():
    """The TensorFlow backend's optimizer base (`TFOptimizer`), or None."""
    import keras

    if not uses_tensorflow_backend():
        return None
    module = "keras.src.backend.tensorflow.optimizer"
    for base in keras.optimizers.Optimizer.__mro__:
        if base.__module__ == module:
            return base
    return None
