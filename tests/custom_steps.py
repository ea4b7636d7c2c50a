"""A corpus of models with their own `train_step`, written the way the keras-io guides write them.

Shared by tests/test_custom_steps.py and the processes it starts (one device, 2 virtual
devices, 2 launched workers): each function trains one model under whatever strategy is
given (None: plain Keras, no strategy at all) and returns plain data to compare.

* `gan`: the GAN at the end of "Customizing what happens in fit() with TensorFlow" (no
  `call()`, a `d_optimizer` and a `g_optimizer`, a `Loss` object, random draws).
* `gan_fixed_noise`: the same GAN fed its latent vectors with the data (deterministic).
* `vae`: the keras-io VAE example (encoder/decoder, a sampling layer, loss *functions*,
  three trackers, no `call()`).
* `own_test_step`: the guide's model with `compute_loss` in `train_step` and its own
  `test_step` (a functional model subclass: it has `call()`).
* `two_heads`: a subclassed model with two outputs whose step adds a `Loss` object, a
  loss function, `add_loss` from a subclassed layer, and tracks each in its own `Mean`.
* `tf_idiom`: a step in TensorFlow's style: `tf.nn.compute_average_loss` and
  `tf.nn.scale_regularization_loss`.
"""

from __future__ import annotations

import numpy as np

FEATURES = 16
LATENT = 8
SAMPLES = 128
GLOBAL_BATCH = 32
EPOCHS = 3
LEARNING_RATE = 0.05
DETERMINISTIC = ("gan_fixed_noise", "own_test_step", "two_heads", "tf_idiom")
RANDOM = ("gan", "vae")
ALL = RANDOM + DETERMINISTIC


def _data():
    rng = np.random.default_rng(0)
    x = rng.random((SAMPLES, FEATURES)).astype("float32")
    z = rng.normal(size=(SAMPLES, LATENT)).astype("float32")
    y = (x[:, :4].sum(axis=1, keepdims=True) - 2.0).astype("float32")
    labels = (x[:, 4:7].argmax(axis=1)).astype("int32")
    return x, z, y, labels


# -- the models ----------------------------------------------------------------------------
def _gan_classes():
    import keras
    import tensorflow as tf

    class GAN(keras.Model):
        def __init__(self, discriminator, generator, latent_dim):
            super().__init__()
            self.discriminator = discriminator
            self.generator = generator
            self.latent_dim = latent_dim
            self.d_loss_tracker = keras.metrics.Mean(name="d_loss")
            self.g_loss_tracker = keras.metrics.Mean(name="g_loss")
            self.seed_generator = keras.random.SeedGenerator(1337)

        @property
        def metrics(self):
            return [self.d_loss_tracker, self.g_loss_tracker]

        def compile(self, d_optimizer, g_optimizer, loss_fn):
            super().compile()
            self.d_optimizer = d_optimizer
            self.g_optimizer = g_optimizer
            self.loss_fn = loss_fn

        def train_step(self, real_images):
            if isinstance(real_images, tuple):
                real_images = real_images[0]
            batch_size = tf.shape(real_images)[0]
            random_latent_vectors = keras.random.normal(
                shape=(batch_size, self.latent_dim), seed=self.seed_generator)
            generated_images = self.generator(random_latent_vectors)
            combined_images = tf.concat([generated_images, real_images], axis=0)
            labels = tf.concat([tf.ones((batch_size, 1)), tf.zeros((batch_size, 1))], axis=0)
            labels += 0.05 * keras.random.uniform(tf.shape(labels), seed=self.seed_generator)
            with tf.GradientTape() as tape:
                predictions = self.discriminator(combined_images)
                d_loss = self.loss_fn(labels, predictions)
            grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
            self.d_optimizer.apply_gradients(zip(grads, self.discriminator.trainable_weights))
            random_latent_vectors = keras.random.normal(
                shape=(batch_size, self.latent_dim), seed=self.seed_generator)
            misleading_labels = tf.zeros((batch_size, 1))
            with tf.GradientTape() as tape:
                predictions = self.discriminator(self.generator(random_latent_vectors))
                g_loss = self.loss_fn(misleading_labels, predictions)
            grads = tape.gradient(g_loss, self.generator.trainable_weights)
            self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights))
            self.d_loss_tracker.update_state(d_loss)
            self.g_loss_tracker.update_state(g_loss)
            return {"d_loss": self.d_loss_tracker.result(),
                    "g_loss": self.g_loss_tracker.result()}

    class FixedNoiseGAN(GAN):
        """The latent vectors come with the data: a step without random draws."""

        def train_step(self, data):
            # Written for mixed precision too: images in the generator's dtype, and
            # each loss scaled by its optimizer (a no-op without a LossScaleOptimizer).
            real_images, random_latent_vectors = data
            batch_size = tf.shape(real_images)[0]
            generated_images = self.generator(random_latent_vectors)
            real_images = tf.cast(real_images, generated_images.dtype)
            combined_images = tf.concat([generated_images, real_images], axis=0)
            labels = tf.concat([tf.ones((batch_size, 1)), tf.zeros((batch_size, 1))], axis=0)
            with tf.GradientTape() as tape:
                predictions = self.discriminator(combined_images)
                d_loss = self.loss_fn(labels, predictions)
                scaled = self.d_optimizer.scale_loss(d_loss)
            grads = tape.gradient(scaled, self.discriminator.trainable_weights)
            self.d_optimizer.apply_gradients(zip(grads, self.discriminator.trainable_weights))
            with tf.GradientTape() as tape:
                predictions = self.discriminator(self.generator(random_latent_vectors))
                g_loss = self.loss_fn(tf.zeros((batch_size, 1)), predictions)
                scaled = self.g_optimizer.scale_loss(g_loss)
            grads = tape.gradient(scaled, self.generator.trainable_weights)
            self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights))
            self.d_loss_tracker.update_state(d_loss)
            self.g_loss_tracker.update_state(g_loss)
            return {m.name: m.result() for m in self.metrics}

    return GAN, FixedNoiseGAN


