"""The TensorFlow `distribution_lib` Keras calls: devices, meshes, layouts, placement.

Device names follow Keras's JAX backend: `"cpu:K"` / `"gpu:K"`, K the global index over
every process of the job (process p's local device i is `p * local_count + i`), so a
`DeviceMesh` built from `list_devices()` means the same on both backends.
"""

from __future__ import annotations

import contextlib
import re
import threading

import numpy as np

_NAME = re.compile(r"^(cpu|gpu|tpu):(\d+)$")
_computing = threading.local()


def _tf():
    import tensorflow as tf

    return tf


def _dtensor():
    from tensorflow.experimental import dtensor

    return dtensor


def _default_type(device_type: str | None) -> str:
    if device_type:
        return device_type.upper()
    return "GPU" if _tf().config.list_physical_devices("GPU") else "CPU"


def _addresses(job_addresses) -> list[str]:
    if isinstance(job_addresses, str):
        return [address.strip() for address in job_addresses.split(",") if address.strip()]
    return [str(address) for address in job_addresses]


def initialize(job_addresses=None, num_processes=None, process_id=None) -> None:
    """Joins this process to a multi-process DTensor job (`keras.distribution.initialize`).

    With no argument (and no `KERAS_DISTRIBUTION_*` variable), the job is read from
    TF_CONFIG / Slurm (`keras_dist.cluster.ClusterConfig`, as `keras-dist launch`,
    Kubernetes or Ray set it); a lone process has nothing to join. On TensorFlow every
    process's address is needed (JAX needs only the coordinator's). Call it before
    TensorFlow runs its first op.
    """
    import os

    if job_addresses is None and num_processes is None and process_id is None:
        from keras_dist.cluster import ClusterConfig

        cluster = ClusterConfig.from_env()
        if not cluster.is_multi_worker:
            return
        if cluster.cluster.get("chief"):
            # Every process raises the same error at once: no process waits for a peer.
            raise ValueError(
                "keras.distribution.initialize(): this TF_CONFIG has a 'chief' task "
                f"(cluster: {dict(cluster.cluster)}), as a Kubeflow TFJob with a Chief "
                "replica sets. keras.distribution on TensorFlow runs on DTensor, whose "
                "processes must all belong to one job. Use Worker replicas only (in the "
                "TFJob, replace the Chief replica by one more Worker: worker 0 then acts "
                "as the chief, keras_dist.is_chief() included), or train with "
                "keras_dist.strategy() (MultiWorkerMirroredStrategy), which takes a chief.")
        job_addresses = [address for task in ("chief", "worker")
                         for address in cluster.cluster.get(task, ())]
        num_processes, process_id = cluster.num_workers, cluster.worker_index
    addresses = _addresses(job_addresses or ())
    if num_processes is None:
        num_processes = len(addresses)
    if not isinstance(num_processes, int) or num_processes < 1:
        raise ValueError(f"keras.distribution.initialize: num_processes must be a positive "
                         f"integer. Received: num_processes={num_processes!r}.")
    if num_processes == 1:
        return
    if len(addresses) != num_processes:
        raise ValueError(
            f"keras.distribution.initialize: job_addresses must list every process's "
            f"'host:port' on the TensorFlow backend ({num_processes} for num_processes="
            f"{num_processes}). Received {len(addresses)}: {job_addresses!r}.")
    if not isinstance(process_id, int) or not 0 <= process_id < num_processes:
        raise ValueError(f"keras.distribution.initialize: process_id must be in 0.."
                         f"{num_processes - 1}. Received: process_id={process_id!r}.")
    os.environ.update(DTENSOR_JOBS=",".join(addresses), DTENSOR_JOB_NAME="worker",
                      DTENSOR_CLIENT_ID=str(process_id),
                      DTENSOR_NUM_CLIENTS=str(num_processes))
    try:
        _dtensor().initialize_accelerator_system(_default_type(None))
    except ValueError as error:
        if "Collective ops are already configured" in str(error):
            # `import keras_dist` under this TF_CONFIG already started this worker's server
            # for exactly this job (keras_dist.startup.early_init): DTensor runs on it.
            return
        if "already been initialized" in str(error):
            raise ValueError(
                "keras.distribution.initialize() must run before TensorFlow runs its first "
                "op (creating a tensor, a dataset or a model, or listing logical devices). "
                "Call it at the top of the script, right after the imports.") from None
        raise


