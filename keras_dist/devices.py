"""Devices: list the accelerators, and split one into virtual devices for tests.

`virtual_devices(n)` turns the first GPU (or, without a GPU, the CPU) into `n` logical
devices, so MirroredStrategy can be exercised with several replicas on a laptop, in CI or
in a notebook. TensorFlow fixes the logical device layout when its runtime initialises
(the first op, or the first `tf.config.list_logical_devices()`), so this must run first.
"""

from __future__ import annotations

import shutil
import subprocess

from keras_dist import _validation

__all__ = ["virtual_devices", "physical_devices", "local_devices"]

_DEVICE_TYPES = ("CPU", "GPU")
# Leave headroom on a split GPU for the CUDA context and cuDNN workspaces, which live
# outside the per-device memory limit.
_GPU_MEMORY_FRACTION = 0.9
_FALLBACK_GPU_MEMORY_MB = 4096


def _check_device_type(device_type: str | None) -> str | None:
    if device_type is None:
        return None
    if not isinstance(device_type, str) or device_type.upper() not in _DEVICE_TYPES:
        raise ValueError(
            f"Argument `device_type` must be 'CPU', 'GPU' or None (first GPU, else CPU). "
            f"Received: device_type={device_type!r}"
        )
    return device_type.upper()


def physical_devices(device_type: str | None = None) -> list[str]:
    """Names of the physical devices TensorFlow sees (does not initialise the runtime).

    Args:
        device_type: `"GPU"`, `"CPU"`, or `None` for all.

    Returns:
        Names such as `"/physical_device:GPU:0"`.
    """
    import tensorflow as tf

    device_type = _check_device_type(device_type)
    return [d.name for d in tf.config.list_physical_devices(device_type)]


def local_devices(device_type: str | None = None) -> list[str]:
    """Names of this process's logical devices (initialises the TF runtime).

    With no `device_type`, the GPUs if there are any, else the CPUs: the devices a
    MirroredStrategy on this machine would replicate over. In a multi-worker job
    TensorFlow also lists the other workers' devices once the collective server runs;
    only this worker's are returned.

    Args:
        device_type: `"GPU"`, `"CPU"`, or `None` for the GPUs, else the CPUs.

    Returns:
        Names such as `"/job:localhost/replica:0/task:0/device:GPU:0"` (alone) or
        `"/job:worker/replica:0/task:1/device:CPU:0"` (worker 1 of a job).

    Raises:
        ValueError: `device_type` is not `"CPU"`, `"GPU"` or `None`.

    Example:
        >>> import keras_dist
        >>> keras_dist.local_devices("CPU")
        ['/job:localhost/replica:0/task:0/device:CPU:0']
    """
    device_type = _check_device_type(device_type)
    if device_type is None:
        return _own_logical_devices("GPU") or _own_logical_devices("CPU")
    return _own_logical_devices(device_type)


def _own_logical_devices(device_type: str) -> list[str]:
    import tensorflow as tf

    from keras_dist import _runtime

    names = []
    for device in tf.config.list_logical_devices(device_type):
        spec = tf.DeviceSpec.from_string(device.name)
        if spec.job not in (None, "localhost"):
            # Only a multi-worker server names jobs; ask for the cluster only then.
            cluster = _runtime.cluster()
            if (spec.job, spec.task or 0) != (cluster.task_type, cluster.task_index):
                continue
        names.append(device.name)
    return names


def virtual_devices(
    n: int, device_type: str | None = None, *, memory_limit_mb: int | None = None
) -> list[str]:
    """Splits the first GPU (or the CPU) into `n` logical devices and returns their names.

    Use it at the top of a test, script or notebook, before any other TensorFlow call, to
    get `n` replicas from `keras_dist.strategy()` on one device. On a GPU the memory is
    split evenly (90% of the card, or `memory_limit_mb` per device). Calling it again with
    the same `n` after the runtime started returns the same names (so a notebook cell can
    be re-run).

    Args:
        n: Number of logical devices, >= 1.
        device_type: `"GPU"`, `"CPU"`, or `None` for the first GPU if any, else the CPU.
        memory_limit_mb: Memory per logical GPU in MiB; default an even split.

    Returns:
        Device names usable as `keras_dist.strategy(devices=...)`, e.g.
        `["/device:CPU:0", "/device:CPU:1"]`.

    Raises:
        ValueError: `n` is not a positive integer, or `device_type` is unknown or absent.
        RuntimeError: The TensorFlow runtime already initialised with another layout.

    Example:
        >>> import keras_dist
        >>> keras_dist.virtual_devices(2, "CPU")
        ['/device:CPU:0', '/device:CPU:1']
    """
    n = _validation.check_int("n", n, 1)
    if memory_limit_mb is not None and not (
            _validation.is_int(memory_limit_mb) and memory_limit_mb >= 1):
        raise ValueError(_validation.message("memory_limit_mb", "a positive integer or None",
                                             memory_limit_mb))
    import tensorflow as tf

    device_type = _check_device_type(device_type)
    if device_type is None:
        device_type = "GPU" if tf.config.list_physical_devices("GPU") else "CPU"
    physical = tf.config.list_physical_devices(device_type)
    if not physical:
        raise ValueError(
            f"Argument `device_type` is {device_type!r}, but TensorFlow sees no "
            f"{device_type} device on this machine. Use device_type='CPU' or None."
        )
    names = [f"/device:{device_type}:{i}" for i in range(n)]
    current = tf.config.get_logical_device_configuration(physical[0])
    if current is None or len(current) != n:
        _split_first_device(physical[0], device_type, n, memory_limit_mb, current)
    return names


def _split_first_device(first, device_type, n, memory_limit_mb, current) -> None:
    """Splits physical device `first` into `n` logical ones (before TF initialises)."""
    import tensorflow as tf

    if device_type == "GPU":
        per_device = memory_limit_mb or max(
            1, int(_gpu_total_memory_mb(0) * _GPU_MEMORY_FRACTION) // n
        )
        config = [tf.config.LogicalDeviceConfiguration(memory_limit=per_device)] * n
    else:
        config = [tf.config.LogicalDeviceConfiguration()] * n
    try:
        tf.config.set_logical_device_configuration(first, config)
    except RuntimeError as error:
        existing = len(current) if current else 1
        raise RuntimeError(
            f"keras_dist.virtual_devices({n}) must run before TensorFlow initialises its "
            f"runtime: the logical {device_type} layout ({existing} device(s)) is fixed "
            "by the first TensorFlow op or device listing and cannot change afterwards. "
            "Call virtual_devices() at the top of the script, or restart the notebook "
            f"kernel and call it first. (TensorFlow said: {error})"
        ) from None
    from keras_dist.startup import early_init as _early_init

    # In a multi-worker job the server that the first op starts creates the devices
    # from the definition recorded at import; it must see the new layout.
    _early_init.refresh_server_def()


def _gpu_total_memory_mb(index: int) -> int:
    """Total memory of GPU `index` in MiB, asking nvidia-smi (which does not touch TF)."""
    if shutil.which("nvidia-smi") is None:
        return _FALLBACK_GPU_MEMORY_MB
    try:
        output = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=20, check=True,
        ).stdout.split()
        return int(float(output[index]))
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return _FALLBACK_GPU_MEMORY_MB
