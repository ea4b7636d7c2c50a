"""keras_dist inside Ray Train's TensorflowTrainer, on a real local Ray cluster.

One Ray cluster per module (127.0.0.1 only, via `keras_dist.integrations.ray.init_local`),
shut down after. Workers write what users see (weights, TF_CONFIG, epochs, listening
sockets) as JSON files; the assertions run here.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

# Ray reads it once, at import: with it, the local cluster's node address is 127.0.0.1.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
ray = pytest.importorskip("ray")

from ray.train import FailureConfig, RunConfig, ScalingConfig  # noqa: E402
from ray.train.tensorflow import TensorflowTrainer  # noqa: E402

pytestmark = pytest.mark.timeout(240)

# Two training workers share the 2 logical CPUs with Ray Train's and Ray Data's actors.
_SCALING = ScalingConfig(num_workers=2, resources_per_worker={"CPU": 0.5})
_LOOPBACK = ("127.0.0.1", "[::ffff:127.0.0.1]", "[::1]")


@pytest.fixture(scope="module")
def ray_cluster():
    from keras_dist.integrations import ray as kd_ray

    # Workers cannot import this test module by name: ship its functions by value.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    kd_ray.init_local(num_cpus=2)
    yield
    ray.shutdown()


def _fit(train_fn, config, tmp_path, datasets=None, failure_config=None):
    trainer = TensorflowTrainer(
        train_fn, train_loop_config=config, scaling_config=_SCALING, datasets=datasets,
        run_config=RunConfig(storage_path=str(tmp_path / "ray_results"), name="run",
                             failure_config=failure_config),
    )
    return trainer.fit()


def _workers(out_dir):
    return [json.loads((out_dir / f"worker{index}.json").read_text()) for index in range(2)]


def _listening(driver_pid):
    """The LISTEN sockets of the Ray cluster's processes (the driver's process tree)."""
    import psutil

    pids = {driver_pid} | {child.pid for child in psutil.Process(driver_pid).children(True)}
    lines = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout
    return [line.split()[3] for line in lines.splitlines()
            if any(f"pid={pid}," in line for pid in pids)]


def _model():
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    return model


def _weights_sum(model):
    return float(sum(np.abs(w).sum() for w in model.get_weights()))


def _fit_arrays(config):
    import keras_dist
    from keras_dist.checkpointing import BackupAndRestore, ModelCheckpoint
    from keras_dist.integrations.ray import ReportCheckpointCallback

    strategy = keras_dist.strategy()
    rng = np.random.default_rng(0)
    x = rng.random((256, 4), dtype=np.float32)
    y = x.sum(axis=1, keepdims=True)
    data = keras_dist.distribute_dataset((x, y), per_replica_batch_size=16)
    with strategy.scope():
        model = _model()
    out = config["out"]
    history = model.fit(data, epochs=3, verbose=0, callbacks=[
        BackupAndRestore(os.path.join(out, "backup")),
        ModelCheckpoint(os.path.join(out, "ckpt", "model.keras")),
        ReportCheckpointCallback(),
    ])
    record = {
        "strategy": type(strategy).__name__,
        "replicas": strategy.num_replicas_in_sync,
        "tf_config": json.loads(os.environ["TF_CONFIG"]),
        "chief": keras_dist.is_chief(),
        "loss": history.history["loss"],
        "weights": _weights_sum(model),
        "listening": _listening(config["driver_pid"]),
    }
    with open(os.path.join(out, f"worker{keras_dist.worker_index()}.json"), "w") as f:
        json.dump(record, f)


@pytest.fixture(scope="module")
def two_worker_run(ray_cluster, tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("fit")
    result = _fit(_fit_arrays, {"out": str(tmp_path), "driver_pid": os.getpid()}, tmp_path)
    return tmp_path, result


def test_two_worker_fit_identical_weights_chief_only_outputs(two_worker_run):
    tmp_path, result = two_worker_run
    assert result.error is None
    workers = _workers(tmp_path)
    assert [w["replicas"] for w in workers] == [2, 2]
    assert workers[0]["weights"] == pytest.approx(workers[1]["weights"], rel=1e-6)
    assert workers[0]["loss"][-1] < workers[0]["loss"][0]
    assert [w["chief"] for w in workers] == [True, False]
    # Chief-only files: one checkpoint, no worker temp copies left next to it.
    assert os.listdir(tmp_path / "ckpt") == ["model.keras"]
    # The Ray checkpoint the chief reported holds the final weights.
    from keras_dist.integrations.ray import restore_weights

    model = restore_weights(_model(), result.checkpoint)
    assert _weights_sum(model) == pytest.approx(workers[0]["weights"], rel=1e-6)
    assert result.metrics["epoch"] == 2


def _tensorflow_ports(worker):
    return {address.rsplit(":", 1)[1] for address in worker["tf_config"]["cluster"]["worker"]}


def test_ray_processes_listen_and_talk_on_loopback_only(two_worker_run):
    tmp_path, _ = two_worker_run
    for worker in _workers(tmp_path):
        # TensorFlow's collectives talk to the addresses in Ray's TF_CONFIG.
        assert all(address.startswith("127.0.0.1:")
                   for address in worker["tf_config"]["cluster"]["worker"]), worker
        # Measured during training: every socket of Ray's processes (GCS, raylet, actors).
        ray_sockets = [a for a in worker["listening"]
                       if a.rsplit(":", 1)[1] not in _tensorflow_ports(worker)]
        assert ray_sockets, "no listening socket found for the Ray cluster"
        outside = [a for a in ray_sockets if not a.startswith(_LOOPBACK)]
        assert not outside, f"Ray listening beyond loopback: {outside}"
    outside = [a for a in _listening(os.getpid()) if not a.startswith(_LOOPBACK)]
    assert not outside, f"listening beyond loopback: {outside}"


@pytest.mark.xfail(strict=True, reason=(
    "TensorFlow's gRPC server (tf.distribute.Server, started by MultiWorkerMirrored"
    "Strategy) listens on all interfaces ('*:port') whatever host TF_CONFIG names; "
    "measured with ss on TF 2.21 (the same server keras-dist launch starts). Not Ray's."))
def test_tensorflow_grpc_server_listens_on_loopback_only(two_worker_run):
    tmp_path, _ = two_worker_run
    for worker in _workers(tmp_path):
        tf_sockets = [a for a in worker["listening"]
                      if a.rsplit(":", 1)[1] in _tensorflow_ports(worker)]
        assert tf_sockets
        assert all(a.startswith(_LOOPBACK) for a in tf_sockets), tf_sockets


def _fit_ray_data(config):
    import tensorflow as tf

    import keras_dist

    strategy = keras_dist.strategy()
    shard = ray.train.get_dataset_shard("train")
    data = keras_dist.distribute_dataset(shard, per_replica_batch_size=8, shuffle=False,
                                         feature_columns="x", label_columns="y")
    seen = 0
    for x_batch, _ in data:
        seen += sum(int(tf.shape(t)[0]) for t in strategy.experimental_local_results(x_batch))
    with strategy.scope():
        model = _model()
    model.fit(data, epochs=2, verbose=0)
    with open(os.path.join(config["out"], f"worker{keras_dist.worker_index()}.json"), "w") as f:
        json.dump({"seen": seen, "weights": _weights_sum(model)}, f)


def test_ray_data_shard_input(ray_cluster, tmp_path):
    rng = np.random.default_rng(1)
    x = rng.random((96, 4), dtype=np.float32)
    dataset = ray.data.from_items([{"x": row, "y": np.float32(row.sum())} for row in x])
    result = _fit(_fit_ray_data, {"out": str(tmp_path)}, tmp_path,
                  datasets={"train": dataset})
    assert result.error is None
    workers = _workers(tmp_path)
    # Ray split the rows; keras_dist did not shard again (that would keep 24 of 96).
    assert sum(w["seen"] for w in workers) == 96
    assert workers[0]["weights"] == pytest.approx(workers[1]["weights"], rel=1e-6)


def test_ray_data_columns_list_gives_dict_and_missing_column_is_clear(ray_cluster):
    import keras_dist

    dataset = ray.data.from_items([{"a": np.float32(i), "b": np.float32(-i),
                                    "y": np.float32(2 * i)} for i in range(12)])
    data = keras_dist.distribute_dataset(dataset, per_replica_batch_size=4, shuffle=False,
                                         feature_columns=["a", "b"], label_columns="y")
    features, labels = next(iter(data))
    assert sorted(features) == ["a", "b"]
    np.testing.assert_allclose(labels.numpy(), 2 * features["a"].numpy())
    with pytest.raises(ValueError, match=r"does not have.*columns \['a', 'b', 'y'\]"):
        keras_dist.distribute_dataset(dataset, 4, feature_columns="x", label_columns="y")
    with pytest.raises(TypeError, match="Ray Data"):
        keras_dist.distribute_dataset((np.zeros((4, 1)),), 2, feature_columns="x")


def _fit_kill_and_resume(config):
    import keras

    import keras_dist
    from keras_dist.checkpointing import BackupAndRestore

    out = config["out"]
    marker = os.path.join(out, "killed")
    first_attempt = not os.path.exists(marker)

    class KillOnce(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            with open(os.path.join(out, "epochs.log"), "a") as f:
                f.write(f"{int(first_attempt)} {keras_dist.worker_index()} {epoch}\n")
            if first_attempt and epoch == 2:
                keras_dist.barrier("before_kill")  # the epoch-1 backup is complete
                if keras_dist.worker_index() == 1:
                    open(marker, "w").close()
                    os.kill(os.getpid(), 9)

    strategy = keras_dist.strategy()
    rng = np.random.default_rng(0)
    x = rng.random((128, 4), dtype=np.float32)
    data = keras_dist.distribute_dataset((x, x.sum(axis=1, keepdims=True)), 16)
    with strategy.scope():
        model = _model()
    model.fit(data, epochs=4, verbose=0,
              callbacks=[BackupAndRestore(os.path.join(out, "backup")), KillOnce()])
    with open(os.path.join(out, f"worker{keras_dist.worker_index()}.json"), "w") as f:
        json.dump({"weights": _weights_sum(model)}, f)


def test_worker_killed_ray_restarts_group_and_resumes_from_backup(ray_cluster, tmp_path):
    result = _fit(_fit_kill_and_resume, {"out": str(tmp_path)}, tmp_path,
                  failure_config=FailureConfig(max_failures=1))
    assert result.error is None
    assert (tmp_path / "killed").exists()
    lines = [tuple(map(int, line.split()))
             for line in (tmp_path / "epochs.log").read_text().splitlines()]
    restarted = sorted({epoch for first, _, epoch in lines if not first})
    # The restarted group starts at epoch 2 (the backup after epoch 1), not 0.
    assert restarted == [2, 3], lines
    workers = _workers(tmp_path)
    assert workers[0]["weights"] == pytest.approx(workers[1]["weights"], rel=1e-6)


def _ray_docs_example(config):
    # The example in Ray 2.60's TensorflowTrainer docstring
    # (ray/train/v2/tensorflow/tensorflow_trainer.py), verbatim but for three lines:
    # the strategy; Keras 3's `.weights.h5` suffix (Keras 3 refuses "my_checkpoint": the
    # tf.keras of Ray's worker is Keras 3, recorded below); and, until keras_dist's
    # stock-writer protocol pairs per-worker mkdtemp() paths, KERAS_DIST_STOCK_WRITERS=0
    # (each worker saves into its own directory, as Ray's pattern intends; with the
    # protocol on, worker 1 waits for the chief to save worker 1's path).
    os.environ["KERAS_DIST_STOCK_WRITERS"] = "0"
    import tempfile

    import tensorflow as tf
    from ray import train
    from ray.train import Checkpoint

    import keras_dist

    def build_model():
        # toy neural network : 1-layer
        return tf.keras.Sequential(
            [tf.keras.layers.Dense(
                1, activation="linear", input_shape=(1,))]
        )

    def train_loop_per_worker(config):
        dataset_shard = train.get_dataset_shard("train")
        strategy = keras_dist.strategy()  # was: tf.distribute.experimental.MultiWorker...
        with strategy.scope():
            model = build_model()
            model.compile(
                optimizer="Adam", loss="mean_squared_error", metrics=["mse"])

        tf_dataset = dataset_shard.to_tf(
            feature_columns="x",
            label_columns="y",
            batch_size=1,
        )
        for epoch in range(config["num_epochs"]):
            model.fit(tf_dataset)

            # Create checkpoint.
            checkpoint_dir = tempfile.mkdtemp()
            model.save_weights(
                os.path.join(checkpoint_dir, "my_checkpoint.weights.h5")  # was "my_checkpoint"
            )
            checkpoint = Checkpoint.from_directory(checkpoint_dir)

            train.report(
                {},
                checkpoint=checkpoint,
            )

    with open(os.path.join(config["out"], f"keras{keras_dist.worker_index()}.txt"), "w") as f:
        f.write(f"{tf.keras.Sequential.__module__} TF_USE_LEGACY_KERAS="
                f"{os.environ.get('TF_USE_LEGACY_KERAS')}")
    train_loop_per_worker(config)


def test_ray_documented_tensorflow_trainer_example(ray_cluster, tmp_path):
    train_dataset = ray.data.from_items([{"x": x, "y": x + 1} for x in range(32)])
    result = _fit(_ray_docs_example, {"num_epochs": 2, "out": str(tmp_path)}, tmp_path,
                  datasets={"train": train_dataset})
    print((tmp_path / "keras0.txt").read_text())
    assert result.error is None
    assert result.checkpoint is not None
