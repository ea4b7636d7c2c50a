"""The strategy factory: one call picks and builds the right `tf.distribute.Strategy`.

`strategy()` reads the cluster (`ClusterConfig.from_env()`) and the local devices and
returns a real TensorFlow strategy:

* more than one worker in the cluster -> `MultiWorkerMirroredStrategy` (RING collectives
  on CPU, NCCL where asked and available), with `CommunicationOptions`;
* one worker with several GPUs or virtual devices -> `MirroredStrategy` over them;
* otherwise TensorFlow's default strategy (one replica).

It also applies keras_dist's Keras 3 compatibility fixes (`keras_dist.compat`) once, and it
remembers what it built: `MultiWorkerMirroredStrategy` must be created once per process,
and every keras_dist function with `strategy=None` resolves to it (`resolve_strategy`).
"""

from __future__ import annotations

from typing import Sequence

from keras_dist import _runtime
from keras_dist.cluster import ClusterConfig

__all__ = ["strategy", "resolve_strategy"]

_KINDS = ("auto", "mirrored", "multi_worker", "one_device")
_IMPLEMENTATIONS = ("auto", "ring", "nccl")


def _validate(kind, devices, implementation, bytes_per_pack, timeout_seconds):
    if kind not in _KINDS:
        raise ValueError(
            f"Argument `kind` must be one of {list(_KINDS)}. Received: kind={kind!r}"
        )
    if implementation not in _IMPLEMENTATIONS:
        raise ValueError(
            f"Argument `implementation` must be one of {list(_IMPLEMENTATIONS)}. "
            f"Received: implementation={implementation!r}"
        )
    if isinstance(bytes_per_pack, bool) or not isinstance(bytes_per_pack, int) or (
        bytes_per_pack < 0
    ):
        raise ValueError(
            "Argument `bytes_per_pack` must be an integer >= 0 (0 lets TensorFlow choose). "
            f"Received: bytes_per_pack={bytes_per_pack!r}"
        )
    if timeout_seconds is not None and (
        isinstance(timeout_seconds, bool)
        or not isinstance(timeout_seconds, (int, float))
        or not timeout_seconds > 0
    ):
        raise ValueError(
            "Argument `timeout_seconds` must be a positive number of seconds or None. "
            f"Received: timeout_seconds={timeout_seconds!r}"
        )
    if devices is not None:
        if isinstance(devices, str) or not isinstance(devices, Sequence) or not devices:
            raise ValueError(
                "Argument `devices` must be a non-empty list of device names such as "
                f"['/gpu:0', '/gpu:1'], or None. Received: devices={devices!r}"
            )
        if not all(isinstance(d, str) and d for d in devices):
            raise ValueError(
                f"Argument `devices` must hold device name strings. Received: {devices!r}"
            )
        if len(set(devices)) != len(devices):
            raise ValueError(f"Argument `devices` repeats a device. Received: {devices!r}")


def communication_options(implementation="auto", bytes_per_pack=0, timeout_seconds=None):
    """Builds `tf.distribute.experimental.CommunicationOptions` from keras_dist's args."""
    import tensorflow as tf

    impl = {
        "auto": tf.distribute.experimental.CommunicationImplementation.AUTO,
        "ring": tf.distribute.experimental.CommunicationImplementation.RING,
        "nccl": tf.distribute.experimental.CommunicationImplementation.NCCL,
    }[implementation]
    return tf.distribute.experimental.CommunicationOptions(
        bytes_per_pack=bytes_per_pack, timeout_seconds=timeout_seconds, implementation=impl
    )


