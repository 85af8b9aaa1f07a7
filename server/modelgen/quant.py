"""Fast, deterministic random tensor data, produced directly in each storage format.

Quantized tensors are not quantized from floats (too slow for 60 GB); their blocks are filled
with raw random bits from the bit generator (~3 GB/s) and then given a fixed scale:

- Q8_0 (f16 d, 32 x int8): quants uniform in [-128, 127] (rms 73.9); d = std / 73.9.
- Q4_0 (f16 d, 16 bytes of nibbles, value d * (q - 8)): q - 8 uniform in [-8, 7] (rms 4.64).
- MXFP4 (e8m0 exponent, 16 bytes of FP4 e2m1 nibbles): the nibbles' values are symmetric around
  zero with rms 5.85 in ggml's doubled table; the exponent is the power of two closest to
  std / 5.85 (ggml multiplies by 2^(e - 128)).

Q8_0 and Q4_0 quants have a mean of -0.5 quant steps; each block's scale takes a random sign
(the top bit of the random bits already in the scale's place) so the weights have zero mean
and no rank-one bias common to all rows. F16 uses uniform values, F32 (small tensors only:
norms, biases, routers) normal ones.

Each tensor's generator is seeded from (seed, tensor name), and the chunking depends only on
the tensor, so a tensor's bytes are the same whatever file or split it lands in.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterator

import numpy as np

from server.modelgen.archs import TensorSpec
from server.modelgen.spec import QType

# bytes generated per step: big enough to amortise numpy call overhead, small enough that the
# few chunks in flight keep RSS at tens of MB
CHUNK_BYTES = 16 << 20

_Q8_0_RMS = math.sqrt(sum(q * q for q in range(-128, 128)) / 256)
_Q4_0_RMS = math.sqrt(sum(q * q for q in range(-8, 8)) / 16)
_MXFP4_RMS = math.sqrt(sum(v * v for v in (0, 1, 2, 3, 4, 6, 8, 12)) / 8)


def tensor_rng(seed: int, name: str) -> np.random.Generator:
    """The generator for one tensor: independent of every other tensor's, stable across runs."""
    digest = hashlib.blake2b(name.encode("utf-8"), digest_size=16).digest()
    words = np.frombuffer(digest, dtype="<u4").tolist()
    return np.random.Generator(np.random.SFC64(np.random.SeedSequence([seed, *words])))


def tensor_chunks(t: TensorSpec, seed: int) -> Iterator[np.ndarray]:
    """The tensor's bytes, as a sequence of contiguous uint8 arrays (total t.nbytes)."""
    rng = tensor_rng(seed, t.name)
    if t.qtype is QType.F32:
        yield from _f32_chunks(rng, t)
    elif t.qtype is QType.F16:
        yield from _f16_chunks(rng, t)
    else:
        if t.mean != 0.0:
            raise ValueError(f"{t.name}: quantized tensors are generated with zero mean")
        yield from _block_chunks(rng, t)


def _random_bytes(rng: np.random.Generator, n: int) -> np.ndarray:
    # random_raw is several times faster than Generator.bytes/integers
    words = rng.bit_generator.random_raw((n + 7) // 8)
    return words.view(np.uint8)[:n]


def _block_chunks(rng: np.random.Generator, t: TensorSpec) -> Iterator[np.ndarray]:
    q = t.qtype
    n_blocks = t.n_elements // q.block_size
    per_chunk = max(1, CHUNK_BYTES // q.type_size)
    stamp = _exponent_stamp(t.std) if q is QType.MXFP4 else _scale_stamp(t.std, q)
    for start in range(0, n_blocks, per_chunk):
        count = min(per_chunk, n_blocks - start)
        blocks = _random_bytes(rng, count * q.type_size).reshape(count, q.type_size)
        stamp(blocks)
        yield blocks.reshape(-1)


def _exponent_stamp(std: float) -> Callable[[np.ndarray], None]:
    """Sets every MXFP4 block's e8m0 exponent (byte 0) to the power of two nearest std / rms."""
    exponent = np.uint8(min(254, max(1, 128 + round(math.log2(std / _MXFP4_RMS)))))

    def stamp(blocks: np.ndarray) -> None:
        blocks[:, 0] = exponent

    return stamp


def _scale_stamp(std: float, q: QType) -> Callable[[np.ndarray], None]:
    """Sets every Q8_0/Q4_0 block's f16 scale (bytes 0-1) to +-std/rms, keeping the random sign bit."""
    rms = _Q8_0_RMS if q is QType.Q8_0 else _Q4_0_RMS
    magnitude = np.array([std / rms], dtype="<f2").view("<u2")[0] & np.uint16(0x7FFF)

    def stamp(blocks: np.ndarray) -> None:
        # type_size is even for Q8_0/Q4_0, so each block's first u16 is its scale
        scales = blocks.view("<u2")[:, 0]
        scales &= np.uint16(0x8000)
        scales |= magnitude

    return stamp


def _f16_chunks(rng: np.random.Generator, t: TensorSpec) -> Iterator[np.ndarray]:
    per_chunk = CHUNK_BYTES // 2
    # int16 uniform in [-32768, 32767] has std 32768 / sqrt(3)
    scale = np.float32(t.std * math.sqrt(3) / 32768.0)
    for start in range(0, t.n_elements, per_chunk):
        count = min(per_chunk, t.n_elements - start)
        raw = _random_bytes(rng, 2 * count).view("<i2")
        values = raw.astype(np.float32) * scale + np.float32(t.mean)
        yield values.astype("<f2").view(np.uint8)


def _f32_chunks(rng: np.random.Generator, t: TensorSpec) -> Iterator[np.ndarray]:
    per_chunk = CHUNK_BYTES // 4
    for start in range(0, t.n_elements, per_chunk):
        count = min(per_chunk, t.n_elements - start)
        values = rng.standard_normal(count, dtype=np.float32) * np.float32(t.std) + np.float32(t.mean)
        yield values.astype("<f4", copy=False).view(np.uint8)
