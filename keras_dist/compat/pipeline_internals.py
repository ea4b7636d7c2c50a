"""The Keras internals `keras_dist.parallel.PipelineModel` needs, and its slot-placement fix.

Three uses, each in the registry (`keras_dist.compat.registry`, group "parallel"):

* **Slot placement** (fix `pipeline_slot_placement`, probe-gated). Keras' TF optimizer
  creates every slot in `add_variable_from_reference` under
  `strategy.extended.colocate_vars_with(reference)`. `fit` builds the optimizer inside
  the first trace of its train function, where the slot variables are lifted out of the
  graph and the colocation is lost, so every slot of a pipeline landed on the default
  device (measured: Adam's slots for a stage on CPU:1 were on CPU:0; created eagerly
  they land right), defeating the split of optimizer memory across devices. `place_slots`
  replaces `add_variable_from_reference` on the one optimizer instance a `PipelineModel`
  compiles with, creating each slot under `tf.device(<its variable's stage device>)`.
  `probe()` reads that method: PRESENT while it places slots only by colocation,
  FIXED once it uses a device scope instead (nothing is replaced), UNKNOWN otherwise
  (replaced anyway: harmless). `KERAS_DIST_DISABLE_COMPAT=pipeline_slot_placement`
  turns it off; tests/test_parallel_pipeline.py shows the slots on one device then.
* **`Trainer._compute_loss`**: Keras' own loss of a batch (compiled loss, sample weights,
  masks, its reduction, `model.losses`), as Keras' `train_step` computes it, also for a
  `compute_loss` override without the `training` argument.
* **`Trainer._loss_tracker`**: the running mean Keras reports as "loss".
"""

from __future__ import annotations

import os

from keras_dist.compat import _keras_tf, _patch, _probe

NAME = "pipeline_slot_placement"
_ATTRIBUTE = "add_variable_from_reference"
_INSTALLED = "_keras_dist_slot_placement"

def _disabled() -> bool:
    value = os.environ.get("KERAS_DIST_DISABLE_COMPAT", "")
    names = {name.strip() for name in value.split(",") if name.strip()}
    return "all" in names or NAME in names


def probe() -> str:
    """PRESENT while Keras' TF optimizer places slots only by `colocate_vars_with`.

    FIXED only when its `add_variable_from_reference` no longer colocates and places
    the slot with a device scope; UNKNOWN when it changed otherwise (the fix applies).
    """
    optimizer = _keras_tf.tf_optimizer_class()
    if optimizer is None:
        return _probe.FIXED  # not the TensorFlow backend: no such code path
    return _probe.verdict_from_source(_patch.original(optimizer, _ATTRIBUTE),
                                      r"colocate_vars_with\(", required=r"\.device\(")


def place_slots(optimizer, device_of: dict[int, str]) -> bool:
    """Makes `optimizer` (and a wrapped inner optimizer) create each variable's slots on
    `device_of[id(variable)]`. Returns whether the replacement was installed."""
    import tensorflow as tf

    if _disabled() or probe() == _probe.FIXED:
        return False
    for target in (optimizer, getattr(optimizer, "inner_optimizer", None)):
        if target is None or getattr(target, _INSTALLED, False):
            continue
        create = getattr(target, _ATTRIBUTE)

        def placed(reference_variable, *args, _create=create, **kwargs):
            device = device_of.get(id(reference_variable))
            if device is None:
                return _create(reference_variable, *args, **kwargs)
            with tf.device(device):
                return _create(reference_variable, *args, **kwargs)

        setattr(target, _ATTRIBUTE, placed)
        setattr(target, _INSTALLED, True)
    return True


def compute_loss(model, x, y, y_pred, sample_weight):
    """Keras' loss of a batch, exactly as its `train_step` computes it."""
    return model._compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight,
                               training=True)


def track_loss(model, loss, batch_size) -> None:
    """Adds `loss` of a batch of `batch_size` to the "loss" Keras reports."""
    model._loss_tracker.update_state(loss, sample_weight=batch_size)

