"""Fix: under a strategy, Keras builds a model by calling `call()`, which some models lack.

keras-team/keras#20164. Without a strategy, Keras' TF trainer builds nothing before
`fit`/`evaluate`: the step function creates what it needs when it is first traced. Under
a strategy scope it first runs a *symbolic build*, `compute_output_spec(model, x)`, which
calls the model's `call()` on the first batch. A model written around its own
`train_step` -- the GAN of the keras-io guide "Customizing what happens in fit()", the
VAE, WGAN-GP, CycleGAN, SimCLR -- has no `call()` (or one whose input is not the data),
so `fit` fails with "Unable to automatically build the model" / "does not have a `call()`
method" on every strategy, one device included, while plain Keras trains it.

keras_dist skips the symbolic build for a model whose class defines no `call()`, and,
for a model with its own `train_step`/`test_step`, when the build fails: exactly what
Keras does without a strategy. The step then builds its sub-models' optimizers and
metrics when `fit` traces it, inside the strategy (MirroredStrategy and
MultiWorkerMirroredStrategy create those variables mirrored from replica context).
"""

from __future__ import annotations

import functools

from keras_dist.compat import _internals, _patch, _probe
from keras_dist.compat._fix import Fix

NAME = "build_models_without_call"
_ATTRIBUTE = "_symbolic_build"
# Upstream's failure for a model class that defines no call().
_NO_CALL = "does not have a `call()` method"


def _trainer():
    return _internals._base_trainer()


def defines_call(model) -> bool:
    """Whether `model`'s class (not keras.Model) defines `call()`."""
    import keras

    return getattr(type(model), "call", None) is not keras.Model.call


def _own_step(model) -> bool:
    """Whether the model replaces Keras' train_step or test_step."""
    import keras

    return any(getattr(type(model), name, None) is not getattr(keras.Model, name)
               for name in ("train_step", "test_step"))


def probe(function=None) -> str:
    """PRESENT while the symbolic build of a model without `call()` raises.

    Behavioural: builds a bare `keras.Model` subclass symbolically (no variables, no
    TensorFlow ops run: `compute_output_spec` traces into a scratch graph).
    """
    import keras
    import numpy as np

    trainer = _trainer()
    if trainer is None:
        return _probe.FIXED
    function = function or _patch.original(trainer, _ATTRIBUTE)

    class ProbeModelWithoutCall(keras.Model):
        def train_step(self, data):
            return {}

    model = ProbeModelWithoutCall()
    model.optimizer = None  # what compile() would set; compiling would create variables
    try:
        function(model, data_batch=(np.zeros((1, 1), "float32"),))
    except Exception as error:  # upstream raises ValueError or RuntimeError
        return _probe.PRESENT if _NO_CALL in str(error) else _probe.UNKNOWN
    return _probe.FIXED


def apply() -> None:
    trainer = _trainer()
    original = _patch.original(trainer, _ATTRIBUTE)

    @functools.wraps(original)
    def _symbolic_build(self, iterator=None, data_batch=None):
        if not defines_call(self):
            return None  # as Keras without a strategy: the traced step builds
        if not _own_step(self):
            return original(self, iterator=iterator, data_batch=data_batch)
        try:
            return original(self, iterator=iterator, data_batch=data_batch)
        except (ValueError, RuntimeError, TypeError, NotImplementedError):
            # A call() that does not take the data as input (a GAN's generator call):
            # Keras without a strategy never makes this call; its step builds instead.
            return None

    _patch.patch(trainer, _ATTRIBUTE, _symbolic_build, fix=NAME)


FIX = Fix(
    name=NAME,
    upstream="keras-team/keras#20164",
    summary="Models without call() (or with their own train_step whose call does not "
    "take the data) are built by their traced step, as without a strategy.",
    symbols=("keras.Trainer._symbolic_build",),
    probe=probe,
    apply=apply,
)