def _local_count(kind: str) -> int:
    """This process's logical devices of `kind` (a started server also lists its peers')."""
    tf = _tf()
    devices = tf.config.list_logical_devices(kind)
    if num_processes() == 1:
        return len(devices)
    job, task = _dtensor().job_name(), process_id()
    specs = [tf.DeviceSpec.from_string(device.name) for device in devices]
    return sum(spec.job in (job, "localhost", None) and spec.task in (task, None)
               for spec in specs)


def num_processes() -> int:
    """Processes in the job (DTensor clients); 1 before `initialize()` in a lone process."""
    return _dtensor().num_clients()


def process_id() -> int:
    """This process's index in the job (its DTensor client id)."""
    return _dtensor().client_id()


def list_devices(device_type: str | None = None) -> list[str]:
    """Every device of the job of `device_type` (default: GPUs if any, else CPUs)."""
    kind = _default_type(device_type)
    return [f"{kind.lower()}:{index}" for index in range(_local_count(kind) * num_processes())]


def get_device_count(device_type: str | None = None) -> int:
    return len(list_devices(device_type))


def _parse(name) -> tuple[str, int]:
    match = _NAME.match(str(name).lower())
    if match is None:
        raise ValueError(
            f"DeviceMesh device {name!r}: expected a name from "
            "keras.distribution.list_devices(), such as 'cpu:0' or 'gpu:3'.")
    return match.group(1).upper(), int(match.group(2))


def _to_backend_mesh(device_mesh):
    """The `dtensor.Mesh` of a Keras `DeviceMesh` (axis names, shape and device order kept)."""
    dtensor = _dtensor()
    parsed = [_parse(name) for name in np.asarray(device_mesh.devices).flatten()]
    kinds = {kind for kind, _ in parsed}
    if len(kinds) != 1:
        raise ValueError(f"DeviceMesh {device_mesh.shape}: devices of one type expected, got "
                         f"{sorted(kinds)}.")
    kind = kinds.pop()
    local_count = _local_count(kind)
    available = local_count * num_processes()
    ids = [index for _, index in parsed]
    if len(set(ids)) != len(ids):
        raise ValueError(f"DeviceMesh {device_mesh.shape}: a device appears twice.")
    if max(ids) >= available:
        raise ValueError(
            f"DeviceMesh {tuple(device_mesh.shape)} needs {len(ids)} {kind} devices up to "
            f"{kind.lower()}:{max(ids)}; this job has {available} "
            f"({num_processes()} process(es) x {local_count}). Use a smaller mesh, or "
            f"keras_dist.virtual_devices(n) before TensorFlow starts.")
    # DTensor numbers mesh positions 0..n-1 in row-major order; which device sits at a
    # position is given by the local device list, so any order of devices is kept.
    first = process_id() * local_count
    positions = [p for p, index in enumerate(ids) if first <= index < first + local_count]
    job = dtensor.job_name() if num_processes() > 1 else "localhost"
    task = process_id() if num_processes() > 1 else 0
    local_devices = [f"/job:{job}/replica:0/task:{task}/device:{kind}:{ids[p] - first}"
                     for p in positions]
    return dtensor.Mesh(list(device_mesh.axis_names),
                        np.arange(len(ids), dtype=np.int64).reshape(device_mesh.shape),
                        positions, local_devices)


def _to_backend_layout(tensor_layout):
    """The `dtensor.Layout` of a Keras `TensorLayout`."""
    dtensor = _dtensor()
    if tensor_layout.device_mesh is None:
        raise ValueError("Cannot convert a TensorLayout whose device mesh is not set; "
                         "give it a DeviceMesh (or put it in a LayoutMap).")
    specs = [axis if axis else dtensor.UNSHARDED for axis in tensor_layout.axes]
    return dtensor.Layout(specs, tensor_layout.device_mesh.backend_mesh)


def _backend(layout):
    from keras.src.distribution.distribution_lib import TensorLayout

    return layout.backend_layout if isinstance(layout, TensorLayout) else layout


def is_dtensor(value) -> bool:
    tf = _tf()
    if not isinstance(value, (tf.Tensor, tf.Variable)):
        return False
    try:
        return _dtensor().is_dtensor(value)
    except (TypeError, ValueError, AttributeError):
        return False


