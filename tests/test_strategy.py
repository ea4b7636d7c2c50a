"""The strategy factory: which strategy for which cluster/devices, and its errors."""

import json

import pytest

from keras_dist.strategies import communication as _communication

from keras_dist.testing import run_in_subprocess, run_on_workers


# -- run in fresh processes (TF's device layout is fixed once per process) ------------
def _factory_choices():
    import tensorflow as tf

    import keras_dist

    names = keras_dist.virtual_devices(4, "CPU")
    auto = keras_dist.strategy()
    again = keras_dist.strategy()
    two = keras_dist.strategy(devices=names[:2])
    resolved_is_two = keras_dist.resolve_strategy() is two
    one = keras_dist.strategy("one_device", devices=names[:1])
    keras_dist.strategy()
    resolved_is_auto_again = keras_dist.resolve_strategy() is auto
    with two.scope():
        resolved_in_scope = keras_dist.resolve_strategy() is two
    errors = {}
    for label, call in {
        "multi_worker_without_cluster": lambda: keras_dist.strategy("multi_worker"),
        "nccl_on_cpu": lambda: keras_dist.strategy(implementation="nccl"),
        "one_device_with_two": lambda: keras_dist.strategy("one_device", devices=names[:2]),
    }.items():
        try:
            call()
        except ValueError as error:
            errors[label] = str(error)
    late = None
    try:
        keras_dist.virtual_devices(2, "CPU")
    except RuntimeError as error:
        late = str(error)
    return {
        "names": names,
        "auto": type(auto).__name__,
        "auto_replicas": auto.num_replicas_in_sync,
        "same_object": auto is again,
        "resolved": [resolved_is_two, resolved_is_auto_again, resolved_in_scope],
        "two_replicas": two.num_replicas_in_sync,
        "one": type(one).__name__,
        "is_mirrored": isinstance(auto, tf.distribute.MirroredStrategy),
        "errors": errors,
        "late_virtual_devices": late,
        "same_layout_again": keras_dist.virtual_devices(4, "CPU"),
    }


def _no_cluster_choice():
    import tensorflow as tf

    import keras_dist

    chosen = keras_dist.strategy()
    # The line of TensorFlow's multi-worker tutorial, unchanged.
    task_type, task_id = chosen.cluster_resolver.task_type, chosen.cluster_resolver.task_id
    plain = tf.distribute.MultiWorkerMirroredStrategy().cluster_resolver
    hierarchical = tf.distribute.HierarchicalCopyAllReduce()
    with_ops = keras_dist.strategy(cross_device_ops=hierarchical)
    return {
        "name": type(chosen).__name__,
        "is_mirrored": isinstance(chosen, tf.distribute.MirroredStrategy),
        "replicas": chosen.num_replicas_in_sync,
        "workers": keras_dist.num_workers(),
        "resolver": [task_type, task_id, chosen.cluster_resolver.cluster_spec().as_dict()],
        "plain_resolver": [plain.task_type, plain.task_id, plain.cluster_spec().as_dict()],
        "one_device_resolver": keras_dist.strategy("one_device").cluster_resolver.task_type,
        "ring_is_auto": keras_dist.strategy(implementation="ring") is chosen,
        "cross_device_ops": [
            with_ops is not chosen,
            with_ops is keras_dist.strategy(cross_device_ops=hierarchical),
            with_ops is not keras_dist.strategy(
                cross_device_ops=tf.distribute.HierarchicalCopyAllReduce()),
        ],
    }


def _multi_worker_choice():
    import tensorflow as tf

    import keras_dist

    chosen = keras_dist.strategy()
    value = chosen.reduce(
        "SUM",
        chosen.run(lambda: tf.constant(float(keras_dist.worker_index() + 1))),
        axis=None,
    )
    resolver = chosen.cluster_resolver
    try:
        keras_dist.strategy(bytes_per_pack=1024)
        different = None
    except RuntimeError as error:
        different = str(error)
    return {
        "resolver": [resolver.task_type, resolver.task_id],
        "ring_is_auto": keras_dist.strategy(implementation="ring") is chosen,
        "different_request": different,
        "local_devices": keras_dist.local_devices(),
        "type": "MultiWorkerMirroredStrategy"
        if isinstance(chosen, tf.distribute.MultiWorkerMirroredStrategy)
        else type(chosen).__name__,
        "replicas": chosen.num_replicas_in_sync,
        "same_object": chosen is keras_dist.strategy(),
        "all_reduced_sum": float(value),
        "is_chief": keras_dist.is_chief(),
        "worker_index": keras_dist.worker_index(),
        "num_workers": keras_dist.num_workers(),
        "packs": _collectives_for_three_large_tensors(chosen),
    }


