"""The strategy factory: one call picks and builds the right `tf.distribute.Strategy`.

`strategy()` reads the cluster (`ClusterConfig.from_env()`) and the local devices and
returns a real TensorFlow strategy:

* more than one worker in the cluster -> `MultiWorkerMirroredStrategy` (RING collectives
  on CPU, NCCL where asked and available), with `CommunicationOptions`;
* one worker -> `MirroredStrategy` over its GPUs or virtual devices, or over its one
  device (like `tf.distribute.MirroredStrategy()` on a one-GPU or CPU machine: Keras then
  builds optimizers and variables as under any strategy, not lazily inside the step).

Every strategy it returns has a `cluster_resolver` (task type and id `None` in one
process, as `MultiWorkerMirroredStrategy` has there), so code written for multi-worker
training runs unchanged (`keras_dist.strategies.one_device`).

It also applies keras_dist's Keras 3 compatibility fixes (`keras_dist.compat`) once, and it
remembers what it built: `MultiWorkerMirroredStrategy` must be created once per process,
and every keras_dist function with `strategy=None` resolves to it (`resolve_strategy`).
"""

from __future__ import annotations

from typing import Sequence

from keras_dist import _runtime
from keras_dist.cluster import ClusterConfig
from keras_dist.startup import early_init
from keras_dist.startup import rendezvous as _rendezvous
from keras_dist.strategies.args import (
    _normalized_implementation,
    _second_multi_worker_message,
    _validate,
)
from keras_dist.strategies.communication import communication_options, resolve_bytes_per_pack

__all__ = ["strategy", "resolve_strategy"]


def strategy(
    kind: str = "auto",
    *,
    devices: Sequence[str] | None = None,
    implementation: str = "auto",
    bytes_per_pack: int | str = "auto",
    timeout_seconds: float | None = None,
    cross_device_ops=None,
    startup_timeout_seconds: float | None = None,
):
    """Creates (once) and returns the `tf.distribute.Strategy` for this process.

    Call it after setting `TF_CONFIG` (or under Slurm or `keras-dist launch`) and
    `keras_dist.virtual_devices()`, before building the model. Datasets and tensors may
    come first, also in a multi-worker job, if `import keras_dist` came before the first
    TensorFlow op. Arguments that resolve to the same strategy return the same object.

    Args:
        kind: `"auto"` (choose from the cluster and devices), or force `"mirrored"`,
            `"multi_worker"` or `"one_device"`.
        devices: Local devices to replicate over (Mirrored) or the one device
            (one_device). Default: all GPUs, else all logical CPUs if more than one.
        implementation: All-reduce implementation: `"auto"`, `"ring"` or `"nccl"`.
            On CPU-only workers `"auto"` means RING.
        bytes_per_pack: Multi-worker all-reduce bucket size: gradients are all-reduced
            in packs of about this many bytes, last layer first, each as soon as its
            gradients exist (overlapping the backward pass). `"auto"` (default):
            `keras_dist.strategies.communication.DEFAULT_BYTES_PER_PACK` (README,
            "Overlap"); 0: one pack after the last gradient (TensorFlow's default).
        timeout_seconds: Abort a collective that has not finished after this long, so a
            peer that is alive but stuck becomes `tf.errors.DeadlineExceededError`
            instead of a hang. None (the default): no per-collective timeout, which is
            deliberate (a dead peer is detected without it; a timeout costs a sleeping
            thread per collective): see `keras_dist.strategies.communication`.
        cross_device_ops: A `tf.distribute.CrossDeviceOps` instance for
            `MirroredStrategy` (e.g. `tf.distribute.HierarchicalCopyAllReduce()`), as
            `tf.distribute.MirroredStrategy(cross_device_ops=...)` takes; only with
            `kind="auto"`/`"mirrored"` in one process and `implementation="auto"`. The
            same instance gives back the same strategy.
        startup_timeout_seconds: In a multi-worker job, how long to wait for every peer
            before raising `keras_dist.startup.rendezvous.StartupError` naming the missing ones;
            None: `KERAS_DIST_STARTUP_TIMEOUT`, else 600 s. A duplicate task index or a
            port in use is an error within seconds; SIGTERM/SIGINT end the wait.

    Returns:
        A `tf.distribute.MultiWorkerMirroredStrategy`, or (in one process) a
        `tf.distribute.MirroredStrategy` or `tf.distribute.OneDeviceStrategy` subclass
        whose `cluster_resolver` describes the lone process.

    Raises:
        ValueError: An argument is invalid, or `kind` contradicts the cluster/devices.
        keras_dist.ClusterConfigError: TF_CONFIG or the Slurm variables are invalid.
        RuntimeError: A multi-worker strategy with other settings already exists in this
            process (the message names the differing arguments), or TensorFlow ran an op
            before `import keras_dist` in a multi-worker job (the message says what to
            move).

    Example:
        >>> import keras, keras_dist
        >>> with keras_dist.strategy().scope():
        ...     model = keras.Sequential([keras.layers.Dense(10)])
        ...     model.compile(optimizer="sgd", loss="mse")
    """
    _validate(kind, devices, implementation, bytes_per_pack, timeout_seconds,
              cross_device_ops)
    _rendezvous.check_argument(startup_timeout_seconds)
    cluster = ClusterConfig.from_env()
    _check_cross_device_ops(cross_device_ops, cluster)
    resolved_kind, resolved_devices = _choose(kind, devices, cluster)
    implementation = _normalized_implementation(implementation)
    bytes_per_pack = resolve_bytes_per_pack(bytes_per_pack)
    # CrossDeviceOps compare by identity: the same instance, the same strategy.
    key = (resolved_kind, resolved_devices, implementation, bytes_per_pack,
           timeout_seconds, cluster, cross_device_ops)
    # The most recently requested strategy is the one `strategy=None` means.
    existing = _runtime.find(key)
    if existing is None:
        return _create(key, startup_timeout_seconds)
    _apply_fixes()  # also for a strategy made before: fixes reverted since come back
    return existing.strategy


