"""ShardedDense / ShardedEmbedding equal Dense / Embedding, forward and after training."""

from keras_dist.testing import run_in_subprocess

TOLERANCE = 1e-5


def _sharded_vs_dense():
    import keras
    import numpy as np

    from keras_dist.parallel import ShardedDense, ShardedEmbedding

    devices = ["/device:CPU:0", "/device:CPU:1"]
    x = np.random.RandomState(0).randn(8, 6).astype("float32")
    y = np.random.RandomState(1).randn(8, 5).astype("float32")
    ids = np.random.RandomState(2).randint(0, 11, size=(8, 3))

    def pair(sharded, plain, inputs, targets, input_shape):
        sharded_model = keras.Sequential([keras.Input(input_shape), sharded])
        plain_model = keras.Sequential([keras.Input(input_shape), plain])
        plain.set_weights(sharded.get_weights())  # sharded -> unsharded layout
        forward = float(np.abs(sharded_model.predict(inputs, verbose=0)
                               - plain_model.predict(inputs, verbose=0)).max())
        for model in (sharded_model, plain_model):
            model.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
            model.fit(inputs, targets, batch_size=8, epochs=3, verbose=0, shuffle=False)
        trained = max(float(np.abs(a - b).max()) for a, b in
                      zip(sharded.get_weights(), plain.get_weights()))
        placed = sorted({v.value.device[-5:] for v in sharded.variables})
        # unsharded -> sharded round trip
        sharded.set_weights(plain.get_weights())
        round_trip = max(float(np.abs(a - b).max()) for a, b in
                         zip(sharded.get_weights(), plain.get_weights()))
        return {"forward": forward, "trained": trained, "devices": placed,
                "round_trip": round_trip}

    return {
        "column": pair(ShardedDense(5, devices, mode="column", activation="tanh"),
                       keras.layers.Dense(5, activation="tanh"), x, y, (6,)),
        "row": pair(ShardedDense(5, devices, mode="row", activation="tanh"),
                    keras.layers.Dense(5, activation="tanh"), x, y, (6,)),
        "embedding": pair(ShardedEmbedding(11, 5, devices), keras.layers.Embedding(11, 5),
                          ids, np.ones((8, 3, 5), "float32"), (3,)),
    }


def test_sharded_layers_equal_dense_and_embedding():
    results = run_in_subprocess(_sharded_vs_dense, virtual_devices=2, timeout=120)
    for name, result in results.items():
        print(name, result)
        assert result["devices"] == ["CPU:0", "CPU:1"], name
        assert result["forward"] < TOLERANCE, name
        assert result["trained"] < TOLERANCE, name
        assert result["round_trip"] == 0.0, name
