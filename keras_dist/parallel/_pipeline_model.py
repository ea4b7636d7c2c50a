"""`PipelineModel`: a `keras.Model` whose stage s lives on `devices[s]` (GPipe schedule)."""

from __future__ import annotations

import keras
import tensorflow as tf

from keras_dist import _validation
from keras_dist.compat import pipeline_internals, registry
from keras_dist.parallel import placement


def _place(stage, device: str):
    """`stage`, re-created on `device` if it already has variables elsewhere."""
    if not stage.built:
        return stage
    weights = stage.get_weights()
    with tf.device(device):
        placed = stage.__class__.from_config(stage.get_config())
        if not placed.built and stage.inputs:
            placed.build(tuple(stage.inputs[0].shape))
    placed.set_weights(weights)
    return placed


def _split(structure, num_microbatches: int):
    """`num_microbatches` slices of every tensor in `structure` along the batch axis."""
    if structure is None:
        return [None] * num_microbatches
    flat = [tf.split(t, num_microbatches) for t in tf.nest.flatten(structure)]
    return [tf.nest.pack_sequence_as(structure, [parts[i] for parts in flat])
            for i in range(num_microbatches)]


@keras.saving.register_keras_serializable(package="keras_dist")
class PipelineModel(keras.Model):
    """A model cut into stages on several devices, trained with a GPipe schedule.

    Use it when the model's parameters and optimizer slots do not fit one device. Stage s's
    variables (and its optimizer slots) live on `devices[s]`; a batch is cut into
    `num_microbatches` micro-batches that flow through the stages; Keras' own loss is
    computed once on the whole batch from the micro-batches' predictions (so every
    reduction - "sum_over_batch_size", "sum", "mean_with_sample_weight", None -, sample
    weights, masks and weight regularizers give what the unsplit model gives), each
    micro-batch goes back from its share of the loss gradient, each stage's gradients are
    summed over the micro-batches on its device, and the optimizer applies them once, so
    training equals the unsplit model on the whole batch. Losses that stages add in
    `call()` (activity regularizers, `add_loss`) are averaged over the micro-batches:
    exact for Keras' L1/L2 activity regularizers (Keras divides them by the batch size)
    and an `add_loss` of a batch mean, not for a loss that sums over the batch; with
    `remat=True` such losses are refused. Built stages are re-created on their device
    from their config and weights; the model they came from is left as it was.

    Args:
        stages: A list of `keras.Sequential` (e.g. from `split_sequential`).
        devices: One device name per stage, `None` or `"auto"` for the local GPUs, else
            the logical CPUs (`keras_dist.virtual_devices(k)`).
        num_microbatches: Micro-batches per batch (>= 1); the batch size must be a
            multiple of it.
        remat: Recompute each stage's activations in the backward pass
            (`tf.recompute_grad`) instead of keeping them: less memory, more compute.
        data_parallel: In a multi-worker job (`keras-dist launch`), average each stage's
            gradients across workers before applying them (call `keras_dist.strategy()`
            first to start the collective runtime; build this model outside its scope and
            feed each worker its share of the global batch).

    Raises:
        ValueError: Devices count != stages, a device that does not exist, a stage whose
            output does not fit the next stage's input, a bad `num_microbatches`; in
            `fit`, a batch size that is not a multiple of `num_microbatches`, or
            `remat=True` with a stage that adds losses in `call()`.

    Example:
        >>> import keras, tensorflow as tf
        >>> from keras_dist.parallel import PipelineModel, split_sequential
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8),
        ...                           keras.layers.Dense(1)])
        >>> cpu = "/device:CPU:0"
        >>> pipe = PipelineModel(split_sequential(model, 2), devices=[cpu, cpu],
        ...                      num_microbatches=2)
        >>> pipe.compile(optimizer="sgd", loss="mse")
        >>> history = pipe.fit(tf.ones((8, 4)), tf.ones((8, 1)), verbose=0)
    """

    def __init__(self, stages, devices=None, num_microbatches: int = 1, remat: bool = False,
                 data_parallel: bool = False, **kwargs):
        super().__init__(**kwargs)
        if tf.distribute.has_strategy():
            # Measured on 2 launched workers x 2 logical CPUs: inside a
            # MultiWorkerMirroredStrategy scope every stage variable became a
            # MirroredVariable on CPU:0 (the strategy's only device per worker), silently
            # undoing the split across devices.
            raise ValueError(
                "PipelineModel must be built outside a tf.distribute strategy scope: the "
                "strategy mirrors every variable onto its own device per worker, undoing "
                "the pipeline's placement. Build it outside the scope and pass "
                "data_parallel=True to average gradients across workers.")
        if not isinstance(stages, (list, tuple)) or not stages:
            raise ValueError(_validation.message("stages", "a non-empty list of "
                                                 "keras.Sequential", stages))
        self.num_microbatches = _validation.check_int("num_microbatches", num_microbatches, 1)
        self.remat = _validation.check_bool("remat", remat)
        self.data_parallel = _validation.check_bool("data_parallel", data_parallel)
        self.devices = tuple(placement.resolve_devices(devices, len(stages)))
        self.stages = [_place(stage, device) for stage, device in zip(stages, self.devices)]
        _check_stage_shapes(self.stages)
        if all(stage.built for stage in self.stages):
            self.built = True

    def compile(self, *args, **kwargs):
        registry.check("parallel")
        super().compile(*args, **kwargs)
        _place_slots(self.optimizer, self.stages, self.devices)

    def compile_from_config(self, config):
        # Keras skips compile() on load when it is overridden; ours only adds slot placement.
        self.compile(**keras.saving.deserialize_keras_object(config))
        if self.built:
            self.optimizer.build(self.trainable_variables)

    def build(self, input_shape):
        shape = tuple(input_shape)
        for index, (stage, device) in enumerate(zip(self.stages, self.devices)):
            if not stage.built:
                with tf.device(device):
                    stage.build(shape)
            try:
                shape = tuple(stage.compute_output_shape(shape))
            except Exception as error:  # noqa: BLE001 - re-raised with the stage named
                raise _mismatch(index, shape, error) from error
        self.built = True

    def call(self, inputs, training=None):
        return self._forward(inputs, training=training, remat=False)

    def _forward(self, inputs, training, remat):
        activations = inputs
        for stage, device in zip(self.stages, self.devices):
            with tf.device(device):
                # The copy onto the stage's device is the only cross-device traffic.
                activations = tf.identity(activations)
                if remat:
                    activations = tf.recompute_grad(
                        lambda h, stage=stage: stage(h, training=True))(activations)
                else:
                    activations = stage(activations, training=training)
        return activations

    def train_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        self._check_batch(x)
        count = self.num_microbatches
        stage_variables = [stage.trainable_variables for stage in self.stages]
        flat_variables = [v for vs in stage_variables for v in vs]
        # Forward: one tape per micro-batch (GPipe: no data dependence between them).
        tapes, predictions, call_losses = [], [], []
        for part in _split(x, count):
            with tf.GradientTape() as tape:
                predictions.append(self._forward(part, training=True, remat=self.remat))
                call_losses.append(_call_losses(self))
            tapes.append(tape)
        if self.remat and any(call_losses):
            raise ValueError(_REMAT_CALL_LOSSES)
        y_pred = tf.nest.map_structure(lambda *parts: tf.concat(parts, axis=0),
                                       *predictions)
        # Keras' own loss of the whole batch (its reduction, sample weights, masks and
        # weight regularizers), so every reduction is exact, not only the mean.
        with tf.GradientTape() as loss_tape:
            loss_tape.watch(tf.nest.flatten(y_pred))
            for losses in call_losses:
                loss_tape.watch(losses)
            loss = pipeline_internals.compute_loss(self, x, y, y_pred, sample_weight)
            loss = loss + _call_loss_correction(call_losses)
            scaled = self.optimizer.scale_loss(loss)
        grad_pred, grad_calls, grad_vars = loss_tape.gradient(
            scaled, (tf.nest.flatten(y_pred), call_losses, flat_variables))
        # Backward: each micro-batch from its share of d(loss)/d(y_pred).
        grad_parts = [tf.split(g, count) for g in grad_pred]
        sums = [None] * len(self.stages)
        for index, tape in enumerate(tapes):
            targets = tf.nest.flatten(predictions[index]) + call_losses[index]
            seeds = [parts[index] for parts in grad_parts] + grad_calls[index]
            grads = tape.gradient(targets, stage_variables, output_gradients=seeds)
            sums = [_accumulate(total, g, device)
                    for total, g, device in zip(sums, grads, self.devices)]
        # Weight regularizers: through the loss tape, once per batch.
        offset = 0
        for stage, (grads, device) in enumerate(zip(sums, self.devices)):
            size = len(grads)
            with tf.device(device):
                sums[stage] = [_add(g, r) for g, r in zip(grads, grad_vars[offset:offset + size])]
            offset += size
        if self.data_parallel:
            from keras_dist import num_workers
            from keras_dist.parallel._cross_worker import all_reduce_stage_gradients

            sums = all_reduce_stage_gradients(sums, self.devices, num_workers())
        self.optimizer.apply_gradients(
            zip([g for stage in sums for g in stage], flat_variables))
        pipeline_internals.track_loss(self, loss, tf.shape(tf.nest.flatten(x)[0])[0])
        return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def _check_batch(self, x):
        first = tf.nest.flatten(x)[0]
        count, batch = self.num_microbatches, first.shape[0]
        if batch is not None and batch % count:
            raise ValueError(_batch_message(batch, count))
        if batch is None and count > 1:
            tf.debugging.assert_equal(
                tf.shape(first)[0] % count, 0,
                message=f"The batch size must be a multiple of num_microbatches={count} "
                        f"(e.g. {count}, {2 * count}, {4 * count}); for the last partial "
                        f"batch use a dataset with drop_remainder=True.")

    def get_config(self):
        config = super().get_config()
        config.update(stages=[keras.saving.serialize_keras_object(s) for s in self.stages],
                      devices=list(self.devices), num_microbatches=self.num_microbatches,
                      remat=self.remat, data_parallel=self.data_parallel)
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        config["stages"] = [keras.saving.deserialize_keras_object(s, custom_objects)
                            for s in config["stages"]]
        return cls(**config)


