"""The cluster this process belongs to, read once from the environment.

`ClusterConfig.from_env()` is the only place keras_dist reads `TF_CONFIG` (set by
Kubernetes/Kubeflow TFJob, by hand, or by `keras-dist launch`) or, when it is absent,
Slurm's variables. Everything downstream (the strategy factory, the data sharding, the
chief-only callbacks) takes the resulting immutable `ClusterConfig` instead of looking at
`os.environ` itself, so one bad value is reported once, naming the field.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import types
from typing import Any, Mapping

from keras_dist.cluster import slurm as _slurm

__all__ = [
    "ClusterConfig",
    "ClusterConfigError",
    "make_tf_config",
]

# Task types MultiWorkerMirroredStrategy and MirroredStrategy understand. "ps" and
# "evaluator" belong to other strategies and are refused with a pointer to them.
_SUPPORTED_TASK_TYPES = ("chief", "worker")
_OTHER_STRATEGY_TASK_TYPES = {
    "ps": "tf.distribute.experimental.ParameterServerStrategy",
    "evaluator": "a separate evaluator job (tf.keras SidecarEvaluator), which keras_dist "
    "does not manage",
}


class ClusterConfigError(ValueError):
    """A cluster description (TF_CONFIG or Slurm variables) is invalid.

    The message names the field, the value received and what was expected.
    """


@dataclasses.dataclass(frozen=True)
class ClusterConfig:
    """An immutable description of the training cluster and of this process's task in it.

    Use `ClusterConfig.from_env()` to read it; build one directly only in tests.

    Attributes:
        cluster: Task type -> tuple of `host:port` addresses (`"chief"`, `"worker"`).
            Empty when the process runs alone.
        task_type: This process's task type, or `None` when running alone.
        task_index: This process's index within its task type, or `None`.
        rpc_layer: The RPC protocol, `"grpc"` unless TF_CONFIG says otherwise.
        source: Where the description came from: `"TF_CONFIG"`, `"slurm"` or `"none"`.

    Example:
        >>> config = ClusterConfig.from_tf_config(
        ...     {"cluster": {"worker": ["127.0.0.1:2222", "127.0.0.1:2223"]},
        ...      "task": {"type": "worker", "index": 1}})
        >>> config.num_workers, config.worker_index, config.is_chief
        (2, 1, False)
    """

    cluster: Mapping[str, tuple[str, ...]] = dataclasses.field(
        default_factory=lambda: types.MappingProxyType({})
    )
    task_type: str | None = None
    task_index: int | None = None
    rpc_layer: str = "grpc"
    source: str = "none"

    # -- construction -------------------------------------------------------------
    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "ClusterConfig":
        """Reads `TF_CONFIG`, else Slurm's variables, else a one-process cluster.

        Args:
            environ: The environment to read; `os.environ` when `None`.

        Returns:
            A validated `ClusterConfig`.

        Raises:
            ClusterConfigError: TF_CONFIG or the Slurm variables are invalid; the message
                names the field and the value.
        """
        environ = os.environ if environ is None else environ
        raw = environ.get("TF_CONFIG", "")
        if raw.strip():
            return cls.from_tf_config(raw)
        slurm = _slurm.tf_config_from_slurm(environ, ClusterConfigError)
        if slurm is not None:
            return cls._from_mapping(slurm, source="slurm")
        return cls()

    @classmethod
    def from_tf_config(cls, tf_config: str | Mapping[str, Any]) -> "ClusterConfig":
        """Parses and validates a TF_CONFIG value (a JSON string or a mapping)."""
        if isinstance(tf_config, str):
            try:
                tf_config = json.loads(tf_config)
            except json.JSONDecodeError as error:
                raise ClusterConfigError(
                    f"TF_CONFIG is not valid JSON ({error.msg} at position {error.pos}). "
                    f"Received: TF_CONFIG={_shorten(tf_config)!r}. Expected JSON such as "
                    '{"cluster": {"worker": ["host1:port", "host2:port"]}, '
                    '"task": {"type": "worker", "index": 0}}.'
                ) from None
        return cls._from_mapping(tf_config, source="TF_CONFIG")

    @classmethod
    def _from_mapping(cls, tf_config: Any, source: str) -> "ClusterConfig":
        where = source
        if not isinstance(tf_config, Mapping):
            raise ClusterConfigError(
                f"{where} must be a JSON object with keys 'cluster' and 'task'. "
                f"Received: {type(tf_config).__name__} {_shorten(tf_config)!r}."
            )
        unknown_keys = set(tf_config) - {"cluster", "task", "rpc_layer", "environment"}
        if unknown_keys:
            raise ClusterConfigError(
                f"{where} has unknown key(s) {sorted(unknown_keys)}. Expected only "
                "'cluster', 'task', 'rpc_layer' and 'environment'."
            )
        rpc_layer = tf_config.get("rpc_layer", "grpc")
        if not isinstance(rpc_layer, str) or not re.fullmatch(r"[a-z][a-z0-9+]*", rpc_layer):
            raise ClusterConfigError(
                f"{where}['rpc_layer'] must be a protocol name such as 'grpc'. "
                f"Received: rpc_layer={rpc_layer!r}."
            )
        if "cluster" not in tf_config and "task" not in tf_config:
            # TF reads TF_CONFIG='{}' as "no cluster" (a lone process); so do we, which
            # also lets to_tf_config() of a lone process round-trip.
            return cls(rpc_layer=rpc_layer, source=source)
        if "cluster" not in tf_config:
            raise ClusterConfigError(
                f"{where} has no 'cluster' field. Expected a mapping such as "
                '"cluster": {"worker": ["host1:port", "host2:port"]}.'
            )
        cluster = _parse_cluster(tf_config["cluster"], where)
        task_type, task_index = _parse_task(tf_config.get("task"), cluster, where)
        return cls(
            cluster=types.MappingProxyType(cluster),
            task_type=task_type,
            task_index=task_index,
            rpc_layer=rpc_layer,
            source=source,
        )

    # -- derived facts ------------------------------------------------------------
    @property
    def num_workers(self) -> int:
        """Number of training processes: the chief (if any) plus the workers; 1 alone."""
        return max(1, len(self.cluster.get("chief", ())) + len(self.cluster.get("worker", ())))

    @property
    def is_multi_worker(self) -> bool:
        """True when more than one process trains together."""
        return self.num_workers > 1

    @property
    def worker_index(self) -> int:
        """This process's rank in `0..num_workers-1`; the chief is 0."""
        if self.task_type is None:
            return 0
        has_chief = bool(self.cluster.get("chief"))
        if self.task_type == "chief":
            return 0
        return self.task_index + (1 if has_chief else 0)

    @property
    def is_chief(self) -> bool:
        """True for the `chief` task, else for worker 0 (and for a lone process)."""
        return self.worker_index == 0

    @property
    def addresses(self) -> tuple[str, ...]:
        """All training addresses in rank order (chief first)."""
        return tuple(self.cluster.get("chief", ())) + tuple(self.cluster.get("worker", ()))

    def __hash__(self) -> int:
        # The mapping proxy is not hashable; its (sorted) items are.
        return hash((tuple(sorted(self.cluster.items())), self.task_type, self.task_index,
                     self.rpc_layer, self.source))

    def to_tf_config(self) -> str:
        """Serialises back to a TF_CONFIG JSON string (`"{}"` for a lone process)."""
        if self.task_type is None:
            return json.dumps({} if self.rpc_layer == "grpc" else {"rpc_layer": self.rpc_layer})
        return json.dumps(
            {
                "cluster": {k: list(v) for k, v in self.cluster.items()},
                "task": {"type": self.task_type, "index": self.task_index},
                "rpc_layer": self.rpc_layer,
            }
        )