def _apply_fixes() -> None:
    """keras_dist's compat fixes, each applied once (a no-op for those already applied)."""
    from keras_dist import compat

    compat.apply()


def _check_cross_device_ops(cross_device_ops, cluster) -> None:
    if cross_device_ops is not None and cluster.is_multi_worker:
        raise ValueError(
            f"Argument `cross_device_ops` only applies to MirroredStrategy, but the cluster "
            f"({cluster.source}) has {cluster.num_workers} workers, so keras_dist.strategy() "
            "builds a MultiWorkerMirroredStrategy. Choose its all-reduce with "
            "`implementation` instead. "
            f"Received: cross_device_ops={cross_device_ops!r}"
        )


def _create(key, startup_timeout_seconds):
    """Builds and remembers the strategy `key` describes (one multi-worker per process)."""
    kind, devices, implementation, bytes_per_pack, timeout_seconds, cluster, ops = key
    for created in _runtime.created():
        if created.kind == "multi_worker":
            raise RuntimeError(_second_multi_worker_message(created.key, key))
    if kind == "multi_worker":
        # Before anything runs an op: TensorFlow's own wait for peers has no deadline.
        _rendezvous.meet_peers(cluster, startup_timeout_seconds,
                               before_wait=early_init.check_startup)
    _apply_fixes()
    built = _build(kind, devices, cluster, implementation, bytes_per_pack, timeout_seconds,
                   ops)
    _runtime.remember(_runtime.Created(key=key, strategy=built, kind=kind, cluster=cluster))
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
    # One device too: `tf.distribute.MirroredStrategy()` does the same on a one-GPU or
    # CPU machine, and Keras relies on a strategy to build optimizer slots eagerly
    # (without one it builds them inside the traced step, which breaks for models
    # around a `TFSMLayer`: "'..._kernel:0_momentum' is not a valid scope name").
    return "mirrored", devices


def _build(kind, devices, cluster, implementation, bytes_per_pack, timeout_seconds,
           cross_device_ops=None):
    import tensorflow as tf

    if kind == "multi_worker":
        options = communication_options(implementation, bytes_per_pack, timeout_seconds)
        resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec({k: list(v) for k, v in cluster.cluster.items()}),
            task_type=cluster.task_type,
            task_id=cluster.task_index,
            rpc_layer=cluster.rpc_layer,
        )
        try:
            created = tf.distribute.MultiWorkerMirroredStrategy(
                cluster_resolver=resolver, communication_options=options
            )
        except (RuntimeError, ValueError) as error:
            explained = early_init.startup_error(cluster, error)
            if explained is None:
                raise
            raise explained from None
        _all_workers_ready()
        return created
    from keras_dist.strategies import one_device

    resolver = one_device.cluster_resolver_for(cluster)
    if kind == "mirrored":
        if cross_device_ops is None:
            cross_device_ops = _mirrored_cross_device_ops(devices, implementation,
                                                           bytes_per_pack)
        return one_device.MirroredStrategy(
            devices=list(devices), cross_device_ops=cross_device_ops,
            cluster_resolver=resolver,
        )
    return one_device.OneDeviceStrategy(devices[0], cluster_resolver=resolver)


def _all_workers_ready() -> None:
    """Returns once every worker has finished creating its MultiWorkerMirroredStrategy.

    When a TensorFlow op ran before `strategy()` (the tutorials' data-before-strategy
    order), the runtime is already started and `MultiWorkerMirroredStrategy` re-enables
    collective ops on it ("Enabling collective ops after program startup"). A worker that
    is done first and starts a collective (the broadcast of the first variable's initial
    value) while its peer is still re-enabling hangs both in that broadcast (seen 2 runs
    in 5 on 2 CPU cores). A coordination-service barrier after creation closes the race;
    it costs one round trip at start-up.
    """
    from keras_dist.compat import coordination

    if not coordination.available():
        return
    coordination.wait_at_barrier(
        "keras_dist-strategy-ready",
        _rendezvous.startup_timeout(None))


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
