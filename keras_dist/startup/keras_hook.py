"""`import keras_dist` makes `keras.distribution` work on TensorFlow, before or after Keras,
and makes Keras's loops report their progress (`keras_dist.stall.keras_loops`).

The `keras_distribution_on_tensorflow` fix (with `input_epoch`, which tells
`BackupAndRestore` what a fit trains on) patches Keras's TensorFlow backend, which
exists only once Keras is imported (and importing Keras imports TensorFlow, which
`import keras_dist` must not do: `keras_dist.virtual_devices(n)` may still come first).
So `install()` applies the fix at once when Keras is already imported, and otherwise
leaves a one-shot import hook that applies it right after `import keras` finishes. On
another Keras backend nothing happens; `KERAS_DIST_DISABLE_COMPAT` is honoured.
"""

from __future__ import annotations

import importlib.abc
import sys
import warnings


def _apply() -> None:
    from keras_dist import compat
    from keras_dist.compat import _keras_tf, input_epoch, keras_distribution
    from keras_dist.stall import keras_loops

    try:  # every backend: Keras's loops report progress for stall detection
        keras_loops.install()
    except Exception as error:  # never break `import keras`
        warnings.warn(f"keras_dist could not follow Keras's loops for stall detection "
                      f"({type(error).__name__}: {error}); stalls go unnoticed in this "
                      "process.", RuntimeWarning, stacklevel=2)
    try:
        if _keras_tf.uses_tensorflow_backend():
            # input_epoch notes which input a fit trains on: BackupAndRestore under a
            # keras.distribution records its order too (resuming on another count).
            compat.apply(names=(keras_distribution.NAME, input_epoch.NAME))
            _after_import("keras_hub", _apply_keras_hub)
    except Exception as error:  # never break `import keras`; say what is off instead
        warnings.warn(
            f"keras_dist could not install keras.distribution for TensorFlow "
            f"({type(error).__name__}: {error}); keras.distribution is Keras's own "
            "(TensorFlow prototype) in this process.", RuntimeWarning, stacklevel=2)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds module `name` with the other finders and runs `then()` once it is executed."""

    def __init__(self, name: str, then):
        self.name, self.then = name, then

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module

        def exec_then_apply(module):
            exec_module(module)
            if self in sys.meta_path:  # once (a bare find_spec, as TensorFlow's, is no import)
                sys.meta_path.remove(self)
            self.then()

        loader.exec_module = exec_then_apply
        return spec


def _after_import(name: str, then) -> None:
    """`then()` now if module `name` is imported, else right after it is."""
    if name in sys.modules:
        then()
    elif not any(isinstance(finder, _AfterImport) and finder.name == name
                 for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(name, then))


def _apply_keras_hub() -> None:
    from keras_dist import compat
    from keras_dist.compat import keras_distribution

    if not compat.applied().get(keras_distribution.NAME):
        return
    try:
        keras_distribution.apply_keras_hub()
    except Exception as error:  # never break `import keras_hub`
        warnings.warn(
            f"keras_dist could not prepare keras-hub's generate() for keras.distribution "
            f"meshes ({type(error).__name__}: {error}); call generate() inside the "
            "distribution's scope.", RuntimeWarning, stacklevel=2)


def install() -> None:
    """Applies the fix now if Keras is imported, else right after it is; its keras-hub
    part likewise once keras-hub is imported."""
    _after_import("keras", _apply)
