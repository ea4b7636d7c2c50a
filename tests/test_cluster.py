"""ClusterConfig: TF_CONFIG parsing, validation messages, derived facts.

These tests build configs with `ClusterConfig` methods and explicit `environ` dicts; they
never touch `os.environ` or import TensorFlow.
"""

from __future__ import annotations

import json
import os

import pytest

from keras_dist.cluster import ClusterConfig, ClusterConfigError, make_tf_config

TWO_WORKERS = ["127.0.0.1:2222", "127.0.0.1:2223"]


def tf_config(cluster=None, task=None, **extra) -> str:
    value = {"cluster": {"worker": TWO_WORKERS} if cluster is None else cluster}
    value["task"] = {"type": "worker", "index": 0} if task is None else task
    value.update(extra)
    return json.dumps(value)


# Each case: the TF_CONFIG text, then fragments the message must contain (the field and
# the value received).
INVALID_TF_CONFIGS = {
    "invalid JSON": ('{"cluster": ', ["TF_CONFIG", "not valid JSON", '{"cluster": ']),
    "top level not a mapping": ('["a:1"]', ["TF_CONFIG must be a JSON object", "a:1"]),
    "unknown top-level key": (tf_config(clustr={}), ["unknown key", "clustr"]),
    "cluster not a mapping": (
        json.dumps({"cluster": ["a:1"], "task": {"type": "worker", "index": 0}}),
        ["TF_CONFIG['cluster']", "must be a mapping", "['a:1']"],
    ),
    "missing cluster": (
        json.dumps({"task": {"type": "worker", "index": 0}}),
        ["TF_CONFIG", "no 'cluster' field"],
    ),
    "empty cluster": (tf_config(cluster={}), ["TF_CONFIG['cluster']", "no workers"]),
    "empty worker list": (
        tf_config(cluster={"worker": []}),
        ["TF_CONFIG['cluster']", "no workers", "'worker': []"],
    ),
    "worker list not a list": (
        tf_config(cluster={"worker": "a:1,b:2"}),
        ["TF_CONFIG['cluster']['worker']", "must be a list", "a:1,b:2"],
    ),
    "missing task": (
        json.dumps({"cluster": {"worker": TWO_WORKERS}}),
        ["TF_CONFIG", "no 'task' field"],
    ),
    "task not a mapping": (tf_config(task="worker"), ["TF_CONFIG['task']", "'worker'"]),
    "unknown task type in cluster": (
        tf_config(cluster={"worker": TWO_WORKERS, "master": ["m:1"]}),
        ["TF_CONFIG['cluster']", "unknown task type", "'master'"],
    ),
    "unknown task type in task": (
        tf_config(task={"type": "master", "index": 0}),
        ["TF_CONFIG['task']['type']", "'master'", "['worker']"],
    ),
    "task type missing": (
        tf_config(task={"index": 0}),
        ["TF_CONFIG['task']['type']", "must be a string", "None"],
    ),
    "task type not a string": (
        tf_config(task={"type": ["worker"], "index": 0}),
        ["TF_CONFIG['task']['type']", "['worker']"],
    ),
    "task type absent from cluster": (
        tf_config(cluster={"chief": [], "worker": TWO_WORKERS}, task={"type": "chief"}),
        ["TF_CONFIG['task']['type']", "'chief'", "['worker']"],
    ),
    "index negative": (
        tf_config(task={"type": "worker", "index": -1}),
        ["TF_CONFIG['task']['index']", "-1", "0..1"],
    ),
    "index out of range": (
        tf_config(task={"type": "worker", "index": 2}),
        ["TF_CONFIG['task']['index']", "is 2", "0..1"],
    ),
    "index a string": (
        tf_config(task={"type": "worker", "index": "1"}),
        ["TF_CONFIG['task']['index']", "must be an integer", "'1'"],
    ),
    "index a float": (
        tf_config(task={"type": "worker", "index": 1.0}),
        ["TF_CONFIG['task']['index']", "1.0"],
    ),
    "index a bool": (
        tf_config(task={"type": "worker", "index": True}),
        ["TF_CONFIG['task']['index']", "True"],
    ),
    "index null": (
        tf_config(task={"type": "worker", "index": None}),
        ["TF_CONFIG['task']['index']", "None"],
    ),
    "index missing with several workers": (
        tf_config(task={"type": "worker"}),
        ["TF_CONFIG['task']", "no 'index'", "2 'worker'"],
    ),
    "address without port": (
        tf_config(cluster={"worker": ["127.0.0.1"]}),
        ["TF_CONFIG['cluster']['worker'][0]", "'host:port'", "'127.0.0.1'"],
    ),
    "address not a string": (
        tf_config(cluster={"worker": [2222]}),
        ["TF_CONFIG['cluster']['worker'][0]", "2222"],
    ),
    "address with empty host": (
        tf_config(cluster={"worker": [":2222"]}),
        ["TF_CONFIG['cluster']['worker'][0]", "host", "':2222'"],
    ),
    "address with scheme": (
        tf_config(cluster={"worker": ["grpc://h:2222"]}),
        ["TF_CONFIG['cluster']['worker'][0]", "'grpc://h:2222'"],
    ),
    "address with space": (
        tf_config(cluster={"worker": ["my host:2222"]}),
        ["TF_CONFIG['cluster']['worker'][0]", "'my host:2222'"],
    ),
    "unbracketed IPv6": (
        tf_config(cluster={"worker": ["::1:2222"]}),
        ["TF_CONFIG['cluster']['worker'][0]", "bracketed IPv6", "'::1:2222'"],
    ),
    "port 0": (
        tf_config(cluster={"worker": ["h:0"]}),
        ["TF_CONFIG['cluster']['worker'][0]", "port '0'", "1..65535"],
    ),
    "port 65536": (
        tf_config(cluster={"worker": ["h:65536"]}),
        ["TF_CONFIG['cluster']['worker'][0]", "port '65536'", "1..65535"],
    ),
    "port not numeric": (
        tf_config(cluster={"worker": ["h:http"]}),
        ["TF_CONFIG['cluster']['worker'][0]", "port 'http'"],
    ),
    "port empty": (
        tf_config(cluster={"worker": ["h:"]}),
        ["TF_CONFIG['cluster']['worker'][0]", "port ''"],
    ),
    "port with non-ASCII digit": (
        tf_config(cluster={"worker": ["h:\u00b2"]}),
        ["TF_CONFIG['cluster']['worker'][0]", "port"],
    ),
    "duplicate address": (
        tf_config(cluster={"worker": ["h:1", "h:1"]}),
        ["TF_CONFIG['cluster']['worker'][1]", "repeats address 'h:1'", "['worker'][0]"],
    ),
    "duplicate address across task types": (
        tf_config(cluster={"chief": ["h:1"], "worker": ["h:2", "H:01"]}),
        ["TF_CONFIG['cluster']['worker'][1]", "'H:01'", "['chief'][0]"],
    ),
    "more than one chief": (
        tf_config(cluster={"chief": ["c:1", "c:2"], "worker": ["w:1"]}),
        ["TF_CONFIG['cluster']['chief']", "2 addresses", "at most one chief"],
    ),
    "ps in cluster": (
        tf_config(cluster={"worker": TWO_WORKERS, "ps": ["p:1"]}),
        ["TF_CONFIG['cluster']", "'ps'", "ParameterServerStrategy"],
    ),
    "evaluator in cluster": (
        tf_config(cluster={"worker": TWO_WORKERS, "evaluator": ["e:1"]}),
        ["TF_CONFIG['cluster']", "'evaluator'", "SidecarEvaluator"],
    ),
    "ps as task type": (
        tf_config(task={"type": "ps", "index": 0}),
        ["TF_CONFIG['task']['type']", "'ps'", "ParameterServerStrategy"],
    ),
    "rpc_layer not a string": (tf_config(rpc_layer=5), ["TF_CONFIG['rpc_layer']", "5"]),
    "rpc_layer empty": (tf_config(rpc_layer=""), ["TF_CONFIG['rpc_layer']", "''"]),
    "rpc_layer with scheme suffix": (
        tf_config(rpc_layer="grpc://"),
        ["TF_CONFIG['rpc_layer']", "'grpc://'"],
    ),
}


