"""Reading ``*.safetensors`` tensor by tensor, as memory maps, with errors that name file and tensor.

The format: an 8-byte little-endian header length, a JSON header ``{name: {"dtype", "shape",
"data_offsets": [begin, end]}}`` (offsets relative to the end of the header), then the raw little-endian
data. We read it ourselves rather than through ``safetensors.safe_open(framework="numpy")``, which
cannot return bfloat16 (the dtype most checkpoints are published in). Each tensor is its own memory map,
released when the caller drops it, so converting a model never maps or copies more than one tensor.
"""

from __future__ import annotations

import json
import pathlib
import struct
from typing import Any

import jax.numpy as jnp
import numpy as np

from llm_jax.weights.layout import WeightsError

SAFETENSORS_INDEX = "model.safetensors.index.json"
_MAX_HEADER_BYTES = 100 << 20

DTYPES = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype(jnp.bfloat16),
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
    "U8": np.dtype("u1"), "BOOL": np.dtype("?"),
    "F8_E4M3": np.dtype(jnp.float8_e4m3fn), "F8_E5M2": np.dtype(jnp.float8_e5m2),
}


class SafetensorsFile:
    """One ``.safetensors`` file: its header, validated against the file size, and tensors on demand."""

    def __init__(self, path: pathlib.Path):
        self.path = path
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist")
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise WeightsError(f"{path}: {size} bytes is too short for a safetensors file")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > min(size - 8, _MAX_HEADER_BYTES):
                raise WeightsError(f"{path}: header length {header_len} does not fit the file of {size} bytes; "
                                   "not a safetensors file, or truncated")
            try:
                header = json.loads(f.read(header_len))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise WeightsError(f"{path}: corrupt safetensors header ({e})") from None
        if not isinstance(header, dict):
            raise WeightsError(f"{path}: corrupt safetensors header (not a JSON object)")
        header.pop("__metadata__", None)
        self._data_start = 8 + header_len
        self._entries: dict[str, tuple[np.dtype | str, tuple[int, ...], int]] = {}
        for name, entry in header.items():
            self._entries[name] = self._check_entry(name, entry, size)

    def _check_entry(self, name: str, entry: Any, size: int) -> tuple[np.dtype | str, tuple[int, ...], int]:
        try:
            dtype_name, shape, (begin, end) = entry["dtype"], tuple(int(d) for d in entry["shape"]), entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise WeightsError(f"{self.path}: corrupt header entry for tensor {name!r}: {entry!r}") from None
        dtype = DTYPES.get(dtype_name, dtype_name)  # an unknown dtype is reported when the tensor is read
        if isinstance(dtype, np.dtype) and end - begin != int(np.prod(shape)) * dtype.itemsize:
            raise WeightsError(f"{self.path}: tensor {name!r} {dtype_name}{list(shape)} needs "
                               f"{int(np.prod(shape)) * dtype.itemsize} bytes but its offsets span {end - begin}")
        if not 0 <= begin <= end or self._data_start + end > size:
            raise WeightsError(f"{self.path}: truncated: tensor {name!r} needs bytes up to "
                               f"{self._data_start + end} but the file has {size}")
        return dtype, shape, self._data_start + begin

    def names(self) -> set[str]:
        return set(self._entries)

    def read(self, name: str) -> np.ndarray:
        """A read-only memory map of tensor ``name``."""
        dtype, shape, offset = self._entries[name]
        if not isinstance(dtype, np.dtype):
            raise WeightsError(f"{self.path}: tensor {name!r} has dtype {dtype!r}, which llm_jax cannot read")
        if int(np.prod(shape)) == 0:
            return np.zeros(shape, dtype)
        return np.memmap(self.path, dtype=dtype, mode="r", offset=offset, shape=shape)


class SafetensorsFolder:
    """The tensors of a Hugging Face folder: one ``*.safetensors`` or a sharded set with an index."""

    def __init__(self, folder: pathlib.Path):
        self.folder = folder
        index_path = folder / SAFETENSORS_INDEX
        files: dict[str, SafetensorsFile] = {}
        if index_path.exists():
            try:
                weight_map = json.loads(index_path.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise WeightsError(f"{index_path}: not a valid safetensors index ({type(e).__name__}: {e})") from None
            for file_name in sorted(set(weight_map.values())):
                file = folder / file_name
                if not file.is_file():
                    raise FileNotFoundError(f"{file} (listed in {index_path.name}) does not exist")
                files[file_name] = SafetensorsFile(file)
            self.file_of = {name: files[file_name] for name, file_name in weight_map.items()}
            for name, file in self.file_of.items():
                if name not in file.names():
                    raise WeightsError(f"{index_path} places tensor {name!r} in {file.path.name}, which lacks it")
        else:
            paths = sorted(folder.glob("*.safetensors"))
            if not paths:
                raise FileNotFoundError(f"{folder} has no *.safetensors weights (only safetensors are supported)")
            self.file_of = {}
            for path in paths:
                file = SafetensorsFile(path)
                for name in file.names():
                    if name in self.file_of:
                        raise WeightsError(f"tensor {name!r} is in both {self.file_of[name].path} and {path}")
                    self.file_of[name] = file

    def names(self) -> set[str]:
        return set(self.file_of)

    def where(self, name: str) -> str:
        return str(self.file_of[name].path)

    def read(self, name: str) -> np.ndarray:
        return self.file_of[name].read(name)