def _collectives_for_three_large_tensors(chosen):
    """All-reduces issued for 3 tensors just over the default bucket size (traced only)."""
    import tensorflow as tf

    from keras_dist.strategies import communication as _communication

    elements = _communication.DEFAULT_BYTES_PER_PACK // 4 + 1

    @tf.function
    def reduce_three():
        def replica_fn():
            context = tf.distribute.get_replica_context()
            return context.all_reduce("SUM", [tf.ones([elements]) for _ in range(3)])

        return chosen.run(replica_fn)

    graph = reduce_three.get_concrete_function().graph
    return sum(op.type == "CollectiveReduceV2" for op in graph.get_operations())


@pytest.mark.multiworker
@pytest.mark.slow
def test_no_cluster_gives_one_device_mirrored_with_a_cluster_resolver():
    result = run_in_subprocess(_no_cluster_choice, timeout=120)
    assert result["replicas"] == 1
    assert result["workers"] == 1
    # Like tf.distribute.MirroredStrategy() on a CPU machine, not the default strategy.
    assert result["name"] == "MirroredStrategy" and result["is_mirrored"]
    # Like MultiWorkerMirroredStrategy in one process: task type and id None, no cluster.
    assert result["resolver"] == result["plain_resolver"] == [None, None, {}]
    assert result["one_device_resolver"] is None
    # On a CPU-only machine implementation="auto" is "ring": the same strategy.
    assert result["ring_is_auto"]
    assert result["cross_device_ops"] == [True, True, True]


@pytest.mark.multiworker
def test_four_virtual_devices_give_mirrored_with_four_replicas():
    result = run_in_subprocess(_factory_choices, timeout=120)
    assert result["names"] == [f"/device:CPU:{i}" for i in range(4)]
    assert result["auto"] == "MirroredStrategy" and result["is_mirrored"]
    assert result["auto_replicas"] == 4
    assert result["same_object"], "strategy() twice with the same arguments must reuse it"
    # strategy=None means: the active scope, else the strategy returned last.
    assert result["resolved"] == [True, True, True]
    assert result["two_replicas"] == 2
    assert result["one"] == "OneDeviceStrategy"
    assert "no multi-worker cluster" in result["errors"]["multi_worker_without_cluster"]
    assert "TF_CONFIG" in result["errors"]["multi_worker_without_cluster"]
    assert "NCCL needs GPUs" in result["errors"]["nccl_on_cpu"]
    assert "exactly one device" in result["errors"]["one_device_with_two"]
    assert "must run before TensorFlow initialises" in result["late_virtual_devices"]
    assert result["same_layout_again"] == result["names"]


@pytest.mark.multiworker
@pytest.mark.slow
def test_two_launched_workers_give_multi_worker_strategy():
    results = run_on_workers(_multi_worker_choice, num_workers=2, timeout=180)
    assert [r["type"] for r in results] == ["MultiWorkerMirroredStrategy"] * 2
    assert [r["replicas"] for r in results] == [2, 2]
    assert all(r["same_object"] for r in results)
    # 1 + 2 summed across both workers proves a real cross-process all-reduce.
    assert [r["all_reduced_sum"] for r in results] == [3.0, 3.0]
    assert [r["is_chief"] for r in results] == [True, False]
    assert [r["worker_index"] for r in results] == [0, 1]
    assert [r["num_workers"] for r in results] == [2, 2]
    assert [r["resolver"] for r in results] == [["worker", 0], ["worker", 1]]
    # On CPU workers "auto" is RING: asking for "ring" again is the same strategy ...
    assert all(r["ring_is_auto"] for r in results)
    # The default buckets the all-reduce (one collective per pack, so the first packs
    # can start during the backward pass) instead of TensorFlow's one pack.
    assert [r["packs"] for r in results] == [3, 3]
    # ... but a genuinely different request is refused, naming what differs.
    for r in results:
        assert (f"bytes_per_pack=1024 (the existing one has "
                f"{_communication.DEFAULT_BYTES_PER_PACK})") in r["different_request"]
    # Only this worker's device, although TensorFlow lists the peer's too.
    assert [r["local_devices"] for r in results] == [
        [f"/job:worker/replica:0/task:{i}/device:CPU:0"] for i in (0, 1)]


