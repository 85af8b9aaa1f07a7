"""The key/values of a GGUF header, numeric arrays included, read quickly; and its tensor table's
sizes (route traces name the bytes of one expert per layer).

llama-cpp-python's `Llama.metadata` leaves arrays out (llama.cpp keeps only scalars as
strings), yet per-layer hyperparameters live in arrays (gemma4's head_count_kv and
sliding_window_pattern). gguf's GGUFReader reads them, but it builds a numpy view per item of
the vocabulary's string arrays: 8.2 s on gemma4-26b-shape's header (262144 tokens), against
0.07 s here (both timed once on that 17.7 GB file, `time.time()` around the call). This reader
walks the key/value section once and skips string arrays by their lengths.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
from gguf import GGUFReader, GGUFValueType

from server.errors import ModelLoadError

_MAGIC = b"GGUF"
# the scalar value types and their little-endian numpy types, as the gguf package reads them (the
# generator writes with the same table: server/modelgen/gguf_format.py)
SCALAR_TYPES: dict[GGUFValueType, np.dtype[Any]] = {
    vtype: np.dtype(numpy_type).newbyteorder("<")
    for vtype, numpy_type in GGUFReader.gguf_scalar_to_np.items()
}


def read_metadata(path: Path) -> dict[str, Any]:
    """Scalars (numbers, bools, strings) and numeric / boolean arrays as lists; string arrays
    (the vocabulary) are skipped. ModelLoadError if the file is not a readable GGUF."""
    try:
        with path.open("rb") as f:
            return _read(f)[1]
    except (OSError, struct.error, UnicodeDecodeError, ValueError) as exc:
        raise ModelLoadError(f"cannot read the GGUF header of {path}: {exc}") from exc


def _read(f: BinaryIO) -> tuple[int, dict[str, Any]]:
    """(the number of tensors, the key/values); leaves f at the tensor table."""
    if f.read(4) != _MAGIC:
        raise ValueError("not a GGUF file (bad magic)")
    version, n_tensors, n_kv = struct.unpack("<IQQ", f.read(20))
    if version < 2:
        raise ValueError(f"GGUF version {version} is not supported")
    out: dict[str, Any] = {}
    for _ in range(n_kv):
        key = _string(f)
        (vtype,) = struct.unpack("<I", f.read(4))
        value = _value(f, vtype)
        if value is not None:
            out[key] = value
    return n_tensors, out


def _string(f: BinaryIO) -> str:
    (n,) = struct.unpack("<Q", f.read(8))
    data = f.read(n)
    if len(data) != n:
        raise ValueError("truncated string")
    return data.decode("utf-8")


def _values(f: BinaryIO, vtype: int, count: int) -> list[Any]:
    dtype = SCALAR_TYPES[GGUFValueType(vtype)]
    data = f.read(dtype.itemsize * count)
    if len(data) != dtype.itemsize * count:
        raise ValueError("truncated value")
    return list(np.frombuffer(data, dtype).tolist())


def _value(f: BinaryIO, vtype: int) -> Any:
    if vtype in SCALAR_TYPES:
        return _values(f, vtype, 1)[0]
    if vtype == GGUFValueType.STRING:
        return _string(f)
    if vtype != GGUFValueType.ARRAY:
        raise ValueError(f"unknown GGUF value type {vtype}")
    (item_type, count) = struct.unpack("<IQ", f.read(12))
    if item_type == GGUFValueType.STRING:
        for _ in range(count):
            (n,) = struct.unpack("<Q", f.read(8))
            f.seek(n, 1)
        return None
    if item_type not in SCALAR_TYPES:
        raise ValueError(f"unsupported GGUF array item type {item_type}")
    return _values(f, item_type, count)


_MAX_DIMS = 4  # GGML_MAX_DIMS


@dataclass(frozen=True)
class TensorInfo:
    """One row of a GGUF file's tensor table."""

    name: str
    shape: tuple[int, ...]  # ggml's order: ne0 (a row's elements) first
    ggml_type: int
    offset: int  # from the start of the data section


def read_tensor_table(path: Path) -> tuple[list[TensorInfo], int]:
    """The tensor table of one GGUF file and the bytes of its data section. ModelLoadError if the
    file is not a GGUF."""
    try:
        with path.open("rb") as f:
            n_tensors, meta = _read(f)
            infos: list[TensorInfo] = []
            for _ in range(n_tensors):
                name = _string(f)
                (n_dims,) = struct.unpack("<I", f.read(4))
                if n_dims > _MAX_DIMS:
                    raise ValueError(f"tensor {name} has {n_dims} dimensions (ggml has {_MAX_DIMS})")
                shape = struct.unpack(f"<{n_dims}Q", f.read(8 * n_dims))
                ggml_type, offset = struct.unpack("<IQ", f.read(12))
                infos.append(TensorInfo(name, shape, ggml_type, offset))
            alignment = int(meta.get("general.alignment", 32))
            data_start = -(-f.tell() // alignment) * alignment
            data_bytes = path.stat().st_size - data_start
    except (OSError, struct.error, UnicodeDecodeError, ValueError) as exc:
        raise ModelLoadError(f"cannot read the GGUF tensor table of {path}: {exc}") from exc
    return infos, data_bytes


def read_tensor_sizes(path: Path) -> dict[str, int]:
    """Bytes of each tensor of one GGUF file (its data up to the next tensor's, alignment padding
    included: at most general.alignment - 1 bytes). ModelLoadError if the file is not a GGUF."""
    infos, data_bytes = read_tensor_table(path)
    ordered = sorted(infos, key=lambda info: info.offset)
    ends = [info.offset for info in ordered[1:]] + [data_bytes]
    return {info.name: end - info.offset for info, end in zip(ordered, ends, strict=True)}