def distribute_tensor(tensor, layout):
    """`tensor` (or a nested structure of tensors) laid out as `layout` (a Keras
    `TensorLayout` or a `dtensor.Layout`).

    Eagerly, a regular tensor is placed on the mesh (it must hold the same, full value in
    every process). In a function traced on the mesh (a step of `fit`, a layer's
    `"<path>/output"` layout) the tensor is relayouted; in a function traced off the mesh
    (a model whose weights are not on it) it is returned unchanged, as Keras's
    `KerasTensor`s are.
    """
    tf, dtensor = _tf(), _dtensor()
    layout = _backend(layout)
    if layout is None:
        return tensor
    if not isinstance(tensor, (tf.Tensor, tf.Variable)):
        if isinstance(tensor, (list, tuple, dict)):
            return tf.nest.map_structure(lambda t: distribute_tensor(t, layout), tensor)
        tensor = tf.convert_to_tensor(tensor)
    if tensor.shape.rank is not None and tensor.shape.rank != layout.rank:
        raise ValueError(
            f"A layout of {layout.rank} dimensions ({list(layout.sharding_specs)}) cannot "
            f"lay out a tensor of shape {tuple(tensor.shape)} (rank {tensor.shape.rank}). "
            "Give one mesh axis (or None) per dimension of the tensor (a LayoutMap "
            "'<layer>/output' key lays out that layer's output).")
    if not tf.executing_eagerly():
        return tensor if current_mesh() is None else dtensor.relayout(tensor, layout)
    if not is_dtensor(tensor):
        tensor = replicated(tensor, layout.mesh)
    return dtensor.relayout(tensor, layout)


def replicated(tensor, mesh):
    """`tensor` (a regular tensor, the same in every process) whole on every device of
    `mesh`."""
    tensor = _tf().convert_to_tensor(tensor)
    dtensor = _dtensor()
    return dtensor.copy_to_mesh(tensor, dtensor.Layout.replicated(mesh, tensor.shape.rank))


def whole(value):
    """This process's copy of the whole value of a DTensor (gathered if it is sharded)."""
    dtensor = _dtensor()
    layout = dtensor.fetch_layout(value)
    if not layout.is_fully_replicated():
        value = dtensor.relayout(value, dtensor.Layout.replicated(layout.mesh, layout.rank))
    return dtensor.unpack(value)[0]


def distribute_data_input(per_process_batch, layout, batch_dim_name):
    """A global, batch-sharded DTensor from this process's rows of the global batch.

    Process p's rows are the shards of the batch axis its local devices hold, in order
    (as `jax.make_array_from_process_local_data`); on one process, the whole batch.
    """
    tf, dtensor = _tf(), _dtensor()
    layout = _backend(layout)
    if num_processes() == 1:
        return distribute_tensor(per_process_batch, layout)
    coords = [location[batch_dim_name] for location in layout.mesh.local_device_locations()]
    shards = sorted(set(coords))
    pieces = tf.split(tf.convert_to_tensor(per_process_batch), len(shards), axis=0)
    return dtensor.pack([pieces[shards.index(c)] for c in coords], layout)


@contextlib.contextmanager
def computing_on(mesh):
    """Marks the code run (or traced) inside as computing on the DTensor `mesh`."""
    stack = _computing.__dict__.setdefault("meshes", [])
    stack.append(mesh)
    try:
        yield
    finally:
        stack.pop()


def current_mesh():
    """The DTensor mesh the code being run or traced computes on (None: off the mesh).

    Set around keras_dist's own steps (`computing_on`); in any other function being traced
    (keras-hub's `generate`, a user's `tf.function`), the mesh of a DTensor variable read
    in it so far (`mark_graph`): a function that reads one runs on the DTensor device.
    """
    stack = getattr(_computing, "meshes", None)
    if stack:
        return stack[-1]
    tf = _tf()
    if tf.executing_eagerly():
        return None
    for graph in _function_graphs():
        mesh = getattr(graph, "_keras_dist_mesh", None)
        if mesh is not None:
            return mesh
    return None


def _function_graphs():
    """The function graph being traced, then those enclosing it (not the global graph)."""
    from tensorflow.python.framework import func_graph

    graph = _tf().compat.v1.get_default_graph()
    while isinstance(graph, func_graph.FuncGraph):
        yield graph
        graph = graph.outer_graph


def mark_graph(mesh) -> None:
    """Records that the function being traced (and those enclosing it) runs on `mesh`."""
    for graph in _function_graphs():
        if getattr(graph, "_keras_dist_mesh", None) is not None:
            break
        graph._keras_dist_mesh = mesh


def replicate(tensor, mesh):
    """`tensor` whole on every device of `mesh`, eagerly or in a function traced on it."""
    tf, dtensor = _tf(), _dtensor()
    tensor = tf.convert_to_tensor(tensor)
    layout = dtensor.Layout.replicated(mesh, tensor.shape.rank)
    if tf.executing_eagerly():
        return distribute_tensor(tensor, layout)
    return dtensor.relayout(tensor, layout)
