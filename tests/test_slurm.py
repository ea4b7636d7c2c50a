"""Slurm variables -> ClusterConfig, with synthetic environments (no Slurm needed).

The environments mimic what `srun` exports to each task; every test goes through the
public `ClusterConfig.from_env(environ=...)`, except the hostlist expansion tables.
"""

from __future__ import annotations

import pytest

from keras_dist.cluster.slurm import expand_hostlist, expand_tasks_per_node
from keras_dist.cluster import ClusterConfig, ClusterConfigError


def slurm_env(procid, ntasks, nodelist, tasks_per_node=None, step=True, **extra):
    """What srun exports to one task (step variables), or only the job's variables."""
    prefix = "SLURM_STEP_" if step else "SLURM_"
    environ = {
        "SLURM_PROCID": str(procid),
        ("SLURM_STEP_NUM_TASKS" if step else "SLURM_NTASKS"): str(ntasks),
        ("SLURM_STEP_NODELIST" if step else "SLURM_JOB_NODELIST"): nodelist,
    }
    if tasks_per_node is not None:
        environ[prefix + "TASKS_PER_NODE"] = tasks_per_node
    environ.update(extra)
    return environ


def from_slurm(**kwargs) -> ClusterConfig:
    return ClusterConfig.from_env(environ=slurm_env(**kwargs))


# -- outside Slurm -------------------------------------------------------------------
def test_no_procid_means_not_in_slurm():
    # A login shell inside an allocation has job variables but no SLURM_PROCID.
    environ = {"SLURM_JOB_NODELIST": "n[1-2]", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "7"}
    config = ClusterConfig.from_env(environ=environ)
    assert (config.source, config.num_workers) == ("none", 1)


# -- layouts -------------------------------------------------------------------------
@pytest.mark.parametrize("rank", [0, 1])
def test_one_node_two_tasks(rank):
    config = from_slurm(procid=rank, ntasks=2, nodelist="gpu7", tasks_per_node="2")
    assert config.source == "slurm"
    assert config.addresses == ("gpu7:8888", "gpu7:8889")
    assert config.worker_index == rank
    assert config.is_chief == (rank == 0)
    assert config.num_workers == 2


@pytest.mark.parametrize("rank", [0, 1])
def test_two_nodes_one_task_each(rank):
    config = from_slurm(procid=rank, ntasks=2, nodelist="node1,node2", tasks_per_node="1(x2)")
    assert config.addresses == ("node1:8888", "node2:8888")
    assert (config.task_type, config.task_index) == ("worker", rank)


@pytest.mark.parametrize("rank", range(4))
def test_two_nodes_two_tasks_compressed_nodelist(rank):
    config = from_slurm(procid=rank, ntasks=4, nodelist="gpu[01-02]", tasks_per_node="2,2")
    assert config.addresses == ("gpu01:8888", "gpu01:8889", "gpu02:8888", "gpu02:8889")
    assert config.worker_index == rank


def test_repeat_syntax_in_tasks_per_node():
    config = from_slurm(procid=3, ntasks=5, nodelist="a[1-3]", tasks_per_node="2(x2),1")
    assert config.addresses == ("a1:8888", "a1:8889", "a2:8888", "a2:8889", "a3:8888")
    assert config.worker_index == 3


def test_even_split_without_tasks_per_node():
    config = from_slurm(procid=5, ntasks=6, nodelist="n[1-3]")
    assert config.addresses == tuple(f"n{i}:{p}" for i in (1, 2, 3) for p in (8888, 8889))


def test_ntasks_derived_from_tasks_per_node():
    environ = {"SLURM_PROCID": "1", "SLURM_STEP_NODELIST": "n1", "SLURM_STEP_TASKS_PER_NODE": "3"}
    assert ClusterConfig.from_env(environ=environ).num_workers == 3


def test_job_variables_when_step_variables_are_absent():
    config = from_slurm(procid=1, ntasks=2, nodelist="n[1-2]", tasks_per_node="1(x2)", step=False)
    assert config.addresses == ("n1:8888", "n2:8888")


def test_step_variables_win_over_job_variables():
    # `srun -N1 -n2` inside a 2-node x 2-task job: the step is one node.
    environ = slurm_env(procid=1, ntasks=2, nodelist="n1", tasks_per_node="2")
    environ.update(
        SLURM_NTASKS="4", SLURM_JOB_NODELIST="n[1-2]", SLURM_TASKS_PER_NODE="2(x2)"
    )
    assert ClusterConfig.from_env(environ=environ).addresses == ("n1:8888", "n1:8889")


def test_nodelist_order_is_kept_not_sorted():
    # TF's SlurmClusterResolver sorts hosts (n10 before n9); Slurm gives rank 0 to n9.
    config = from_slurm(procid=0, ntasks=2, nodelist="n[9-10]", tasks_per_node="1(x2)",
                        SLURMD_NODENAME="n9")
    assert config.addresses == ("n9:8888", "n10:8888")


