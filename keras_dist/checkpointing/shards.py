"""The sharded state format: each process writes the blocks it owns; an index, written last,
says where every block of every variable is. Pure Python and NumPy; no TensorFlow.

A state directory:

    process-00000.blocks    process 0's blocks, raw bytes one after the other
    process-00000.json      process 0's fragment: per block its variable, start, shape,
                            offset in the .blocks file, size and crc32 (a checksum
                            that costs the background writer little; the index itself
                            is checksummed with sha256 in the backup's metadata)
    ...                     one pair per process that owned a block
    index.json              written last, by one process once every fragment is there:
                            per variable its global shape, dtype, layout and blocks

A variable stored on a mesh is cut into the blocks its layout makes (a dimension sharded on
a mesh axis of size k in k blocks); a block held by several devices (a replicated axis) is
written once across the job, by its *owner*, the first of those devices in the mesh's
order (`owned_blocks`). Every file is written to a temporary name, fsynced and renamed, so
a directory without `index.json` is an unfinished save and one with it is complete.
Reading assembles any region (one device's block of another layout, or the whole value for
one device) from the stored blocks that intersect it, reading only those (`StateReader`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import zlib
from typing import Iterable, Sequence

import numpy as np

__all__ = ["INDEX_NAME", "FORMAT", "Block", "Placement", "StateReader", "merge_index",
           "owned_blocks", "write_fragment"]

FORMAT = "keras_dist.sharded_state/1"
INDEX_NAME = "index.json"


@dataclasses.dataclass(frozen=True)
class Placement:
    """How a variable lies on a mesh: the mesh, and a mesh axis (or None) per dimension."""

    shape: tuple[int, ...]
    mesh_axes: tuple[str, ...] = ()
    mesh_shape: tuple[int, ...] = ()
    specs: tuple[str | None, ...] = ()  # per dimension of the variable

    def block_shape(self) -> tuple[int, ...]:
        sizes = dict(zip(self.mesh_axes, self.mesh_shape))
        return tuple(dim // sizes[spec] if spec else dim
                     for dim, spec in zip(self.shape, self._specs()))

    def region(self, position: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(start, shape) of what the device at `position` in the mesh's order holds."""
        coords = dict(zip(self.mesh_axes, np.unravel_index(position, self.mesh_shape))) if (
            self.mesh_shape) else {}
        block = self.block_shape()
        start = tuple(int(coords[spec]) * extent if spec else 0
                      for spec, extent in zip(self._specs(), block))
        return start, block

    def _specs(self) -> tuple[str | None, ...]:
        return tuple(self.specs) + (None,) * (len(self.shape) - len(self.specs))

    def to_json(self) -> dict:
        return {"mesh_axes": list(self.mesh_axes), "mesh_shape": list(self.mesh_shape),
                "specs": list(self._specs())}


def owned_blocks(placement: Placement, local_positions: Sequence[int]) -> list[tuple[int, tuple]]:
    """The blocks this process writes: `(local index, start)` for each local device that
    owns its block (the first device in the mesh's order holding it)."""
    devices = math.prod(placement.mesh_shape) if placement.mesh_shape else 1
    first: dict[tuple, int] = {}
    for position in range(devices):
        first.setdefault(placement.region(position)[0], position)
    return [(local, placement.region(position)[0])
            for local, position in enumerate(local_positions)
            if first[placement.region(position)[0]] == position]


@dataclasses.dataclass(frozen=True)
class Block:
    """One block to write: `value` is the array of `variable` starting at `start`."""

    variable: str
    start: tuple[int, ...]
    value: np.ndarray


def _write_atomic(path: str, write) -> None:
    temporary = f"{path}.tmp-{os.getpid()}"
    try:
        with open(temporary, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)


def fragment_name(process: int) -> str:
    return f"process-{process:05d}.json"


def write_fragment(directory: str, process: int, blocks: Iterable[Block]) -> str:
    """Writes this process's blocks and its fragment (atomically, fragment last)."""
    data_name = f"process-{process:05d}.blocks"
    entries = []

    def write_data(file):
        offset = 0
        for block in blocks:
            # The array's own buffer, no copy: the checksum and the write both release
            # the GIL on it, so training goes on in the main thread meanwhile.
            data = memoryview(np.ascontiguousarray(block.value).reshape(-1).view(np.uint8))
            file.write(data)
            entries.append({"variable": block.variable, "start": list(block.start),
                            "shape": list(block.value.shape), "file": data_name,
                            "offset": offset, "nbytes": data.nbytes,
                            "crc32": zlib.crc32(data)})
            offset += data.nbytes

    _write_atomic(os.path.join(directory, data_name), write_data)
    path = os.path.join(directory, fragment_name(process))
    _write_atomic(path, lambda file: file.write(json.dumps(
        {"format": FORMAT, "process": process, "blocks": entries}).encode()))
    return path


