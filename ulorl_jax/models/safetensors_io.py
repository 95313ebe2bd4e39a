"""Streaming safetensors reading (memory-mapped, bfloat16-capable) with precise errors.

`safetensors.numpy` cannot represent bfloat16, and a whole-file load would hold
a second copy of the model in host memory. This reader parses the documented
format (8-byte little-endian header length, JSON header, raw little-endian
data) and hands out zero-copy `np.memmap` views, one tensor at a time, so a
caller can place each tensor (or just its shards) on device and drop it.
Writing uses the same format; tests read our files back with transformers.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}


class CheckpointError(ValueError):
    """A checkpoint file or tensor is missing, truncated or has the wrong shape."""


class SafetensorsFile:
    """Header of one .safetensors file plus lazy access to its tensors."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_file():
            raise CheckpointError(f"safetensors file not found: {self.path}")
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise CheckpointError(f"{self.path}: truncated safetensors file ({size} bytes, no header)")
            (header_len,) = struct.unpack("<Q", raw)
            if 8 + header_len > size:
                raise CheckpointError(
                    f"{self.path}: truncated safetensors file (header says {header_len} bytes, file has {size})"
                )
            try:
                header = json.loads(f.read(header_len))
            except json.JSONDecodeError as err:
                raise CheckpointError(f"{self.path}: corrupt safetensors header ({err})") from None
        self.metadata = header.pop("__metadata__", {}) or {}
        self._data_start = 8 + header_len
        self.tensors: dict[str, dict] = header
        for name, info in header.items():
            end = self._data_start + info["data_offsets"][1]
            if end > size:
                raise CheckpointError(
                    f"{self.path}: truncated safetensors file: tensor {name!r} needs bytes up to {end}, "
                    f"file has {size}"
                )
            if info["dtype"] not in _DTYPES:
                raise CheckpointError(f"{self.path}: tensor {name!r} has unsupported dtype {info['dtype']}")

    def keys(self) -> list[str]:
        return list(self.tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name]["shape"])

    def get(self, name: str) -> np.ndarray:
        """A read-only memory-mapped view of tensor `name` (no copy until sliced and converted)."""
        info = self.tensors[name]
        begin, end = info["data_offsets"]
        dtype = np.dtype(_DTYPES[info["dtype"]])
        shape = tuple(info["shape"])
        if end - begin != dtype.itemsize * int(np.prod(shape, dtype=np.int64)):
            raise CheckpointError(f"{self.path}: tensor {name!r} byte range does not match shape {shape}")
        if end == begin:
            return np.zeros(shape, dtype)
        return np.memmap(self.path, dtype=dtype, mode="r", offset=self._data_start + begin, shape=shape)


class CheckpointReader:
    """All tensors of an HF model folder: `model.safetensors` or a sharded index."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        index = self.folder / "model.safetensors.index.json"
        single = self.folder / "model.safetensors"
        self._files: dict[str, SafetensorsFile] = {}
        self._where: dict[str, str] = {}
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as err:
                raise CheckpointError(f"{index}: not a valid safetensors index ({err})") from None
            for file_name in sorted(set(weight_map.values())):
                self._files[file_name] = SafetensorsFile(self.folder / file_name)
            for tensor, file_name in weight_map.items():
                if tensor not in self._files[file_name].tensors:
                    raise CheckpointError(f"{index}: lists tensor {tensor!r} in {file_name}, which does not hold it")
                self._where[tensor] = file_name
        elif single.is_file():
            self._files[single.name] = SafetensorsFile(single)
            self._where = {name: single.name for name in self._files[single.name].keys()}
        else:
            raise CheckpointError(
                f"{self.folder}: no model.safetensors or model.safetensors.index.json found"
            )

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def keys(self) -> list[str]:
        return list(self._where)

    def get(self, name: str, expected_shape: tuple[int, ...] | None = None) -> np.ndarray:
        if name not in self._where:
            raise CheckpointError(f"{self.folder}: tensor {name!r} is missing from the checkpoint")
        file = self._files[self._where[name]]
        if expected_shape is not None and file.shape(name) != tuple(expected_shape):
            raise CheckpointError(
                f"{file.path}: tensor {name!r} has shape {file.shape(name)}, expected {tuple(expected_shape)}"
            )
        return file.get(name)


def save_safetensors_folder(tensors: dict[str, np.ndarray], folder: str | os.PathLike,
                            max_shard_bytes: int = 5 * 2**30) -> None:
    """Write tensors as `model.safetensors`, or as shards plus an index past `max_shard_bytes`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, array in tensors.items():
        if size and size + array.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = array
        size += array.nbytes
    total = sum(a.nbytes for a in tensors.values())
    if len(shards) == 1:
        write_safetensors(shards[0], folder / "model.safetensors")
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        file_name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(shard, folder / file_name)
        weight_map.update({name: file_name for name in shard})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


_TAGS = {np.dtype(v): k for k, v in _DTYPES.items()}


def write_safetensors(tensors: dict[str, np.ndarray], path: str | os.PathLike) -> None:
    """Write one safetensors file (bfloat16 included), atomically via a temporary name.

    The format is tiny and documented; writing it here avoids `safetensors.numpy`'s
    missing bfloat16 and lets each tensor stream to disk without a second copy."""
    path = Path(path)
    header, offset = {}, 0
    for name, array in tensors.items():
        tag = _TAGS.get(np.dtype(array.dtype))
        if tag is None:
            raise CheckpointError(f"tensor {name!r}: dtype {array.dtype} cannot be written to safetensors")
        header[name] = {"dtype": tag, "shape": list(array.shape), "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for array in tensors.values():
            f.write(np.ascontiguousarray(array).tobytes())
    os.replace(tmp, path)
