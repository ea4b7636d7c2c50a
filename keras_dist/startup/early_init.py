"""Prepare TensorFlow for multi-worker collectives at import time, under a multi-worker job only.

TensorFlow fixes a process's collective-ops settings and its device names when its runtime
initialises, at the first op. `MultiWorkerMirroredStrategy()` sets them when it is created,
so a script that builds a `tf.data` pipeline or a tensor first (as TensorFlow's tutorials
do) dies with "Collective ops must be configured at program startup" (TensorFlow's TODO
b/129298253); and even where that is avoided, the tensors made before the strategy live on
`/job:localhost` devices that vanish when the strategy starts the worker's server ("unknown
device"). So while `import keras_dist` runs, before any op, this module hands TensorFlow
exactly what the strategy will: the collective-ops settings, the coordination service and
the server definition of this task. The first op then starts this task's server (it waits
for the peers, as creating the strategy does), tensors and datasets are born on this
worker's devices, and the strategy's own calls later find everything already in place.

This is house rule 4's one sanctioned import-time side effect. It happens only when
`ClusterConfig.from_env()` describes more than one worker (TF_CONFIG or a Slurm job); a lone
process is untouched (TensorFlow is not even imported), and the runtime is never
initialised here, so `keras_dist.virtual_devices()` still works after `import keras_dist`.
A bad TF_CONFIG is left for `keras_dist.strategy()` to report.

The first op then starts the server; `_meet_peers_before_the_first_op` makes it meet the
peers first (`keras_dist.startup.rendezvous`: a deadline, missing workers named, SIGTERM
honoured), and `check_startup` (which the rendezvous runs before it waits; both of its
callers pass it) raises TensorFlow's certain "configured at program startup" error,
explained, before any wait.

Every private TensorFlow symbol it uses is in `_configure_collectives`, `_server_def` and
`_meet_peers_before_the_first_op` (there is no public API for any of this).
"""

from __future__ import annotations

import dataclasses

from keras_dist.cluster import ClusterConfig, ClusterConfigError

# TensorFlow's own literal in CollectiveAllReduceExtended._initialize_multi_worker; the
# values must be equal to TF's, or TF raises "Collective ops are already configured".
_SCOPED_ALLOCATOR_OPS = ("CollectiveReduce",)
_STARTUP_MESSAGE = "Collective ops must be configured at program startup"


@dataclasses.dataclass(frozen=True)
class EarlyInitState:
    """What the import-time hook did, for `strategy()`'s error messages.

    Attributes:
        cluster: The multi-worker cluster seen at import, or None.
        configured: True when TensorFlow was prepared before its first op.
        too_late: True when TensorFlow had already run an op before `import keras_dist`.
    """

    cluster: ClusterConfig | None = None
    configured: bool = False
    too_late: bool = False


state = EarlyInitState()


def configure_collectives_at_import() -> EarlyInitState:
    """Prepares TensorFlow for this task when the environment is a multi-worker job.

    Never raises: a bad cluster description or an unexpected TensorFlow version leaves
    TensorFlow untouched, and `keras_dist.strategy()` reports the problem.

    Returns:
        The `EarlyInitState`, also stored in the module's `state`.
    """
    global state
    try:
        cluster = ClusterConfig.from_env()
    except ClusterConfigError:
        return state
    if not cluster.is_multi_worker:
        return state
    try:
        _configure_collectives(cluster)
    except RuntimeError:
        state = EarlyInitState(cluster=cluster, too_late=True)
    except ValueError:
        # Already configured differently by the user: TensorFlow's own behaviour stays.
        state = EarlyInitState(cluster=cluster)
    except (ImportError, AttributeError, TypeError):
        # A TensorFlow without these internals: its own behaviour stays, said once.
        _warn_internals_changed()
        state = EarlyInitState(cluster=cluster)
    else:
        state = EarlyInitState(cluster=cluster, configured=True)
        _meet_peers_before_the_first_op(cluster)
    return state


