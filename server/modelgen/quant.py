"""Fast, deterministic random tensor data, produced directly in each storage format.

Quantized tensors are not quantized from floats (too slow for 60 GB); their blocks are filled
with raw random bits from the bit generator (~3 GB/s) and then given a fixed scale:

- Q8_0 (f16 d, 32 x int8): quants uniform in [-128, 127] (rms 73.9); d = std / 73.9.
- Q4_0 (f16 d, 16 bytes of nibbles, value d * (q - 8)): q - 8 uniform in [-8, 7] (rms 4.64).
- Q5_0 (f16 d, 4 bytes of fifth bits, 16 bytes of nibbles, value d * (q - 16)): q - 16 uniform
  in [-16, 15] (rms 9.24).
- MXFP4 (e8m0 exponent, 16 bytes of FP4 e2m1 nibbles): the nibbles' values are symmetric around
  zero with rms 5.85 in ggml's doubled table; the exponent is the power of two closest to
  std / 5.85 (ggml multiplies by 2^(e - 128)).
- Q6_K (256 values: 6-bit quants, 16 int8 sub-block scales, f16 d last): value d * sc * (q - 32)
  with q uniform in [0, 63] (rms 18.5) and sc uniform int8 (rms 73.9, random sign).
- Q4_K (256 values: f16 d and dmin first, eight 6-bit scale/min pairs, 4-bit quants): value
  d * sc * q - dmin * m with q in [0, 15] and sc, m in [0, 63]; dmin = 7.5 d zeroes the mean
  (E[sc q] = 7.5 E[m]), and the rms is 258 d (exact: sqrt(E[(sc q - 7.5 m)^2])).

Q8_0, Q5_0 and Q4_0 quants have a mean of -0.5 quant steps; each block's scale takes a random sign
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

from server.modelgen.spec import QType, TensorSpec

# bytes generated per step: big enough to amortise numpy call overhead, small enough that the
# few chunks in flight keep RSS at tens of MB
CHUNK_BYTES = 16 << 20

_Q8_0_RMS = math.sqrt(sum(q * q for q in range(-128, 128)) / 256)
_Q4_0_RMS = math.sqrt(sum(q * q for q in range(-8, 8)) / 16)
_Q5_0_RMS = math.sqrt(sum(q * q for q in range(-16, 16)) / 32)
_MXFP4_RMS = math.sqrt(sum(v * v for v in (0, 1, 2, 3, 4, 6, 8, 12)) / 8)
_Q6_K_RMS = _Q8_0_RMS * math.sqrt(sum((q - 32) ** 2 for q in range(64)) / 64)
# E[(sc q - 7.5 m)^2] = E[sc^2] E[q^2] - 15 E[sc] E[q] E[m] + 56.25 E[m^2], sc, m ~ U{0..63}, q ~ U{0..15}
_U63_M1, _U63_M2 = 31.5, sum(v * v for v in range(64)) / 64
_Q4_K_RMS = math.sqrt(
    _U63_M2 * sum(q * q for q in range(16)) / 16 - 15 * _U63_M1 * 7.5 * _U63_M1 + 56.25 * _U63_M2
)


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
    stamp = _STAMPS[q](t.std)
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


def _f16_bits(value: float) -> np.uint16:
    """The f16 bits of |value|."""
    return np.uint16(np.array([value], dtype="<f2").view("<u2")[0] & 0x7FFF)


def _scale_stamp(rms: float, word: int, signed: bool) -> Callable[[float], Callable[[np.ndarray], None]]:
    """Sets every block's f16 scale (u16 number `word` of the block) to std/rms, with the random
    sign bit already in its place if `signed` (Q8_0, Q5_0, Q4_0: unsigned quants), else positive (Q6_K:
    its int8 sub-block scales carry random signs already)."""

    def for_std(std: float) -> Callable[[np.ndarray], None]:
        magnitude = _f16_bits(std / rms)
        keep = np.uint16(0x8000 if signed else 0)

        def stamp(blocks: np.ndarray) -> None:
            # every type stamped here has an even block size, so each block is a row of u16 words
            scales = blocks.view("<u2")[:, word]
            scales &= keep
            scales |= magnitude

        return stamp

    return for_std


def _q4_k_stamp(std: float) -> Callable[[np.ndarray], None]:
    """Sets every Q4_K block's d to +-std/rms (random sign) and its dmin to 7.5 d (zero mean)."""
    d, dmin = _f16_bits(std / _Q4_K_RMS), _f16_bits(7.5 * std / _Q4_K_RMS)

    def stamp(blocks: np.ndarray) -> None:
        words = blocks.view("<u2")
        sign = words[:, 0] & np.uint16(0x8000)
        words[:, 0] = sign | d
        words[:, 1] = sign | dmin

    return stamp


_STAMPS: dict[QType, Callable[[float], Callable[[np.ndarray], None]]] = {
    QType.Q8_0: _scale_stamp(_Q8_0_RMS, 0, signed=True),
    QType.Q4_0: _scale_stamp(_Q4_0_RMS, 0, signed=True),
    QType.Q5_0: _scale_stamp(_Q5_0_RMS, 0, signed=True),
    QType.Q6_K: _scale_stamp(_Q6_K_RMS, 104, signed=False),  # d: bytes 208-209 of 210
    QType.Q4_K: _q4_k_stamp,
    QType.MXFP4: _exponent_stamp,
}


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