def _place_slots(optimizer, stages, devices) -> None:
    """Each variable's optimizer slots on its stage's device (compat.pipeline_internals)."""
    device_of = {id(v): d for stage, d in zip(stages, devices) for v in stage.variables}
    pipeline_internals.place_slots(optimizer, device_of)


_REMAT_CALL_LOSSES = (
    "PipelineModel(remat=True) cannot train a stage that adds losses in call() (an "
    "activity_regularizer or add_loss): the recomputed call's losses are outside the "
    "gradient. Use remat=False, or move the regularization to weights "
    "(kernel_regularizer), which works with remat.")


def _call_losses(model) -> list:
    """The losses the stages added in their last call (activity regularizers, add_loss).

    `model.losses` lists those (kept from the call) and the weight regularizers
    (recomputed on every read): the ones the same in two reads are the call's.
    """
    again = model.losses
    return [loss for loss in model.losses if any(loss is other for other in again)]


def _call_loss_correction(call_losses):
    """What turns Keras' loss (which holds the last micro-batch's call losses) into the
    whole batch's: the mean of every micro-batch's call losses. Keras divides an
    activity regularizer by the batch size, so for the sum-type L1/L2 regularizers (and
    an `add_loss` of a batch mean) the mean over equal micro-batches is exact."""
    if not any(call_losses):
        return 0.0
    total = [tf.reduce_sum(tf.cast(loss, keras.backend.floatx()))
             for losses in call_losses for loss in losses]
    last = [tf.reduce_sum(tf.cast(loss, keras.backend.floatx())) for loss in call_losses[-1]]
    return tf.add_n(total) / len(call_losses) - tf.add_n(last)