# -- argument validation (no TF runtime needed beyond import) -------------------------
@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"kind": "tpu"}, "kind"),
        ({"implementation": "mpi"}, "implementation"),
        ({"bytes_per_pack": -1}, "bytes_per_pack"),
        ({"bytes_per_pack": 1.5}, "bytes_per_pack"),
        ({"timeout_seconds": 0}, "timeout_seconds"),
        ({"timeout_seconds": "10"}, "timeout_seconds"),
        ({"devices": "/cpu:0"}, "devices"),
        ({"devices": []}, "devices"),
        ({"devices": ["/cpu:0", "/cpu:0"]}, "devices"),
        ({"cross_device_ops": "nccl"}, "cross_device_ops"),
    ],
)
def test_bad_arguments_name_the_field(kwargs, field):
    import keras_dist

    with pytest.raises(ValueError, match=f"`{field}`"):
        keras_dist.strategy(**kwargs)


def test_mirrored_with_multi_worker_cluster_is_refused(monkeypatch):
    import keras_dist

    monkeypatch.setenv(
        "TF_CONFIG",
        json.dumps({"cluster": {"worker": ["127.0.0.1:1111", "127.0.0.1:1112"]},
                    "task": {"type": "worker", "index": 0}}),
    )
    with pytest.raises(ValueError, match="kind='multi_worker' or 'auto'"):
        keras_dist.strategy("mirrored")
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES"):
        keras_dist.strategy(devices=["/cpu:0"])


def test_cross_device_ops_conflicts_are_refused(monkeypatch):
    import tensorflow as tf

    import keras_dist

    ops = tf.distribute.ReductionToOneDevice()
    with pytest.raises(ValueError, match="`cross_device_ops` and `implementation`.*"
                       "implementation='ring'"):
        keras_dist.strategy(implementation="ring", cross_device_ops=ops)
    with pytest.raises(ValueError, match="only applies to MirroredStrategy.*one_device"):
        keras_dist.strategy("one_device", cross_device_ops=ops)
    monkeypatch.setenv(
        "TF_CONFIG",
        json.dumps({"cluster": {"worker": ["127.0.0.1:1111", "127.0.0.1:1112"]},
                    "task": {"type": "worker", "index": 0}}),
    )
    with pytest.raises(ValueError, match="`cross_device_ops`.*2 workers"):
        keras_dist.strategy(cross_device_ops=ops)


def test_bad_tf_config_surfaces_as_cluster_config_error(monkeypatch):
    import keras_dist

    monkeypatch.setenv("TF_CONFIG", "{not json")
    with pytest.raises(keras_dist.ClusterConfigError, match="TF_CONFIG is not valid JSON"):
        keras_dist.strategy()


def test_resolve_strategy_rejects_non_strategy():
    import keras_dist

    with pytest.raises(TypeError, match="`strategy`"):
        keras_dist.resolve_strategy("mirrored")


def test_virtual_devices_validates_arguments():
    import keras_dist

    with pytest.raises(ValueError, match="`n`"):
        keras_dist.virtual_devices(0)
    with pytest.raises(ValueError, match="`device_type`"):
        keras_dist.virtual_devices(2, "TPU")


@pytest.mark.multiworker
def test_strategy_name_is_the_function_under_every_import_form():
    # `keras_dist.strategy` is the factory function, whichever import a user writes first;
    # there is no module of that name (one name per thing). Fresh interpreters: the import
    # order is the thing under test.
    import subprocess
    import sys

    checks = {
        "import keras_dist": "keras_dist.strategy",
        "import keras_dist.strategies": "keras_dist.strategy",
        "import keras_dist; import keras_dist.strategies": "keras_dist.strategy",
        "from keras_dist import strategy": "strategy",
        "from keras_dist.strategies import strategy": "strategy",
        "import keras_dist.strategies; import keras_dist": "keras_dist.strategy",
    }
    for statement, name in checks.items():
        code = (
            f"{statement}\n"
            "import sys\n"
            "from keras_dist.strategies import resolve_strategy\n"
            "from keras_dist import strategies\n"
            f"assert {name} is strategies.strategy, {name}\n"
            "assert resolve_strategy is strategies.resolve_strategy\n"
            "assert 'keras_dist.strategy' not in sys.modules\n"
            "try:\n"
            "    import keras_dist.strategy\n"
            "    raise AssertionError('keras_dist.strategy imported as a module')\n"
            "except ModuleNotFoundError:\n"
            "    pass\n"
            "assert 'tensorflow' not in sys.modules\n"
        )
        result = subprocess.run([sys.executable, "-c", code], capture_output=True,
                                text=True, timeout=120)
        assert result.returncode == 0, (statement, result.stderr[-2000:])
