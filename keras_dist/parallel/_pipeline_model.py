"""`PipelineModel`: a `keras.Model` whose stage s lives on `devices[s]` (GPipe schedule)."""

from __future__ import annotations

import keras
import tensorflow as tf

from keras_dist import _validation
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
    `num_microbatches` micro-batches that flow through the stages, each stage's gradients
    are summed over the micro-batches on its device, and the optimizer applies them once,
    so training equals the unsplit model on the whole batch (for losses that average over
    the batch, the Keras default). Built stages are re-created on their device from their
    config and weights; the model they came from is left as it was.

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
            output does not fit the next stage's input, a bad `num_microbatches`.

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
        xs, ys, weights = (_split(part, count) for part in (x, y, sample_weight))
        stage_variables = [stage.trainable_variables for stage in self.stages]
        sums, losses, predictions = [None] * len(self.stages), [], []
        for index in range(count):
            with tf.GradientTape() as tape:
                prediction = self._forward(xs[index], training=True, remat=self.remat)
                loss = self._compute_loss(x=xs[index], y=ys[index], y_pred=prediction,
                                          sample_weight=weights[index], training=True)
                scaled = self.optimizer.scale_loss(loss / count)
            grads = tape.gradient(scaled, stage_variables)
            sums = [_accumulate(total, g, device)
                    for total, g, device in zip(sums, grads, self.devices)]
            losses.append(loss)
            predictions.append(prediction)
        if self.data_parallel:
            from keras_dist import num_workers
            from keras_dist.parallel._cross_worker import all_reduce_stage_gradients

            sums = all_reduce_stage_gradients(sums, self.devices, num_workers())
        self.optimizer.apply_gradients(
            zip([g for stage in sums for g in stage], [v for vs in stage_variables for v in vs]))
        y_pred = tf.concat(predictions, axis=0)
        self._loss_tracker.update_state(tf.add_n(losses) / count,
                                        sample_weight=tf.shape(tf.nest.flatten(x)[0])[0])
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
    """Makes `optimizer` create each variable's slots on that variable's stage device.

    Keras' TF optimizer colocates slots with `colocate_vars_with`, which the default
    strategy honours only in graph mode; slots are created eagerly, so without this they
    would all land on the first device and defeat the split of optimizer memory.
    """
    device_of = {id(v): d for stage, d in zip(stages, devices) for v in stage.variables}
    for target in (optimizer, getattr(optimizer, "inner_optimizer", None)):
        if target is None or getattr(target, "_keras_dist_placed", False):
            continue
        create = target.add_variable_from_reference

        def placed(reference_variable, *args, _create=create, **kwargs):
            device = device_of.get(id(reference_variable))
            if device is None:
                return _create(reference_variable, *args, **kwargs)
            with tf.device(device):
                return _create(reference_variable, *args, **kwargs)

        target.add_variable_from_reference = placed
        target._keras_dist_placed = True


def _accumulate(total, grads, device):
    if total is None:
        return list(grads)
    with tf.device(device):
        return [t + g for t, g in zip(total, grads)]


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