@pytest.mark.parametrize(
    "raw, fragments", INVALID_TF_CONFIGS.values(), ids=list(INVALID_TF_CONFIGS)
)
def test_invalid_tf_config_names_field_and_value(raw, fragments):
    with pytest.raises(ClusterConfigError) as caught:
        ClusterConfig.from_env(environ={"TF_CONFIG": raw})
    assert isinstance(caught.value, ValueError)
    message = str(caught.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


def test_error_is_a_value_error():
    with pytest.raises(ValueError, match="TF_CONFIG"):
        ClusterConfig.from_tf_config("not json")


def test_long_invalid_json_is_shortened_in_the_message():
    with pytest.raises(ClusterConfigError) as caught:
        ClusterConfig.from_tf_config("{" + "x" * 1000)
    assert len(str(caught.value)) < 500


@pytest.mark.parametrize("environ", [{}, {"TF_CONFIG": ""}, {"TF_CONFIG": "  \n"}])
def test_no_tf_config_is_one_chief_worker(environ):
    config = ClusterConfig.from_env(environ=environ)
    assert config.num_workers == 1
    assert not config.is_multi_worker
    assert config.worker_index == 0
    assert config.is_chief
    assert config.addresses == ()
    assert config.source == "none"


def test_empty_tf_config_object_is_one_process_like_tensorflow():
    # TFConfigClusterResolver reads TF_CONFIG='{}' as "no cluster".
    config = ClusterConfig.from_env(environ={"TF_CONFIG": "{}"})
    assert (config.num_workers, config.is_chief, config.source) == (1, True, "TF_CONFIG")


@pytest.mark.parametrize("index", [0, 1, 2])
def test_worker_only_cluster(index):
    addresses = ["host-a:2222", "host-b:2222", "10.0.0.3:2222"]
    config = ClusterConfig.from_tf_config(make_tf_config(addresses, index))
    assert config.num_workers == 3
    assert config.is_multi_worker
    assert config.worker_index == index
    assert config.is_chief == (index == 0)
    assert config.addresses == tuple(addresses)
    assert (config.task_type, config.task_index) == ("worker", index)
    assert config.rpc_layer == "grpc"
    assert config.source == "TF_CONFIG"


@pytest.mark.parametrize(
    "task, worker_index, is_chief",
    [
        ({"type": "chief", "index": 0}, 0, True),
        ({"type": "worker", "index": 0}, 1, False),
        ({"type": "worker", "index": 1}, 2, False),
    ],
)
def test_chief_and_workers(task, worker_index, is_chief):
    raw = tf_config(cluster={"chief": ["c:1"], "worker": ["w:1", "w:2"]}, task=task)
    config = ClusterConfig.from_tf_config(raw)
    assert config.num_workers == 3
    assert config.worker_index == worker_index
    assert config.is_chief is is_chief
    assert config.addresses == ("c:1", "w:1", "w:2")


def test_single_task_may_omit_index():
    config = ClusterConfig.from_tf_config(
        json.dumps({"cluster": {"worker": ["h:1"]}, "task": {"type": "worker"}})
    )
    assert (config.task_index, config.num_workers) == (0, 1)


@pytest.mark.parametrize("address", ["[::1]:2222", "[fe80::1%eth0]:2222", "[2001:db8::7]:1"])
def test_ipv6_addresses(address):
    config = ClusterConfig.from_tf_config(make_tf_config([address, "127.0.0.1:2222"], 0))
    assert config.addresses[0] == address


def test_mapping_input_and_rpc_layer():
    config = ClusterConfig.from_tf_config(
        {
            "cluster": {"worker": ("a:1", "b:1")},
            "task": {"type": "worker", "index": 1},
            "rpc_layer": "grpc+loas",
            "environment": "cloud",
        }
    )
    assert (config.rpc_layer, config.worker_index) == ("grpc+loas", 1)


def test_config_is_immutable():
    config = ClusterConfig.from_tf_config(make_tf_config(TWO_WORKERS, 0))
    with pytest.raises(AttributeError):
        config.task_index = 1
    with pytest.raises(TypeError):
        config.cluster["worker"] = ("x:1",)


@pytest.mark.parametrize(
    "raw",
    [
        make_tf_config(TWO_WORKERS, 1),
        tf_config(cluster={"chief": ["c:1"], "worker": ["w:1"]}, task={"type": "chief"}),
        tf_config(cluster={"worker": ["[::1]:5"]}, rpc_layer="grpc+loas"),
        "{}",
        json.dumps({"rpc_layer": "grpc+loas"}),
    ],
)
def test_to_tf_config_round_trips(raw):
    config = ClusterConfig.from_tf_config(raw)
    again = ClusterConfig.from_tf_config(config.to_tf_config())
    assert again == config
    assert json.loads(again.to_tf_config()) == json.loads(config.to_tf_config())


def test_default_config_round_trips():
    config = ClusterConfig()
    assert ClusterConfig.from_tf_config(config.to_tf_config()).num_workers == 1


def test_make_tf_config_is_what_tensorflow_expects():
    assert json.loads(make_tf_config(["a:1", "b:2"], 1)) == {
        "cluster": {"worker": ["a:1", "b:2"]},
        "task": {"type": "worker", "index": 1},
    }


SLURM_ENV = {
    "SLURM_PROCID": "1",
    "SLURM_NTASKS": "2",
    "SLURM_JOB_NODELIST": "node[1-2]",
    "SLURM_TASKS_PER_NODE": "1(x2)",
}


def test_tf_config_takes_precedence_over_slurm():
    environ = dict(SLURM_ENV, TF_CONFIG=make_tf_config(["x:1", "y:1", "z:1"], 2))
    config = ClusterConfig.from_env(environ=environ)
    assert (config.source, config.num_workers, config.worker_index) == ("TF_CONFIG", 3, 2)


def test_tf_config_takes_precedence_even_over_invalid_slurm():
    environ = dict(SLURM_ENV, SLURM_PROCID="abc", TF_CONFIG=make_tf_config(["x:1"], 0))
    assert ClusterConfig.from_env(environ=environ).source == "TF_CONFIG"


def test_slurm_used_without_tf_config():
    config = ClusterConfig.from_env(environ=SLURM_ENV)
    assert config.source == "slurm"
    assert config.addresses == ("node1:8888", "node2:8888")
    assert (config.worker_index, config.is_chief) == (1, False)


def test_module_helpers_read_the_environment(monkeypatch, no_strategy_made):
    # keras_dist.is_chief() & co. prefer the config of a strategy created in this process;
    # this test checks the environment path, so it hides them.
    from keras_dist import cluster

    monkeypatch.setenv("TF_CONFIG", make_tf_config(["a:1", "b:1", "c:1"], 2))
    assert (cluster.num_workers(), cluster.worker_index(), cluster.is_chief()) == (3, 2, False)
    monkeypatch.delenv("TF_CONFIG")
    for name in [name for name in os.environ if name.startswith("SLURM_")]:
        monkeypatch.delenv(name)
    assert (cluster.num_workers(), cluster.worker_index(), cluster.is_chief()) == (1, 0, True)


def test_cluster_config_is_hashable_and_equal_after_round_trip():
    config = ClusterConfig.from_tf_config(
        {"cluster": {"worker": ["127.0.0.1:2222", "127.0.0.1:2223"]},
         "task": {"type": "worker", "index": 1}})
    again = ClusterConfig.from_tf_config(config.to_tf_config())
    assert config == again and hash(config) == hash(again)
    assert len({config, again}) == 1