def _gan_parts():
    import keras
    from keras import layers

    discriminator = keras.Sequential([
        keras.Input(shape=(FEATURES,)), layers.Dense(32), layers.LeakyReLU(negative_slope=0.2),
        layers.Dense(1)], name="discriminator")
    generator = keras.Sequential([
        keras.Input(shape=(LATENT,)), layers.Dense(32), layers.LeakyReLU(negative_slope=0.2),
        layers.Dense(FEATURES, activation="sigmoid")], name="generator")
    return discriminator, generator


def _vae_class():
    import keras
    import tensorflow as tf
    from keras import layers, ops

    class Sampling(layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.seed_generator = keras.random.SeedGenerator(1337)

        def call(self, inputs):
            z_mean, z_log_var = inputs
            batch, dim = ops.shape(z_mean)[0], ops.shape(z_mean)[1]
            epsilon = keras.random.normal(shape=(batch, dim), seed=self.seed_generator)
            return z_mean + ops.exp(0.5 * z_log_var) * epsilon

    class VAE(keras.Model):
        def __init__(self, encoder, decoder, **kwargs):
            super().__init__(**kwargs)
            self.encoder = encoder
            self.decoder = decoder
            self.total_loss_tracker = keras.metrics.Mean(name="total_loss")
            self.reconstruction_loss_tracker = keras.metrics.Mean(name="reconstruction_loss")
            self.kl_loss_tracker = keras.metrics.Mean(name="kl_loss")

        @property
        def metrics(self):
            return [self.total_loss_tracker, self.reconstruction_loss_tracker,
                    self.kl_loss_tracker]

        def train_step(self, data):
            with tf.GradientTape() as tape:
                z_mean, z_log_var, z = self.encoder(data)
                reconstruction = self.decoder(z)
                reconstruction_loss = ops.mean(ops.sum(
                    keras.losses.binary_crossentropy(data[..., None], reconstruction[..., None]),
                    axis=1))
                kl_loss = -0.5 * (1 + z_log_var - ops.square(z_mean) - ops.exp(z_log_var))
                kl_loss = ops.mean(ops.sum(kl_loss, axis=1))
                total_loss = reconstruction_loss + kl_loss
            grads = tape.gradient(total_loss, self.trainable_weights)
            self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
            self.total_loss_tracker.update_state(total_loss)
            self.reconstruction_loss_tracker.update_state(reconstruction_loss)
            self.kl_loss_tracker.update_state(kl_loss)
            return {"loss": self.total_loss_tracker.result(),
                    "reconstruction_loss": self.reconstruction_loss_tracker.result(),
                    "kl_loss": self.kl_loss_tracker.result()}

    inputs = keras.Input(shape=(FEATURES,))
    hidden = layers.Dense(32, activation="relu")(inputs)
    z_mean = layers.Dense(2, name="z_mean")(hidden)
    z_log_var = layers.Dense(2, name="z_log_var")(hidden)
    encoder = keras.Model(inputs, [z_mean, z_log_var, Sampling()([z_mean, z_log_var])],
                          name="encoder")
    latent = keras.Input(shape=(2,))
    decoder = keras.Model(latent, layers.Dense(FEATURES, activation="sigmoid")(
        layers.Dense(32, activation="relu")(latent)), name="decoder")
    return VAE(encoder, decoder)


def _own_test_step_model():
    import keras
    import tensorflow as tf

    class CustomModel(keras.Model):
        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                y_pred = self(x, training=True)
                loss = self.compute_loss(y=y, y_pred=y_pred)
            gradients = tape.gradient(loss, self.trainable_variables)
            self.optimizer.apply(gradients, self.trainable_variables)
            for metric in self.metrics:
                if metric.name == "loss":
                    metric.update_state(loss)
                else:
                    metric.update_state(y, y_pred)
            return {m.name: m.result() for m in self.metrics}

        def test_step(self, data):
            x, y = data
            y_pred = self(x, training=False)
            loss = self.compute_loss(y=y, y_pred=y_pred)
            for metric in self.metrics:
                if metric.name == "loss":
                    metric.update_state(loss)
                else:
                    metric.update_state(y, y_pred)
            return {m.name: m.result() for m in self.metrics}

    inputs = keras.Input(shape=(FEATURES,))
    hidden = keras.layers.Dense(16, activation="relu")(inputs)
    return CustomModel(inputs, keras.layers.Dense(1)(hidden))


def _two_heads_model():
    import keras
    import tensorflow as tf
    from keras import ops

    class ActivityPenalty(keras.layers.Layer):
        def call(self, inputs):
            self.add_loss(1e-2 * ops.mean(ops.square(inputs)))
            return inputs

    class TwoHeads(keras.Model):
        def __init__(self):
            super().__init__()
            self.body = keras.layers.Dense(16, activation="relu")
            self.penalty = ActivityPenalty()
            self.head_a = keras.layers.Dense(1)
            self.head_b = keras.layers.Dense(3)
            self.loss_fn = keras.losses.MeanSquaredError()
            self.loss_tracker = keras.metrics.Mean(name="loss")
            self.a_tracker = keras.metrics.Mean(name="a_loss")
            self.b_tracker = keras.metrics.Mean(name="b_loss")
            self.penalty_tracker = keras.metrics.Mean(name="penalty")
            self.mae_metric = keras.metrics.MeanAbsoluteError(name="mae")

        def call(self, x, training=False):
            hidden = self.penalty(self.body(x))
            return self.head_a(hidden), self.head_b(hidden)

        @property
        def metrics(self):
            return [self.loss_tracker, self.a_tracker, self.b_tracker, self.penalty_tracker,
                    self.mae_metric]

        def _head_losses(self, x, targets, training):
            y_a, y_b = targets
            pred_a, pred_b = self(x, training=training)
            a_loss = self.loss_fn(y_a, pred_a)
            b_loss = ops.mean(keras.losses.sparse_categorical_crossentropy(
                y_b, pred_b, from_logits=True))
            penalty = ops.sum(self.losses)
            return a_loss, b_loss, penalty, pred_a

        def _track(self, a_loss, b_loss, penalty, y_a, pred_a):
            self.loss_tracker.update_state(a_loss + b_loss + penalty)
            self.a_tracker.update_state(a_loss)
            self.b_tracker.update_state(b_loss)
            self.penalty_tracker.update_state(penalty)
            self.mae_metric.update_state(y_a, pred_a)
            return {m.name: m.result() for m in self.metrics}

        def train_step(self, data):
            x, targets = data
            with tf.GradientTape() as tape:
                a_loss, b_loss, penalty, pred_a = self._head_losses(x, targets, True)
                loss = a_loss + b_loss + penalty
            grads = tape.gradient(loss, self.trainable_weights)
            self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
            return self._track(a_loss, b_loss, penalty, targets[0], pred_a)

        def test_step(self, data):
            x, targets = data
            a_loss, b_loss, penalty, pred_a = self._head_losses(x, targets, False)
            return self._track(a_loss, b_loss, penalty, targets[0], pred_a)

    return TwoHeads()


def _tf_idiom_model():
    import keras
    import tensorflow as tf

    class TFStyle(keras.Model):
        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                y_pred = self(x, training=True)
                per_example = tf.reduce_mean(tf.square(y - y_pred), axis=-1)
                loss = tf.nn.compute_average_loss(per_example)
                loss += tf.nn.scale_regularization_loss(tf.add_n(self.losses))
            grads = tape.gradient(loss, self.trainable_variables)
            self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
            self.loss_tracker.update_state(loss)
            return {"loss": self.loss_tracker.result()}

    inputs = keras.Input(shape=(FEATURES,))
    hidden = keras.layers.Dense(
        16, activation="relu", kernel_regularizer=keras.regularizers.L2(1e-3))(inputs)
    model = TFStyle(inputs, keras.layers.Dense(1)(hidden))
    model.loss_tracker = keras.metrics.Mean(name="loss")
    return model


# -- building, training, reading back ------------------------------------------------------
def _optimizer(kind: str, **options):
    import keras

    if kind == "adam":
        return keras.optimizers.Adam(LEARNING_RATE / 10, **options)
    if kind == "sgd_loss_scale":  # mixed precision in a custom step: wrapped by hand
        return keras.optimizers.LossScaleOptimizer(
            keras.optimizers.SGD(LEARNING_RATE, **options))
    return keras.optimizers.SGD(LEARNING_RATE, **options)


def build(name: str, optimizer: str = "sgd", **options):
    """The model `name`, compiled as its guide compiles it."""
    import keras

    keras.utils.set_random_seed(7)
    if name in ("gan", "gan_fixed_noise"):
        gan_class, fixed_class = _gan_classes()
        discriminator, generator = _gan_parts()
        model = (gan_class if name == "gan" else fixed_class)(discriminator, generator, LATENT)
        model.compile(d_optimizer=_optimizer(optimizer, **options),
                      g_optimizer=_optimizer(optimizer, **options),
                      loss_fn=keras.losses.BinaryCrossentropy(from_logits=True))
    elif name == "vae":
        model = _vae_class()
        model.compile(optimizer=_optimizer(optimizer, **options))
    elif name == "own_test_step":
        model = _own_test_step_model()
        model.compile(optimizer=_optimizer(optimizer, **options), loss="mse",
                      metrics=["mae"])
    elif name == "two_heads":
        model = _two_heads_model()
        model.compile(optimizer=_optimizer(optimizer, **options))
    elif name == "tf_idiom":
        model = _tf_idiom_model()
        model.compile(optimizer=_optimizer(optimizer, **options))
    else:
        raise ValueError(f"unknown corpus model {name!r}; expected one of {ALL}")
    return model


def dataset(name: str, batch: int = GLOBAL_BATCH):
    """The model's training data as a tf.data pipeline of global batches."""
    import tensorflow as tf

    x, z, y, labels = _data()
    elements = {"gan": x, "vae": x, "gan_fixed_noise": (x, z), "own_test_step": (x, y),
                "tf_idiom": (x, y), "two_heads": (x, (y, labels))}[name]
    return tf.data.Dataset.from_tensor_slices(elements).batch(batch)


def weights_of(model) -> list:
    return [np.asarray(w) for w in model.get_weights()]


def train(name: str, strategy=None, *, optimizer: str = "sgd", epochs: int = EPOCHS,
          callbacks=(), evaluate: bool = True, **options) -> dict:
    """Trains corpus model `name` under `strategy` (None: no strategy) -> plain data."""
    import contextlib

    import keras

    scope = strategy.scope() if strategy is not None else contextlib.nullcontext()
    if optimizer == "sgd_loss_scale":
        keras.config.set_dtype_policy("mixed_float16")
    try:
        with scope:
            model = build(name, optimizer, **options)
    finally:
        keras.config.set_dtype_policy("float32")
    keras.utils.set_random_seed(7)
    history = model.fit(dataset(name), epochs=epochs, verbose=0, shuffle=False,
                        callbacks=list(callbacks))
    out = {"weights": weights_of(model),
           "history": {key: [float(v) for v in values]
                       for key, values in history.history.items()}}
    if evaluate and name in ("own_test_step", "two_heads"):
        out["evaluate"] = {key: float(value) for key, value in model.evaluate(
            dataset(name), verbose=0, return_dict=True).items()}
        x = _data()[0][:GLOBAL_BATCH]
        predictions = model.predict(x, batch_size=GLOBAL_BATCH, verbose=0)
        out["predict"] = [np.asarray(p) for p in keras.tree.flatten(predictions)]
    out["model"] = model
    return out