def make_tf_config(addresses: list[str] | tuple[str, ...], index: int) -> str:
    """The TF_CONFIG JSON for worker `index` of a worker-only cluster on `addresses`."""
    return json.dumps(
        {"cluster": {"worker": list(addresses)}, "task": {"type": "worker", "index": index}}
    )


def _parse_cluster(cluster: Any, where: str) -> dict[str, tuple[str, ...]]:
    if not isinstance(cluster, Mapping):
        raise ClusterConfigError(
            f"{where}['cluster'] must be a mapping of task type to a list of 'host:port' "
            f"addresses. Received: {type(cluster).__name__} {_shorten(cluster)!r}."
        )
    parsed: dict[str, tuple[str, ...]] = {}
    seen: dict[tuple[str, int], str] = {}
    for task_type, addresses in cluster.items():
        if task_type in _OTHER_STRATEGY_TASK_TYPES:
            raise ClusterConfigError(
                f"{where}['cluster'] has a {task_type!r} task, which MirroredStrategy and "
                f"MultiWorkerMirroredStrategy do not support: it needs "
                f"{_OTHER_STRATEGY_TASK_TYPES[task_type]}. Remove the {task_type!r} entry "
                "to train with keras_dist."
            )
        if task_type not in _SUPPORTED_TASK_TYPES:
            raise ClusterConfigError(
                f"{where}['cluster'] has unknown task type {task_type!r}. Expected "
                f"'chief' and/or 'worker'."
            )
        if not isinstance(addresses, (list, tuple)):
            raise ClusterConfigError(
                f"{where}['cluster'][{task_type!r}] must be a list of 'host:port' strings. "
                f"Received: {type(addresses).__name__} {_shorten(addresses)!r}."
            )
        field = f"{where}['cluster'][{task_type!r}]"
        for position, address in enumerate(addresses):
            key = _check_address(address, f"{field}[{position}]")
            if key in seen:
                raise ClusterConfigError(
                    f"{field}[{position}] repeats address {address!r}, already used by "
                    f"{seen[key]}. Every task needs its own host:port."
                )
            seen[key] = f"{field}[{position}]"
        if addresses:
            # An empty list names no task; dropping it keeps `"chief": []` from counting
            # as a chief and gives a clear error for a task of that type.
            parsed[task_type] = tuple(addresses)
    if len(parsed.get("chief", ())) > 1:
        raise ClusterConfigError(
            f"{where}['cluster']['chief'] lists {len(parsed['chief'])} addresses "
            f"{list(parsed['chief'])}; a cluster has at most one chief."
        )
    if not parsed.get("worker") and not parsed.get("chief"):
        raise ClusterConfigError(
            f"{where}['cluster'] has no workers. Received: cluster={_shorten(cluster)!r}. "
            "Expected a non-empty 'worker' list, e.g. "
            '{"worker": ["host1:port", "host2:port"]}.'
        )
    return parsed