def _warn_internals_changed() -> None:
    """Names the changed TensorFlow internals (compat registry group "startup")."""
    import warnings

    from keras_dist.compat import registry

    found = registry.problems(groups=["startup"])
    details = "; ".join(f"{name}: {problem}" for name, problem in found.items())
    warnings.warn(
        "keras_dist could not prepare TensorFlow's collectives at import (TensorFlow "
        f"internals changed: {details or 'see keras_dist.compat.registry'}); datasets "
        "or tensors made before keras_dist.strategy() will fail under this multi-worker "
        "job, and the start-up deadline covers strategy() only.", RuntimeWarning,
        stacklevel=3)


def check_startup(cluster: ClusterConfig) -> None:
    """Raises what `MultiWorkerMirroredStrategy` would, explained, before any wait for peers.

    Run by the rendezvous before it waits (`meet_peers(..., before_wait=check_startup)`):
    TensorFlow's "configured at program startup" error (an op ran before
    `import keras_dist`, or the cluster changed after it) is certain before the peers are
    met, so the user learns it at once instead of after the startup timeout. When
    TensorFlow has not run an op yet, this prepares it exactly as the import-time hook
    does (the cluster was set after `import keras_dist`).
    """
    global state
    if state.configured and state.cluster == cluster:
        return
    try:
        _configure_collectives(cluster)
    except (RuntimeError, ValueError) as error:
        explained = startup_error(cluster, error)
        if explained is None:
            raise
        raise explained from None
    except (ImportError, AttributeError, TypeError):
        return  # a TensorFlow without these internals: its own behaviour stays
    state = EarlyInitState(cluster=cluster, configured=True)
    _meet_peers_before_the_first_op(cluster)


def refresh_server_def() -> None:
    """Re-records the server definition after the device layout changed before startup.

    The server that the first op starts creates this task's devices from the recorded
    definition, so `keras_dist.virtual_devices()` calls this after changing the layout.
    """
    if state.configured:
        from tensorflow.python.eager import context

        context.context().enable_collective_ops(_server_def(state.cluster))


def startup_error(cluster: ClusterConfig, error: Exception) -> RuntimeError | None:
    """keras_dist's explanation of TensorFlow's 'configured at program startup' error."""
    if _STARTUP_MESSAGE not in str(error) and "already configured" not in str(error):
        return None
    if state.too_late:
        what = (
            "TensorFlow ran an op (a tensor, a tf.data pipeline, a device listing) "
            "before `import keras_dist`, so keras_dist could not prepare its collective "
            "ops. Move `import keras_dist` above the first TensorFlow op"
        )
    elif state.cluster != cluster:
        what = (
            f"the cluster changed after `import keras_dist` (at import: "
            f"{_describe(state.cluster)}; now: {_describe(cluster)}) and TensorFlow ran "
            "an op before keras_dist.strategy(). Set TF_CONFIG (or the Slurm variables) "
            "in the environment before the script starts, or before `import keras_dist`"
        )
    else:
        what = "TensorFlow's collective ops were configured by other code first"
    return RuntimeError(
        f"keras_dist.strategy() cannot start the multi-worker strategy: {what}, or call "
        "keras_dist.strategy() before building tensors or datasets. "
        f"(TensorFlow said: {error})"
    )