def _add(a, b):
    """a + b, where None (no gradient) counts as zero."""
    return a if b is None else b if a is None else a + b


def _accumulate(total, grads, device):
    if total is None:
        return list(grads)
    with tf.device(device):
        return [_add(t, g) for t, g in zip(total, grads)]


def _batch_message(batch, count) -> str:
    lower, upper = (batch // count) * count, (batch // count + 1) * count
    works = [s for s in (lower, upper) if s > 0]
    return _validation.message(
        "batch_size", f"a multiple of num_microbatches={count}", batch,
        f"Sizes that work: {works} (any multiple of {count}); or change num_microbatches "
        f"to a divisor of {batch}: {[d for d in range(1, batch + 1) if batch % d == 0]}")


def _mismatch(index, shape, error) -> ValueError:
    return ValueError(
        f"Stage {index} cannot take the output of stage {index - 1}: stage {index - 1} "
        f"gives shape {shape}. ({error})" if index else
        f"Stage 0 cannot take the model input of shape {shape}. ({error})")


def _check_stage_shapes(stages) -> None:
    for index in range(1, len(stages)):
        before, after = stages[index - 1], stages[index]
        if not (before.built and after.built and before.outputs and after.inputs):
            continue
        given, wanted = tuple(before.outputs[0].shape), tuple(after.inputs[0].shape)
        if given[1:] != wanted[1:]:
            raise ValueError(
                f"Stage {index - 1} gives shape {given} but stage {index} expects input "
                f"shape {wanted}. Re-split the model or fix the stage boundaries.")
