"""Byte-exact GGUF v3 header serialization (key/values and tensor infos).

Written here rather than through gguf.GGUFWriter so that the generator knows every file's
exact size before writing a byte (disk-room check, split planning) and can stream tensor data
itself. The format (ggml/src/gguf.cpp): magic, version, tensor count, kv count, the kv pairs,
the tensor infos (name, dims, ne[], type, offset relative to the data section), padding to
`general.alignment`, then the data section where every tensor starts aligned.
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Sequence

import numpy as np
from gguf import GGUFValueType

from server.loading.gguf_header import SCALAR_TYPES

GGUF_MAGIC = b"GGUF"
GGUF_VERSION = 3


Scalar = int | float | bool | str


@dataclasses.dataclass(frozen=True)
class KV:
    """One metadata key/value. For arrays, `vtype` is ARRAY and `item_type` the element type."""

    key: str
    vtype: GGUFValueType
    value: Scalar | Sequence[Scalar]
    item_type: GGUFValueType | None = None

    def encode(self) -> bytes:
        out = [_string(self.key), struct.pack("<I", self.vtype)]
        if self.vtype is GGUFValueType.ARRAY:
            if self.item_type is None or self.item_type is GGUFValueType.ARRAY:
                raise ValueError(f"{self.key}: array needs a scalar item_type")
            items = self.value
            if isinstance(items, str) or not isinstance(items, Sequence):
                raise ValueError(f"{self.key}: array value must be a sequence")
            out.append(struct.pack("<IQ", self.item_type, len(items)))
            out.append(_encode_items(self.item_type, items))
        else:
            if isinstance(self.value, Sequence) and not isinstance(self.value, str):
                raise ValueError(f"{self.key}: scalar value expected")
            out.append(_encode_scalar(self.vtype, self.value))
        return b"".join(out)


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """A tensor's header entry. `ne` is in ggml order (ne[0] = the contiguous row)."""

    name: str
    ne: tuple[int, ...]
    ggml_type: int
    offset: int  # from the start of the data section; a multiple of the alignment

    def encode(self) -> bytes:
        return b"".join(
            (
                _string(self.name),
                struct.pack("<I", len(self.ne)),
                struct.pack(f"<{len(self.ne)}Q", *self.ne),
                struct.pack("<IQ", self.ggml_type, self.offset),
            )
        )


def pad_to(n: int, alignment: int) -> int:
    """`n` rounded up to a multiple of `alignment`."""
    return (n + alignment - 1) // alignment * alignment


def encode_header(kvs: Sequence[KV], tensors: Sequence[TensorInfo], alignment: int) -> bytes:
    """Everything before the data section, padded so the data section starts aligned."""
    parts = [GGUF_MAGIC, struct.pack("<IQQ", GGUF_VERSION, len(tensors), len(kvs))]
    parts.extend(kv.encode() for kv in kvs)
    parts.extend(t.encode() for t in tensors)
    raw = b"".join(parts)
    return raw + bytes(pad_to(len(raw), alignment) - len(raw))


def _string(s: str) -> bytes:
    data = s.encode("utf-8")
    return struct.pack("<Q", len(data)) + data


def _encode_scalar(vtype: GGUFValueType, value: Scalar | Sequence[Scalar]) -> bytes:
    if vtype is GGUFValueType.STRING:
        if not isinstance(value, str):
            raise ValueError(f"string expected, got {value!r}")
        return _string(value)
    return np.asarray(value, dtype=SCALAR_TYPES[vtype]).tobytes()


def _encode_items(item_type: GGUFValueType, items: Sequence[Scalar]) -> bytes:
    if item_type is GGUFValueType.STRING:
        return b"".join(_string(str(s)) for s in items)
    # numpy packs the 150k-200k entry token-type arrays of real vocabularies in one go
    return np.asarray(items, dtype=SCALAR_TYPES[item_type]).tobytes()
