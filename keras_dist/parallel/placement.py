"""Which device holds which stage: device checks, the default devices, `device_map="auto"`.

`device_map="auto"` balances stages by what each device can hold: free memory on GPUs
(`tf.config.experimental.get_memory_info`: limit minus current use), and on CPU logical
devices, which report no memory, an equal share, so stages get equal parameter bytes.
"""

from __future__ import annotations

from typing import Sequence

from keras_dist import _validation


def available_devices() -> list[str]:
    """This process's logical GPUs, else its logical CPUs (as full device names)."""
    import tensorflow as tf

    devices = tf.config.list_logical_devices("GPU") or tf.config.list_logical_devices("CPU")
    return [_canonical(d.name) for d in devices]


def _canonical(name: str) -> str:
    import tensorflow as tf

    spec = tf.DeviceSpec.from_string(name)
    return f"/device:{spec.device_type}:{spec.device_index or 0}"


def _known_devices() -> list[str]:
    import tensorflow as tf

    return [_canonical(d.name) for d in tf.config.list_logical_devices()
            if d.device_type in ("CPU", "GPU")]


def resolve_devices(devices: Sequence[str] | str | None, num_stages: int) -> list[str]:
    """`devices` checked against this process's devices; None or "auto" -> the defaults.

    Raises:
        ValueError: The count differs from `num_stages`, or a device does not exist.
    """
    if devices is None or devices == "auto":
        known = available_devices()
        if len(known) < num_stages:
            raise ValueError(
                f"{num_stages} stages need {num_stages} devices, but this process has "
                f"{len(known)}: {known}. Pass `devices=` explicitly (a device may hold "
                f"several stages) or call keras_dist.virtual_devices({num_stages}) first.")
        return known[:num_stages]
    if isinstance(devices, str) or not isinstance(devices, Sequence):
        raise ValueError(_validation.message("devices", "a list of device names, "
                                             "'auto' or None", devices))
    if len(devices) != num_stages:
        raise ValueError(_validation.message(
            "devices", f"a list of {num_stages} device names, one per stage", list(devices),
            f"Got {len(devices)} devices for {num_stages} stages"))
    known = _known_devices()
    resolved = []
    for device in devices:
        try:
            name = _canonical(device)
        except (ValueError, TypeError):
            name = None
        if name not in known:
            raise ValueError(_validation.message(
                "devices", "names of devices of this process", list(devices),
                f"{device!r} does not exist; the devices are {known}"))
        resolved.append(name)
    return resolved


def device_capacities(devices: Sequence[str]) -> list[float]:
    """Relative capacity of each device: free bytes on GPUs, 1.0 each on CPUs."""
    import tensorflow as tf

    capacities = []
    for device in devices:
        if "GPU" in device.upper():
            info = tf.config.experimental.get_memory_info(device.replace("/device:", ""))
            limit = info.get("limit") or _logical_gpu_limit(device)
            # Without a known limit the devices are taken as equal.
            capacities.append(float(max(limit - info["current"], 1)) if limit else 1.0)
        else:
            capacities.append(1.0)
    return capacities


def _logical_gpu_limit(device: str) -> int:
    """Bytes of a logical GPU made with a memory limit (`virtual_devices`), else 0."""
    import tensorflow as tf

    index, configs = int(device.rsplit(":", 1)[1]), []
    for gpu in tf.config.list_physical_devices("GPU"):
        configs += tf.config.get_logical_device_configuration(gpu) or [None]
    config = configs[index] if index < len(configs) else None
    return int(config.memory_limit * 2**20) if config and config.memory_limit else 0


def balance_by_weight(weights: Sequence[float], capacities: Sequence[float]) -> list[int]:
    """Layer counts per stage, contiguous, so each stage's share of `weights` tracks its
    share of `capacities`; every stage gets at least one layer."""
    num_stages, num_layers = len(capacities), len(weights)
    total, total_capacity = float(sum(weights)) or 1.0, float(sum(capacities))
    counts, start, cumulative_target, running = [], 0, 0.0, 0.0
    for stage in range(num_stages - 1):
        cumulative_target += total * capacities[stage] / total_capacity
        end = start + 1
        running += weights[start]
        # Leave at least one layer for each later stage.
        while (end < num_layers - (num_stages - 1 - stage)
               and running + weights[end] / 2 <= cumulative_target):
            running += weights[end]
            end += 1
        counts.append(end - start)
        start = end
    counts.append(num_layers - start)
    return counts