def strategy(
    kind: str = "auto",
    *,
    devices: Sequence[str] | None = None,
    implementation: str = "auto",
    bytes_per_pack: int = 0,
    timeout_seconds: float | None = None,
):
    """Creates (once) and returns the `tf.distribute.Strategy` for this process.

    Call it at the start of the program, after setting `TF_CONFIG` (or under Slurm, or
    under `keras-dist launch`) and after `keras_dist.virtual_devices()` if used, and
    before building the model. Calling it again with the same arguments returns the
    same strategy.

    Args:
        kind: `"auto"` (choose from the cluster and devices), or force `"mirrored"`,
            `"multi_worker"` or `"one_device"`.
        devices: Local devices to replicate over (Mirrored) or the one device
            (one_device). Default: all GPUs, else all logical CPUs if more than one.
        implementation: All-reduce implementation: `"auto"`, `"ring"` or `"nccl"`.
            On CPU-only workers `"auto"` means RING.
        bytes_per_pack: Pack gradients into chunks of about this many bytes for the
            all-reduce (0: TensorFlow decides).
        timeout_seconds: Abort a collective that has not finished after this long, so a
            peer that is alive but stuck becomes `tf.errors.DeadlineExceededError`
            instead of a hang. None (the default): no per-collective timeout. A peer
            that *dies* is detected without it: TensorFlow's coordination service fails
            every survivor's collectives with `tf.errors.UnavailableError` (measured on
            CPU, 2 workers: ~6 s for a killed worker, <1 s for a killed chief). There
            is deliberately no default timeout: TensorFlow starts one thread per
            collective that sleeps for `timeout_seconds` (measured: ~6 threads per
            training step of a small model, so 600 s at 10 steps/s keeps ~36,000
            threads alive, beyond many containers' pid limits). Set it for debugging
            hangs, or where steps are slow enough that the thread count stays small.

    Returns:
        A `tf.distribute.MultiWorkerMirroredStrategy`, `tf.distribute.MirroredStrategy`,
        `tf.distribute.OneDeviceStrategy` or TensorFlow's default strategy.

    Raises:
        ValueError: An argument is invalid, or `kind` contradicts the cluster/devices.
        keras_dist.ClusterConfigError: TF_CONFIG or the Slurm variables are invalid.
        RuntimeError: A multi-worker strategy with other settings already exists in this
            process, or TensorFlow initialised too early for it.

    Example:
        >>> import keras, keras_dist
        >>> with keras_dist.strategy().scope():
        ...     model = keras.Sequential([keras.layers.Dense(10)])
        ...     model.compile(optimizer="sgd", loss="mse")
    """
    _validate(kind, devices, implementation, bytes_per_pack, timeout_seconds)
    cluster = ClusterConfig.from_env()
    resolved_kind, resolved_devices = _choose(kind, devices, cluster)
    key = (resolved_kind, resolved_devices, implementation, bytes_per_pack,
           timeout_seconds, cluster)
    # The most recently requested strategy is the one `strategy=None` means.
    existing = _runtime.find(key)
    if existing is not None:
        return existing.strategy
    for created in _runtime.created():
        if created.kind == "multi_worker":
            raise RuntimeError(
                "A MultiWorkerMirroredStrategy already exists in this process (created by "
                f"keras_dist.strategy() with kind/devices/options {created.key[:5]}); "
                "TensorFlow allows only one per process. Call keras_dist.strategy() with "
                "the same arguments to get it back, or start a new process."
            )
    from keras_dist import compat

    compat.apply()
    built = _build(resolved_kind, resolved_devices, cluster, implementation,
                   bytes_per_pack, timeout_seconds)
    _runtime.remember(_runtime.Created(key=key, strategy=built, kind=resolved_kind,
                                       cluster=cluster))
    return built


def _choose(kind, devices, cluster):
    if cluster.is_multi_worker:
        if kind in ("mirrored", "one_device"):
            raise ValueError(
                f"Argument `kind` is {kind!r}, but the cluster ({cluster.source}) has "
                f"{cluster.num_workers} workers; {kind!r} trains on one process only. Use "
                "kind='multi_worker' or 'auto', or unset TF_CONFIG to train alone."
            )
        if devices is not None:
            raise ValueError(
                "Argument `devices` cannot be used with a multi-worker cluster: "
                "MultiWorkerMirroredStrategy uses every local GPU (or the CPU) of each "
                "worker. Restrict GPUs with CUDA_VISIBLE_DEVICES instead. "
                f"Received: devices={list(devices)!r}"
            )
        return "multi_worker", None
    if kind == "multi_worker":
        raise ValueError(
            "Argument `kind` is 'multi_worker', but no multi-worker cluster is configured: "
            f"TF_CONFIG/Slurm describe {cluster.num_workers} worker. Set TF_CONFIG on "
            "every worker before calling keras_dist.strategy(), or start the script with "
            "`keras-dist launch --workers N script.py`."
        )
    explicit = devices is not None
    if devices is None:
        from keras_dist.devices import local_devices

        devices = local_devices()
    devices = tuple(devices)
    if kind == "one_device":
        if len(devices) != 1 and explicit:
            raise ValueError(
                "Argument `kind` is 'one_device', which takes exactly one device. "
                f"Received: devices={list(devices)!r}"
            )
        return "one_device", devices[:1]
    if kind == "mirrored":
        return "mirrored", devices
    return ("mirrored", devices) if len(devices) > 1 else ("default", devices)


