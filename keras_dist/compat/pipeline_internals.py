"""The Keras internals `keras_dist.parallel.PipelineModel` needs, and its slot-placement fix.

Three uses, each in the registry (`keras_dist.compat.registry`, group "parallel"):

* **Slot placement** (fix `pipeline_slot_placement`, probe-gated). Keras' TF optimizer
  creates every slot in `add_variable_from_reference` under
  `strategy.extended.colocate_vars_with(reference)`; the default strategy honours that
  only in graph mode, and optimizer slots are created eagerly, so every slot of a
  pipeline landed on the first device (measured: Adam's slots for a stage on CPU:1 were
  on CPU:0), defeating the split of optimizer memory across devices. `place_slots`
  replaces `add_variable_from_reference` on the one optimizer instance a `PipelineModel`
  compiles with, creating each slot under `tf.device(<its variable's stage device>)`.
  `probe()` checks the behaviour itself: a slot for a variable made on another device
  lands there -> FIXED (nothing is replaced); it does not -> PRESENT; a single device
  -> UNKNOWN (replaced anyway: harmless). `KERAS_DIST_DISABLE_COMPAT=pipeline_slot_placement`
  turns it off.
* **`Trainer._compute_loss`**: Keras' own loss of a batch (compiled loss, sample weights,
  masks, its reduction, `model.losses`), as Keras' `train_step` computes it, also for a
  `compute_loss` override without the `training` argument.
* **`Trainer._loss_tracker`**: the running mean Keras reports as "loss".
"""

from __future__ import annotations

import os

from keras_dist.compat import _patch, _probe

NAME = "pipeline_slot_placement"
_ATTRIBUTE = "add_variable_from_reference"
_INSTALLED = "_keras_dist_slot_placement"

_verdicts: dict[tuple[str, ...], str] = {}


def _disabled() -> bool:
    value = os.environ.get("KERAS_DIST_DISABLE_COMPAT", "")
    names = {name.strip() for name in value.split(",") if name.strip()}
    return "all" in names or NAME in names


def probe(devices=()) -> str:
    """Does a slot for a variable on device D land on D without the fix? (see module doc)

    Checked once per set of devices: one SGD-with-momentum slot per distinct device.
    """
    import keras
    import tensorflow as tf

    distinct = tuple(sorted(set(devices)))
    if len(distinct) < 2:
        return _probe.UNKNOWN
    if distinct in _verdicts:
        return _verdicts[distinct]
    optimizer = keras.optimizers.SGD(momentum=0.9)
    create = _patch.original(type(optimizer), _ATTRIBUTE)
    verdict = _probe.FIXED
    for device in distinct:
        with tf.device(device):
            variable = keras.Variable(tf.zeros((1,)), name="slot_placement_probe")
        slot = create(optimizer, variable, name="probe")
        if tf.DeviceSpec.from_string(slot.value.device) != tf.DeviceSpec.from_string(
                variable.value.device):
            verdict = _probe.PRESENT
            break
    _verdicts[distinct] = verdict
    return verdict


def place_slots(optimizer, device_of: dict[int, str]) -> bool:
    """Makes `optimizer` (and a wrapped inner optimizer) create each variable's slots on
    `device_of[id(variable)]`. Returns whether the replacement was installed."""
    import tensorflow as tf

    if _disabled() or probe(device_of.values()) == _probe.FIXED:
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

