"""Slurm variables -> a TF_CONFIG-shaped cluster description.

`ClusterConfig.from_env()` calls `tf_config_from_slurm` when `TF_CONFIG` is absent, so a
script started with `srun` trains on every task of its step without any set-up:

```sh
#!/bin/bash
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=2        # e.g. one task per GPU
#SBATCH --gpus-per-task=1
export KERAS_DIST_SLURM_PORT_BASE=12345   # optional; default 8888
srun python train.py               # srun, not plain `python`: each task is one worker
```

Variables read (the step's own variables first, the job's as the fallback):

- `SLURM_PROCID`: this task's rank; its absence means "not inside a Slurm step".
- `SLURM_STEP_NUM_TASKS`, else `SLURM_NTASKS`: number of tasks.
- `SLURM_STEP_NODELIST`, else `SLURM_JOB_NODELIST`, else `SLURM_NODELIST`: the nodes, as a
  compressed hostlist such as `gpu[01-04,07],login1`.
- `SLURM_STEP_TASKS_PER_NODE`, else `SLURM_TASKS_PER_NODE`: tasks on each node, such as
  `2(x3),1`; when absent, the tasks are split evenly over the nodes.
- `SLURM_DISTRIBUTION` (optional): `block` (the default), `cyclic` or `plane=<size>` decide
  which rank runs on which node; `arbitrary` is refused.
- `SLURMD_NODENAME` and `SLURM_LOCALID` (optional): checked against the computed placement,
  so a distribution this module got wrong is an error instead of a hung collective.
- `KERAS_DIST_SLURM_PORT_BASE` (optional, default 8888): the k-th task on a node listens on
  port base + k.

How this differs from TensorFlow's `SlurmClusterResolver`
(`tensorflow/python/distribute/cluster_resolver/slurm_cluster_resolver.py`):

- TF lays tasks out over `sorted(hosts)`; Slurm numbers ranks in nodelist order, which can
  differ (`node[9-10]` sorts as `node10, node9`). We keep nodelist order, so worker i is the
  process Slurm gave rank i, and we honour `SLURM_DISTRIBUTION=cyclic|plane` too.
- TF's `expand_hostlist` accepts one bracket group per name at the end (`n[1-2]`); we also
  expand several groups and suffixes (`rack[1-2]-node[01-02]`, `n[1-2]-ib`), as Slurm does.
- TF reads only the `SLURM_STEP_*` variables; we fall back to the job's variables.
- TF sets `CUDA_VISIBLE_DEVICES` from its own GPU split; we change no environment (use
  `--gpus-per-task` / `--gpu-bind` so Slurm does it).
- TF raises `RuntimeError`/`ValueError` from bare `int()`s and `assert`s; every bad value
  here raises `error_type` naming the variable and the value received.
"""

from __future__ import annotations

import collections
import itertools
import re
from typing import Mapping

PORT_BASE_VARIABLE = "KERAS_DIST_SLURM_PORT_BASE"
# Same default as TF's SlurmClusterResolver(port_base=8888).
DEFAULT_PORT_BASE = 8888
_MAX_PORT = 65535
# A guard against `node[0-999999999]` exhausting memory; far above any real allocation.
_MAX_EXPANDED = 1_000_000

_HOST_CHARS = re.compile(r"[A-Za-z0-9._-]+")
_TASKS_PER_NODE_PART = re.compile(r"([0-9]+)(?:\(x([0-9]+)\))?")
_RANGE = re.compile(r"([0-9]+)(?:-([0-9]+))?")

_HINT = "Start the script with `srun`, or set TF_CONFIG to describe the cluster yourself."


def tf_config_from_slurm(environ: Mapping[str, str], error_type: type) -> dict | None:
    """Builds a TF_CONFIG-shaped mapping from the Slurm variables of the current step.

    Args:
        environ: The environment to read (see the module docstring for the variables).
        error_type: The exception class to raise for an invalid value (ClusterConfigError).

    Returns:
        `None` outside a Slurm step (no `SLURM_PROCID`); otherwise
        `{"cluster": {"worker": ["node1:8888", ...]}, "task": {"type": "worker",
        "index": rank}}` with the workers in Slurm rank order.

    Raises:
        error_type: A variable is malformed or inconsistent with the others; the message
            names the variable and its value.

    Example:
        >>> tf_config_from_slurm({"SLURM_PROCID": "3", "SLURM_NTASKS": "4",
        ...     "SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_TASKS_PER_NODE": "2(x2)"},
        ...     ValueError)["cluster"]["worker"]
        ['gpu01:8888', 'gpu01:8889', 'gpu02:8888', 'gpu02:8889']
    """
    if "SLURM_PROCID" not in environ:
        return None
    rank = _read_int(environ, "SLURM_PROCID", error_type, minimum=0)

    hosts, nodes_var = _hosts(environ, error_type)
    tasks_per_node = _checked_tasks_per_node(environ, hosts, nodes_var, rank, error_type)
    port_base = _port_base(environ, max(tasks_per_node), error_type)
    placement = _placement(tasks_per_node, _plane_size(environ, error_type))
    workers = [f"{hosts[node]}:{port_base + local}" for node, local in placement]
    _check_own_placement(environ, rank, hosts, placement, error_type)
    return {"cluster": {"worker": workers}, "task": {"type": "worker", "index": rank}}