def _parse_task(task: Any, cluster: Mapping[str, tuple[str, ...]], where: str):
    if task is None:
        raise ClusterConfigError(
            f"{where} has no 'task' field. Each process needs its own task, e.g. "
            '"task": {"type": "worker", "index": 0}.'
        )
    if not isinstance(task, Mapping):
        raise ClusterConfigError(
            f"{where}['task'] must be a mapping with 'type' and 'index'. "
            f"Received: {type(task).__name__} {_shorten(task)!r}."
        )
    task_type = task.get("type")
    if not isinstance(task_type, str):
        raise ClusterConfigError(
            f"{where}['task']['type'] must be a string such as 'worker'. "
            f"Received: type={task_type!r}."
        )
    if task_type in _OTHER_STRATEGY_TASK_TYPES:
        raise ClusterConfigError(
            f"{where}['task']['type'] is {task_type!r}, which MirroredStrategy and "
            f"MultiWorkerMirroredStrategy do not support: it needs "
            f"{_OTHER_STRATEGY_TASK_TYPES[task_type]}."
        )
    if task_type not in cluster:
        raise ClusterConfigError(
            f"{where}['task']['type'] is {task_type!r}, but the cluster has task types "
            f"{sorted(cluster)}. Expected one of them."
        )
    size = len(cluster[task_type])
    if "index" not in task and size > 1:
        # Defaulting to 0 here would make every process of the type claim index 0.
        raise ClusterConfigError(
            f"{where}['task'] has no 'index', but the cluster has {size} {task_type!r} "
            f"addresses. Set a distinct index (0..{size - 1}) on each process."
        )
    task_index = task.get("index", 0)
    if isinstance(task_index, bool) or not isinstance(task_index, int):
        raise ClusterConfigError(
            f"{where}['task']['index'] must be an integer. Received: index={task_index!r}."
        )
    if not 0 <= task_index < size:
        raise ClusterConfigError(
            f"{where}['task']['index'] is {task_index}, out of range for the {size} "
            f"{task_type!r} address(es); expected 0..{size - 1}."
        )
    return task_type, task_index


def _check_address(address: Any, field: str) -> tuple[str, int]:
    """Validates `host:port` / `[ipv6]:port`; returns (host, port) for duplicate checks."""
    if not isinstance(address, str) or ":" not in address:
        raise ClusterConfigError(
            f"{field} must be a 'host:port' string. Received: {address!r}."
        )
    host, _, port = address.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        valid_host = re.fullmatch(r"[0-9A-Fa-f:.]+(%[A-Za-z0-9_.-]+)?", host[1:-1])
    else:
        # A bare IPv6 address ("::1:2222") is ambiguous; gRPC wants it bracketed.
        valid_host = re.fullmatch(r"[A-Za-z0-9_.-]+", host)
    if not valid_host:
        raise ClusterConfigError(
            f"{field} has an empty or invalid host {host!r}; expected a host name, an "
            f"IPv4 address or a bracketed IPv6 address ('[::1]:2222'). Received: {address!r}."
        )
    # isdigit() alone accepts non-ASCII digits such as '²', which int() then rejects.
    if not (port.isascii() and port.isdigit()) or not 1 <= int(port) <= 65535:
        raise ClusterConfigError(
            f"{field} has port {port!r}; expected an integer in 1..65535. "
            f"Received: {address!r}."
        )
    return host.lower(), int(port)


def _shorten(value: Any, limit: int = 120) -> str:
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