def merge_index(directory: str, variables: dict, num_processes: int, extra: dict) -> dict:
    """Writes `index.json` from every process's fragment; the save's commit point.

    Args:
        variables: `{name: {"shape", "dtype", "placement"}}` as the saving job saw them.
        num_processes: How many fragments to expect (a process that owned no block still
            writes an empty one).
        extra: Anything more to record (epoch, step, the input's order...).

    Raises:
        ValueError: A fragment is missing or a variable is not fully covered by blocks.
    """
    blocks: dict[str, list] = {name: [] for name in variables}
    for process in range(num_processes):
        with open(os.path.join(directory, fragment_name(process))) as file:
            fragment = json.load(file)
        for entry in fragment["blocks"]:
            blocks[entry["variable"]].append(entry)
    for name, spec in variables.items():
        covered = sum(math.prod(entry["shape"]) for entry in blocks[name])
        if covered != math.prod(spec["shape"]):
            raise ValueError(f"variable {name!r}: the blocks written cover {covered} of its "
                             f"{math.prod(spec['shape'])} elements")
    index = {"format": FORMAT, **extra,
             "variables": {name: dict(spec, blocks=blocks[name])
                           for name, spec in variables.items()}}
    _write_atomic(os.path.join(directory, INDEX_NAME),
                  lambda file: file.write(json.dumps(index).encode()))
    return index


class StateReader:
    """Reads regions of the variables of a complete state directory."""

    def __init__(self, directory: str, index: dict | None = None):
        self.directory = directory
        if index is None:
            with open(os.path.join(directory, INDEX_NAME)) as file:
                index = json.load(file)
        if index.get("format") != FORMAT:
            raise ValueError(f"{directory!r} is not a keras_dist sharded state "
                             f"(format {index.get('format')!r}, expected {FORMAT!r})")
        self.index = index
        self.variables = index["variables"]
        self._verified: set[tuple[str, int]] = set()

    def read(self, name: str, start: Sequence[int] | None = None,
             shape: Sequence[int] | None = None) -> np.ndarray:
        """The region `start` + `shape` of variable `name` (the whole value by default),
        read from the blocks that intersect it, each checked against its checksum."""
        spec = self.variables[name]
        full = tuple(spec["shape"])
        start = tuple(start) if start is not None else (0,) * len(full)
        shape = tuple(shape) if shape is not None else full
        out = np.empty(shape, dtype=numpy_dtype(spec["dtype"]))
        for entry in spec["blocks"]:
            lo = [max(a, b) for a, b in zip(start, entry["start"])]
            hi = [min(a + n, b + m) for a, n, b, m in zip(start, shape, entry["start"],
                                                           entry["shape"])]
            if any(h <= l for l, h in zip(lo, hi)) and full:
                continue
            block = self._block(entry, out.dtype)
            source = tuple(slice(l - b, h - b) for l, h, b in zip(lo, hi, entry["start"]))
            target = tuple(slice(l - s, h - s) for l, h, s in zip(lo, hi, start))
            out[target] = block[source]
        return out

    def _block(self, entry: dict, dtype) -> np.ndarray:
        path = os.path.join(self.directory, entry["file"])
        with open(path, "rb") as file:
            file.seek(entry["offset"])
            data = file.read(entry["nbytes"])
        key = (entry["file"], entry["offset"])
        if key not in self._verified:
            if len(data) != entry["nbytes"] or zlib.crc32(data) != entry["crc32"]:
                raise ValueError(
                    f"block of {entry['variable']!r} at {tuple(entry['start'])} in "
                    f"{path!r} (bytes {entry['offset']}..{entry['offset'] + entry['nbytes']})"
                    " does not match its checksum (crc32) in the index: the file was "
                    "changed or damaged after it was written")
            self._verified.add(key)
        return np.frombuffer(data, dtype=dtype).reshape(entry["shape"])


def numpy_dtype(name: str) -> np.dtype:
    """NumPy's dtype for a name, bfloat16 and the other ml_dtypes included."""
    try:
        return np.dtype(name)
    except TypeError:
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, name))