def test_port_base_from_environment():
    config = from_slurm(procid=0, ntasks=2, nodelist="n1", tasks_per_node="2",
                        KERAS_DIST_SLURM_PORT_BASE="20000")
    assert config.addresses == ("n1:20000", "n1:20001")


def test_highest_port_allowed():
    config = from_slurm(procid=0, ntasks=2, nodelist="n1", tasks_per_node="2",
                        KERAS_DIST_SLURM_PORT_BASE="65534")
    assert config.addresses == ("n1:65534", "n1:65535")


@pytest.mark.parametrize(
    "distribution, expected",
    [
        ("block", ["a:8888", "a:8889", "b:8888", "b:8889", "b:8890"]),
        ("block:cyclic,Pack", ["a:8888", "a:8889", "b:8888", "b:8889", "b:8890"]),
        ("cyclic", ["a:8888", "b:8888", "a:8889", "b:8889", "b:8890"]),
        ("cyclic:block", ["a:8888", "b:8888", "a:8889", "b:8889", "b:8890"]),
        ("plane=2", ["a:8888", "a:8889", "b:8888", "b:8889", "b:8890"]),
        ("plane=1", ["a:8888", "b:8888", "a:8889", "b:8889", "b:8890"]),
    ],
)
def test_distribution_decides_rank_order(distribution, expected):
    config = from_slurm(procid=0, ntasks=5, nodelist="a,b", tasks_per_node="2,3",
                        SLURM_DISTRIBUTION=distribution)
    assert list(config.addresses) == expected


def test_plane_size_from_its_own_variable():
    config = from_slurm(procid=0, ntasks=4, nodelist="a,b", tasks_per_node="2(x2)",
                        SLURM_DISTRIBUTION="plane", SLURM_DIST_PLANESIZE="1")
    assert list(config.addresses) == ["a:8888", "b:8888", "a:8889", "b:8889"]


def test_own_node_and_local_id_consistent():
    config = from_slurm(procid=2, ntasks=4, nodelist="n[1-2]", tasks_per_node="2(x2)",
                        SLURMD_NODENAME="n2", SLURM_LOCALID="0")
    assert config.worker_index == 2


def test_single_task_step_is_one_worker():
    config = from_slurm(procid=0, ntasks=1, nodelist="n1")
    assert (config.num_workers, config.is_multi_worker, config.is_chief) == (1, False, True)


# -- hostlist expansion ----------------------------------------------------------------
@pytest.mark.parametrize(
    "hostlist, expected",
    [
        ("node1", ["node1"]),
        ("node1,node2", ["node1", "node2"]),
        ("node[1-3]", ["node1", "node2", "node3"]),
        ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
        ("node[01-03,07],gpu-[1-2]", ["node01", "node02", "node03", "node07", "gpu-1", "gpu-2"]),
        ("n[8-10]", ["n8", "n9", "n10"]),
        ("n[08-10]", ["n08", "n09", "n10"]),
        ("n[007]", ["n007"]),
        ("rack[1-2]-node[1-2]", ["rack1-node1", "rack1-node2", "rack2-node1", "rack2-node2"]),
        ("n[1-2]-ib", ["n1-ib", "n2-ib"]),
        ("n[1-2].cluster.local", ["n1.cluster.local", "n2.cluster.local"]),
        ("[1-2]", ["1", "2"]),
        ("a[2,1]", ["a2", "a1"]),
        ("m5,o[3-4,6,7-9]", ["m5", "o3", "o4", "o6", "o7", "o8", "o9"]),
        ("x_1,y.2", ["x_1", "y.2"]),
    ],
)
def test_expand_hostlist(hostlist, expected):
    assert expand_hostlist(hostlist) == expected


@pytest.mark.parametrize(
    "hostlist",
    ["", "a,,b", "a,", ",a", "n[1-2", "n1-2]", "n[[1]]", "n[]", "n[a-b]", "n[3-1]",
     "n[1-2-3]", "n[1,]", "n[-1]", "n 1", "n[1- 2]", "n/1", "n[0-99999999]"],
)
def test_expand_hostlist_rejects(hostlist):
    with pytest.raises(ValueError):
        expand_hostlist(hostlist)


@pytest.mark.parametrize(
    "text, expected",
    [("1", [1]), ("2(x3)", [2, 2, 2]), ("2(x3),1", [2, 2, 2, 1]), ("4,2(x2),1", [4, 2, 2, 1])],
)
def test_expand_tasks_per_node(text, expected):
    assert expand_tasks_per_node(text) == expected


# -- invalid values --------------------------------------------------------------------
BASE = dict(procid=0, ntasks=4, nodelist="n[1-2]", tasks_per_node="2(x2)")