def _build(kind, devices, cluster, implementation, bytes_per_pack, timeout_seconds):
    import tensorflow as tf

    if kind == "multi_worker":
        options = communication_options(implementation, bytes_per_pack, timeout_seconds)
        resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec({k: list(v) for k, v in cluster.cluster.items()}),
            task_type=cluster.task_type,
            task_id=cluster.task_index,
            rpc_layer=cluster.rpc_layer,
        )
        return tf.distribute.MultiWorkerMirroredStrategy(
            cluster_resolver=resolver, communication_options=options
        )
    if kind == "mirrored":
        cross_device_ops = _mirrored_cross_device_ops(devices, implementation,
                                                       bytes_per_pack)
        return tf.distribute.MirroredStrategy(
            devices=list(devices), cross_device_ops=cross_device_ops
        )
    if kind == "one_device":
        return tf.distribute.OneDeviceStrategy(devices[0])
    return tf.distribute.get_strategy()


def _mirrored_cross_device_ops(devices, implementation, bytes_per_pack):
    import tensorflow as tf

    on_gpu = all("GPU" in d.upper() for d in devices)
    if implementation == "nccl" and not on_gpu:
        raise ValueError(
            "Argument `implementation` is 'nccl', but the devices are not all GPUs "
            f"({list(devices)}); NCCL needs GPUs. Use 'auto' or 'ring'."
        )
    if implementation == "ring" or not on_gpu:
        # ReductionToOneDevice is what MirroredStrategy itself falls back to without
        # NCCL; for CPU/virtual devices it is the reliable, order-deterministic choice.
        return tf.distribute.ReductionToOneDevice()
    if implementation == "nccl":
        return tf.distribute.NcclAllReduce(num_packs=1)
    return None


def resolve_strategy(strategy=None):
    """The strategy a keras_dist function with `strategy=None` works with.

    In order: `strategy` itself when given; the strategy whose `scope()` is active; the
    one `keras_dist.strategy()` returned last in this process; TensorFlow's default
    strategy. So batch and data code written outside `scope()` still sees every replica.

    Raises:
        TypeError: `strategy` is given but is not a `tf.distribute.Strategy`.
    """
    import tensorflow as tf

    if strategy is not None:
        if not isinstance(strategy, tf.distribute.Strategy):
            raise TypeError(
                "Argument `strategy` must be a tf.distribute.Strategy (for example "
                f"keras_dist.strategy()) or None. Received: {type(strategy).__name__}"
            )
        return strategy
    if tf.distribute.has_strategy():
        return tf.distribute.get_strategy()
    latest = _runtime.latest()
    if latest is not None:
        return latest.strategy
    return tf.distribute.get_strategy()


def _info_lines() -> list[str]:
    """What `keras-dist info` prints: cluster, devices, the strategy `auto` would pick."""
    import keras
    import tensorflow as tf

    from keras_dist.devices import physical_devices

    cluster = ClusterConfig.from_env()
    lines = [
        f"keras_dist: TensorFlow {tf.__version__}, Keras {keras.__version__}",
        f"cluster: source={cluster.source} workers={cluster.num_workers} "
        f"task={cluster.task_type}:{cluster.task_index} chief={cluster.is_chief} "
        f"rank={cluster.worker_index}",
    ]
    for task_type, addresses in cluster.cluster.items():
        lines.append(f"  {task_type}: {', '.join(addresses)}")
    gpus = physical_devices("GPU")
    cpus = physical_devices("CPU")
    lines.append(f"devices: {len(gpus)} GPU(s) {gpus}, {len(cpus)} CPU(s)")
    if cluster.is_multi_worker:
        # Building a MultiWorkerMirroredStrategy would start its collective server and
        # wait for the peers; report the choice without doing that.
        replicas = cluster.num_workers * max(1, len(gpus))
        lines.append(
            f"strategy: MultiWorkerMirroredStrategy, {replicas} replica(s) in sync "
            f"({cluster.num_workers} worker(s) x {max(1, len(gpus))} device(s))"
        )
    else:
        chosen = strategy()
        lines.append(
            f"strategy: {type(chosen).__name__}, "
            f"{chosen.num_replicas_in_sync} replica(s) in sync"
        )
    return lines