def _hosts(environ: Mapping[str, str], error_type: type) -> tuple[list[str], str]:
    """The step's nodes in Slurm order, and the variable that listed them."""
    nodes_var, nodelist = _first_set(
        environ, ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
    )
    if nodes_var is None:
        raise error_type(
            "SLURM_PROCID is set but none of SLURM_STEP_NODELIST, SLURM_JOB_NODELIST or "
            f"SLURM_NODELIST is, so the cluster's nodes are unknown. {_HINT}"
        )
    try:
        hosts = expand_hostlist(nodelist)
    except ValueError as reason:
        raise error_type(
            f"{nodes_var} is not a valid Slurm hostlist: {reason}. Received: "
            f"{nodes_var}={nodelist!r}. Expected e.g. 'node[01-03,07],gpu-1'."
        ) from None
    duplicates = sorted(host for host, seen in collections.Counter(hosts).items() if seen > 1)
    if duplicates:
        raise error_type(
            f"{nodes_var} lists node(s) {duplicates} more than once. "
            f"Received: {nodes_var}={nodelist!r}."
        )
    return hosts, nodes_var


def _checked_tasks_per_node(environ: Mapping[str, str], hosts: list[str], nodes_var: str,
                            rank: int, error_type: type) -> list[int]:
    """Tasks on each node, checked against the task count and this task's rank."""
    ntasks_var = _first_set(environ, ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"))[0]
    ntasks = None
    if ntasks_var is not None:
        ntasks = _read_int(environ, ntasks_var, error_type, minimum=1)

    tasks_per_node = _tasks_per_node(environ, hosts, nodes_var, ntasks, ntasks_var, error_type)
    total = sum(tasks_per_node)
    if total > _MAX_EXPANDED:
        raise error_type(
            f"The Slurm variables describe {total} tasks (per node: "
            f"{_shorten(tasks_per_node)}), more than keras_dist supports ({_MAX_EXPANDED})."
        )
    if ntasks is None:
        ntasks, ntasks_var = total, "the tasks per node"
    if rank >= ntasks:
        raise error_type(
            f"SLURM_PROCID is {rank}, out of range for {ntasks} task(s) "
            f"({ntasks_var}); expected 0..{ntasks - 1}. Received: "
            f"SLURM_PROCID={environ['SLURM_PROCID']!r}."
        )
    return tasks_per_node


def expand_hostlist(hostlist: str) -> list[str]:
    """Expands a compressed Slurm hostlist, keeping Slurm's order and zero padding.

    Example:
        >>> expand_hostlist("n[08-10],rack[1-2]-gpu[1,3]")
        ['n08', 'n09', 'n10', 'rack1-gpu1', 'rack1-gpu3', 'rack2-gpu1', 'rack2-gpu3']

    Raises:
        ValueError: The hostlist is malformed; the message says where.
    """
    hosts: list[str] = []
    for pattern in _split_outside_brackets(hostlist):
        choices = _parse_pattern(pattern)
        count = 1
        for options in choices:
            count *= len(options)
        if len(hosts) + count > _MAX_EXPANDED:
            raise ValueError(f"it expands to more than {_MAX_EXPANDED} hosts")
        # Like Slurm, the leftmost bracket group varies slowest.
        hosts.extend("".join(parts) for parts in itertools.product(*choices))
    return hosts


def expand_tasks_per_node(text: str) -> list[int]:
    """Expands Slurm's tasks-per-node syntax: `"2(x3),1"` -> `[2, 2, 2, 1]`.

    Raises:
        ValueError: The text is malformed or a count is zero.
    """
    counts: list[int] = []
    for part in text.split(","):
        match = _TASKS_PER_NODE_PART.fullmatch(part)
        if match is None:
            raise ValueError(f"{part!r} is not 'N' or 'N(xR)'")
        tasks, repeats = int(match.group(1)), int(match.group(2) or 1)
        if tasks < 1 or repeats < 1:
            raise ValueError(f"{part!r} has a zero count")
        if len(counts) + repeats > _MAX_EXPANDED:
            raise ValueError(f"it describes more than {_MAX_EXPANDED} nodes")
        counts.extend([tasks] * repeats)
    return counts


# -- hostlist parsing -------------------------------------------------------------------
def _split_outside_brackets(hostlist: str) -> list[str]:
    if not hostlist:
        raise ValueError("it is empty")
    patterns, current, depth = [], "", 0
    for position, char in enumerate(hostlist):
        if char == "[":
            if depth:
                raise ValueError(f"nested '[' at position {position}")
            depth = 1
        elif char == "]":
            if not depth:
                raise ValueError(f"']' without '[' at position {position}")
            depth = 0
        elif char == "," and not depth:
            if not current:
                raise ValueError(f"empty host name before position {position}")
            patterns.append(current)
            current = ""
            continue
        current += char
    if depth:
        raise ValueError("'[' is never closed")
    if not current:
        raise ValueError("it ends with ','")
    patterns.append(current)
    return patterns


def _parse_pattern(pattern: str) -> list[list[str]]:
    """`rack[1-2]-n[5,7]` -> [['rack'], ['1', '2'], ['-n'], ['5', '7']]."""
    if "[]" in pattern:
        raise ValueError(f"{pattern!r} has an empty '[]'")
    choices: list[list[str]] = []
    # Brackets are balanced and unnested here (_split_outside_brackets checked).
    for literal, ranges in re.findall(r"([^\[]*)(?:\[([^\]]*)\])?", pattern):
        if literal:
            if not _HOST_CHARS.fullmatch(literal):
                raise ValueError(
                    f"{pattern!r} has characters other than letters, digits, '.', '_', '-'"
                )
            choices.append([literal])
        if ranges:
            choices.append(_expand_ranges(ranges, pattern))
    return choices


def _expand_ranges(ranges: str, pattern: str) -> list[str]:
    values: list[str] = []
    for part in ranges.split(","):
        match = _RANGE.fullmatch(part)
        if match is None:
            raise ValueError(f"{pattern!r} has range {part!r}; expected 'N' or 'N-M' digits")
        low, high = match.group(1), match.group(2) or match.group(1)
        if int(high) < int(low):
            raise ValueError(f"{pattern!r} has decreasing range {part!r}")
        if len(values) + int(high) - int(low) >= _MAX_EXPANDED:
            raise ValueError(f"it expands to more than {_MAX_EXPANDED} hosts")
        # Slurm pads to the width of the lower bound: [08-10] -> 08, 09, 10.
        values.extend(str(i).zfill(len(low)) for i in range(int(low), int(high) + 1))
    return values


# -- variables --------------------------------------------------------------------------
def _first_set(environ: Mapping[str, str], names: tuple[str, ...]):
    for name in names:
        if name in environ:
            return name, environ[name]
    return None, None


def _read_int(environ: Mapping[str, str], name: str, error_type: type, minimum: int) -> int:
    value = environ[name]
    if not re.fullmatch(r"[0-9]+", value) or int(value) < minimum:
        raise error_type(
            f"{name} must be an integer >= {minimum}. Received: {name}={value!r}. {_HINT}"
        )
    return int(value)


def _tasks_per_node(environ, hosts, nodes_var, ntasks, ntasks_var, error_type) -> list[int]:
    tpn_var, text = _first_set(environ, ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"))
    if tpn_var is None:
        if ntasks is None:
            raise error_type(
                "SLURM_PROCID is set but neither the number of tasks (SLURM_STEP_NUM_TASKS, "
                "SLURM_NTASKS) nor the tasks per node (SLURM_STEP_TASKS_PER_NODE, "
                f"SLURM_TASKS_PER_NODE) is. {_HINT}"
            )
        if ntasks % len(hosts):
            raise error_type(
                f"{ntasks_var}={ntasks} tasks cannot be split evenly over the {len(hosts)} "
                f"node(s) of {nodes_var}={environ[nodes_var]!r}, and SLURM_TASKS_PER_NODE "
                "is not set to say how they are placed."
            )
        return [ntasks // len(hosts)] * len(hosts)
    try:
        counts = expand_tasks_per_node(text)
    except ValueError as reason:
        raise error_type(
            f"{tpn_var} is not a valid tasks-per-node list: {reason}. Received: "
            f"{tpn_var}={text!r}. Expected e.g. '2(x3),1'."
        ) from None
    if len(counts) != len(hosts):
        raise error_type(
            f"{tpn_var}={text!r} describes {len(counts)} node(s) but "
            f"{nodes_var}={environ[nodes_var]!r} lists {len(hosts)}."
        )
    if ntasks is not None and sum(counts) != ntasks:
        raise error_type(
            f"{ntasks_var}={ntasks} does not match {tpn_var}={text!r} on "
            f"{nodes_var}={environ[nodes_var]!r}, which places {sum(counts)} task(s)."
        )
    return counts


def _port_base(environ: Mapping[str, str], max_tasks_per_node: int, error_type: type) -> int:
    value = environ.get(PORT_BASE_VARIABLE)
    if value is None:
        return DEFAULT_PORT_BASE
    if not re.fullmatch(r"[0-9]+", value) or not 1 <= int(value) <= _MAX_PORT:
        raise error_type(
            f"{PORT_BASE_VARIABLE} must be an integer port in 1..{_MAX_PORT}. "
            f"Received: {PORT_BASE_VARIABLE}={value!r}."
        )
    base = int(value)
    highest = base + max_tasks_per_node - 1
    if highest > _MAX_PORT:
        raise error_type(
            f"{PORT_BASE_VARIABLE}={value!r} with {max_tasks_per_node} task(s) on one node "
            f"needs ports up to {highest}, above {_MAX_PORT}. Choose a base <= "
            f"{_MAX_PORT - max_tasks_per_node + 1}."
        )
    return base


def _plane_size(environ: Mapping[str, str], error_type: type) -> int | None:
    """Tasks per round-robin block: None for block, 1 for cyclic, N for plane=N."""
    value = environ.get("SLURM_DISTRIBUTION", "")
    # "cyclic:block,Pack": only the part before ':' places tasks on nodes.
    method = value.split(",")[0].split(":")[0]
    if method in ("", "*", "block"):
        return None
    if method == "cyclic":
        return 1
    plane = re.fullmatch(r"plane(?:=([0-9]+))?", method)
    if plane:
        size = plane.group(1) or environ.get("SLURM_DIST_PLANESIZE", "")
        if size.isdigit() and int(size) >= 1:
            return int(size)
    raise error_type(
        f"SLURM_DISTRIBUTION={value!r} is not supported; keras_dist understands 'block' "
        "(the default), 'cyclic' and 'plane=<size>'. Use one of them, or set TF_CONFIG."
    )


def _placement(tasks_per_node: list[int], plane_size: int | None) -> list[tuple[int, int]]:
    """(node position, task index on that node) for ranks 0, 1, ...

    Block gives each node its tasks consecutively; cyclic and plane deal blocks of
    `plane_size` tasks round-robin over the nodes that still have room, as Slurm does.
    """
    if plane_size is None:
        return [(node, local) for node, count in enumerate(tasks_per_node)
                for local in range(count)]
    placed = [0] * len(tasks_per_node)
    placement: list[tuple[int, int]] = []
    while len(placement) < sum(tasks_per_node):
        for node, count in enumerate(tasks_per_node):
            take = min(plane_size, count - placed[node])
            placement.extend((node, placed[node] + k) for k in range(take))
            placed[node] += take
    return placement


def _check_own_placement(environ, rank, hosts, placement, error_type) -> None:
    node, local = placement[rank]
    distribution = (
        f"SLURM_DISTRIBUTION={environ['SLURM_DISTRIBUTION']!r}"
        if "SLURM_DISTRIBUTION" in environ
        else "the default block distribution"
    )
    actual_node = environ.get("SLURMD_NODENAME")
    if actual_node is not None and actual_node != hosts[node]:
        raise error_type(
            f"SLURMD_NODENAME={actual_node!r} but rank {rank} should run on {hosts[node]!r} "
            f"under {distribution}; the task placement is not the one "
            "keras_dist computed. Launch with `srun --distribution=block`, or set TF_CONFIG."
        )
    actual_local = environ.get("SLURM_LOCALID")
    if actual_local is not None and actual_local != str(local):
        raise error_type(
            f"SLURM_LOCALID={actual_local!r} but rank {rank} should be task {local} on "
            f"{hosts[node]!r} under {distribution}. Launch with "
            "`srun --distribution=block`, or set TF_CONFIG."
        )


def _shorten(value, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