INVALID_SLURM = {
    "procid not an integer": (
        dict(BASE, procid="zero"), ["SLURM_PROCID", "'zero'"]),
    "procid negative": (dict(BASE, procid=-1), ["SLURM_PROCID", "'-1'"]),
    "procid empty": (dict(BASE, procid=""), ["SLURM_PROCID", "''"]),
    "procid >= ntasks": (
        dict(BASE, procid=4), ["SLURM_PROCID", "4", "4 task(s)", "SLURM_STEP_NUM_TASKS"]),
    "ntasks not an integer": (
        dict(BASE, ntasks="four"), ["SLURM_STEP_NUM_TASKS", "'four'"]),
    "ntasks zero": (dict(BASE, ntasks=0), ["SLURM_STEP_NUM_TASKS", "'0'"]),
    "ntasks inconsistent with tasks per node": (
        dict(BASE, ntasks=3),
        ["SLURM_STEP_NUM_TASKS=3", "SLURM_STEP_TASKS_PER_NODE='2(x2)'", "4 task(s)"]),
    "ntasks not divisible over nodes": (
        dict(BASE, ntasks=3, tasks_per_node=None),
        ["SLURM_STEP_NUM_TASKS=3", "2 node(s)", "'n[1-2]'"]),
    "tasks per node count differs from nodes": (
        dict(BASE, tasks_per_node="2(x3)"),
        ["SLURM_STEP_TASKS_PER_NODE='2(x3)'", "3 node(s)", "SLURM_STEP_NODELIST='n[1-2]'"]),
    "tasks per node malformed": (
        dict(BASE, tasks_per_node="2x2"), ["SLURM_STEP_TASKS_PER_NODE", "'2x2'"]),
    "tasks per node zero": (
        dict(BASE, tasks_per_node="0,4"), ["SLURM_STEP_TASKS_PER_NODE", "'0,4'"]),
    "nodelist malformed": (
        dict(BASE, nodelist="n[1-2"), ["SLURM_STEP_NODELIST", "'n[1-2'", "never closed"]),
    "nodelist decreasing range": (
        dict(BASE, nodelist="n[2-1]"), ["SLURM_STEP_NODELIST", "'n[2-1]'", "decreasing"]),
    "nodelist duplicate node": (
        dict(BASE, nodelist="n1,n[1]"), ["SLURM_STEP_NODELIST", "'n1'", "more than once"]),
    "job nodelist malformed": (
        dict(BASE, nodelist="a,,b", step=False), ["SLURM_JOB_NODELIST", "'a,,b'"]),
    "port base not an integer": (
        dict(BASE, KERAS_DIST_SLURM_PORT_BASE="http"),
        ["KERAS_DIST_SLURM_PORT_BASE", "'http'", "1..65535"]),
    "port base zero": (
        dict(BASE, KERAS_DIST_SLURM_PORT_BASE="0"), ["KERAS_DIST_SLURM_PORT_BASE", "'0'"]),
    "port base too large": (
        dict(BASE, KERAS_DIST_SLURM_PORT_BASE="65536"),
        ["KERAS_DIST_SLURM_PORT_BASE", "'65536'"]),
    "port base leaves no room for the node's tasks": (
        dict(BASE, KERAS_DIST_SLURM_PORT_BASE="65535"),
        ["KERAS_DIST_SLURM_PORT_BASE='65535'", "2 task(s)", "65536", "<= 65534"]),
    "distribution arbitrary": (
        dict(BASE, SLURM_DISTRIBUTION="arbitrary"), ["SLURM_DISTRIBUTION='arbitrary'"]),
    "plane without size": (
        dict(BASE, SLURM_DISTRIBUTION="plane"), ["SLURM_DISTRIBUTION='plane'"]),
    "node name disagrees with placement": (
        dict(BASE, procid=2, SLURMD_NODENAME="n1"),
        ["SLURMD_NODENAME='n1'", "'n2'", "--distribution=block"]),
    "local id disagrees with placement": (
        dict(BASE, procid=1, SLURM_LOCALID="0"), ["SLURM_LOCALID='0'", "task 1"]),
}


@pytest.mark.parametrize("kwargs, fragments", INVALID_SLURM.values(), ids=list(INVALID_SLURM))
def test_invalid_slurm_variables_name_the_variable(kwargs, fragments):
    kwargs = dict(kwargs)
    if kwargs.get("tasks_per_node", "") is None:
        kwargs.pop("tasks_per_node")
    with pytest.raises(ClusterConfigError) as caught:
        from_slurm(**kwargs)
    assert isinstance(caught.value, ValueError)
    message = str(caught.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


def test_missing_nodelist_names_the_variables():
    environ = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}
    with pytest.raises(ClusterConfigError, match="SLURM_STEP_NODELIST.*SLURM_JOB_NODELIST"):
        ClusterConfig.from_env(environ=environ)


def test_missing_task_counts_names_the_variables():
    environ = {"SLURM_PROCID": "0", "SLURM_JOB_NODELIST": "n1"}
    with pytest.raises(ClusterConfigError, match="SLURM_NTASKS.*SLURM_TASKS_PER_NODE"):
        ClusterConfig.from_env(environ=environ)


def test_huge_task_counts_are_refused_without_building_them():
    environ = slurm_env(procid=0, ntasks=10**9, nodelist="n1", tasks_per_node=str(10**9))
    with pytest.raises(ClusterConfigError, match="more than keras_dist supports"):
        ClusterConfig.from_env(environ=environ)