def _meet_peers_before_the_first_op(cluster: ClusterConfig) -> None:
    """The first op starts this task's server: meet the peers first, with a deadline.

    With collectives configured here, whatever runs TensorFlow's first op (a dataset built
    before `keras_dist.strategy()`, as TensorFlow's tutorials do) starts the gRPC server
    and waits inside TensorFlow for every peer: no deadline, no name for a missing peer,
    deaf to SIGTERM. So the first call of `Context.ensure_initialized` (every op's way
    to the runtime) first runs `keras_dist.startup.rendezvous.meet_peers` (deadline
    `KERAS_DIST_STARTUP_TIMEOUT`, the missing workers named, SIGTERM/SIGINT honoured),
    then puts the original method back and starts the runtime; afterwards SIGTERM is
    given back to Python's handler (TensorFlow's server installs its own, which only
    records the signal). Private TensorFlow symbol: `Context.ensure_initialized` of
    `tensorflow.python.eager.context` (wrapped once, on the class, then restored).
    """
    import threading

    from tensorflow.python.eager import context

    owner = context.Context
    original = owner.__dict__.get("ensure_initialized")
    if original is None or getattr(original, "_keras_dist_meets_peers", False):
        return
    lock = threading.Lock()
    failed: list = []

    def ensure_initialized(self):
        with lock:
            if failed:
                # Not a second wait (an op at exit, after SIGTERM or a failed start-up).
                raise RuntimeError("keras_dist: TensorFlow cannot start this worker: "
                                   f"meeting its peers failed earlier ({failed[0]})")
            if owner.__dict__.get("ensure_initialized") is ensure_initialized:
                from keras_dist.startup import rendezvous, signal_watcher

                try:
                    rendezvous.meet_peers(
                        cluster, during="keras_dist (TensorFlow's first op, which starts "
                        "this worker's server before keras_dist.strategy())",
                        before_wait=check_startup)
                except BaseException as error:
                    failed.append(f"{type(error).__name__}: {error}")
                    raise
                owner.ensure_initialized = original
                original(self)
                signal_watcher.after_server_start(cluster)
        return original(self)

    ensure_initialized._keras_dist_meets_peers = True
    ensure_initialized.__doc__ = original.__doc__
    owner.ensure_initialized = ensure_initialized


def _describe(cluster: ClusterConfig | None) -> str:
    if cluster is None:
        return "no multi-worker cluster"
    return f"{cluster.num_workers} workers, this task {cluster.task_type}:{cluster.task_index}"


def _configure_collectives(cluster: ClusterConfig) -> None:
    """Applies `MultiWorkerMirroredStrategy`'s settings before the first op.

    Private TensorFlow symbols (no public API exists): the methods
    `configure_collective_ops`, `configure_coordination_service` and
    `enable_collective_ops` of `tensorflow.python.eager.context.context()`;
    `tensorflow.python.distribute.multi_worker_util.collective_leader` /
    `coordination_leader` (so the values are TF's); the protos
    `tensorflow.compiler.xla.tsl.protobuf.coordination_config_pb2.CoordinatedJob`.
    """
    from tensorflow.compiler.xla.tsl.protobuf import coordination_config_pb2
    from tensorflow.python.distribute import multi_worker_util
    from tensorflow.python.eager import context

    cluster_spec = _cluster_spec(cluster)
    task_type, task_id = cluster.task_type, cluster.task_index
    runtime = context.context()
    runtime.configure_collective_ops(
        collective_leader=multi_worker_util.collective_leader(
            cluster_spec, task_type, task_id
        ),
        scoped_allocator_enabled_ops=_SCOPED_ALLOCATOR_OPS,
        device_filters=(f"/job:{task_type}/task:{task_id}",),
    )
    if runtime.coordination_service is None:
        # The coordination service turns a dead peer into an error on the survivors;
        # configured after startup it would not be effective.
        runtime.configure_coordination_service(
            service_type="standalone",
            service_leader=multi_worker_util.coordination_leader(cluster_spec),
            coordinated_jobs=[
                coordination_config_pb2.CoordinatedJob(
                    name=job, num_tasks=cluster_spec.num_tasks(job)
                )
                for job in ("chief", "worker")
                if job in cluster_spec.jobs
            ],
        )
    runtime.enable_collective_ops(_server_def(cluster))


def _cluster_spec(cluster: ClusterConfig):
    import tensorflow as tf

    return tf.train.ClusterSpec({k: list(v) for k, v in cluster.cluster.items()})


def _server_def(cluster: ClusterConfig):
    """The `ServerDef` `MultiWorkerMirroredStrategy` builds for this task."""
    from tensorflow.core.protobuf import tensorflow_server_pb2
    from tensorflow.python.eager import context

    return tensorflow_server_pb2.ServerDef(
        cluster=_cluster_spec(cluster).as_cluster_def(),
        default_session_config=context.context().config,
        job_name=cluster.task_type,
        task_index=cluster.task_index,
        protocol=cluster.rpc_layer or "grpc",
        port=0,
    )
