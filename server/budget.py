"""The expert cache budget: explicit bytes, or `auto` from the memory this process may use.

auto = limit - dense weights - KV cache - margin, where the limit is the memory cgroup's
(v2 memory.max or v1 memory.limit_in_bytes) when one is set, else MemAvailable, and the margin
covers llama.cpp's compute buffers, the Python process, page tables and the streamer's spare
pages (5% of the limit plus 256 MiB: on qwen30b-shape the cgroup peak exceeded budget + dense + KV
by 215-230 MiB at 4.19 and 8.38 GiB caps, bench/reports/qwen30b-shape.md). The result is
clamped to [one layer's experts, all experts]; below the floor the model cannot run in this
memory and that is an error.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from server.errors import ConfigError
from server.memcg import own_memory_cgroup
from server.model_files import split_files

logger = logging.getLogger(__name__)

_MIB = 2**20
_UNLIMITED = 2**60  # cgroup v1 reports "no limit" as a huge page-rounded number


@dataclass(frozen=True)
class BudgetChoice:
    """The budget in bytes and the reason it was chosen (logged at start-up)."""

    bytes: int
    reason: str


def streamer_dense_bytes(path: Path, expert_bytes: int) -> int:
    """Bytes of everything but the experts (dense weights, plus the small header)."""
    total = sum(p.stat().st_size for p in split_files(path) if p.exists())
    return max(0, total - expert_bytes)


def _cgroup_limit() -> tuple[int, str] | None:
    cg = own_memory_cgroup()
    if cg is None:
        return None
    try:
        raw = cg.limit_file.read_text().strip()
    except OSError:
        return None
    if raw != "max" and raw.isdigit() and int(raw) < _UNLIMITED:
        return int(raw), f"cgroup v{cg.version} {cg.limit_file.name} ({cg.limit_file})"
    return None


def _mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise ConfigError("cannot read MemAvailable from /proc/meminfo; give an explicit --budget")


def memory_limit() -> tuple[int, str]:
    """(bytes this process may use, where that number comes from)."""
    cg = _cgroup_limit()
    if cg is not None:
        return cg
    return _mem_available(), "MemAvailable (/proc/meminfo)"


def choose_budget(
    *,
    requested: int | None,
    expert_bytes: int,
    layer_bytes: int,
    dense_bytes: int,
    kv_bytes: int,
    limit: tuple[int, str] | None = None,
) -> BudgetChoice:
    """The expert budget: `requested` bytes as given, or automatic when it is None."""
    if requested is not None:
        if requested < layer_bytes:
            raise ConfigError(
                f"budget {requested / _MIB:.1f} MiB is smaller than one layer's experts "
                f"({layer_bytes / _MIB:.1f} MiB), which one prompt can route to"
            )
        return BudgetChoice(requested, "given explicitly")
    limit_bytes, source = limit or memory_limit()
    margin = limit_bytes // 20 + 256 * _MIB
    auto = limit_bytes - dense_bytes - kv_bytes - margin
    why = (
        f"auto: {source} {limit_bytes / _MIB:.0f} MiB - dense {dense_bytes / _MIB:.0f} MiB"
        f" - KV {kv_bytes / _MIB:.0f} MiB - margin {margin / _MIB:.0f} MiB"
    )
    if auto >= expert_bytes:
        return BudgetChoice(
            expert_bytes, f"{why} >= all experts ({expert_bytes / _MIB:.0f} MiB): everything cached"
        )
    if auto < layer_bytes:
        raise ConfigError(
            f"not enough memory to stream this model: {why} = {auto / _MIB:.0f} MiB, below one layer's "
            f"experts ({layer_bytes / _MIB:.0f} MiB); free memory, lower --ctx-size, or use a smaller model"
        )
    return BudgetChoice(auto, why)


def kv_cache_bytes(metadata: Mapping[str, Any], n_ctx: int, swa_ubatch: int | None = None) -> int:
    """F16 K and V bytes llama.cpp allocates for n_ctx tokens (without flash attention).

    Per layer with a KV cache: K holds n_head_kv(il) x the layer's key width, V the widest
    layer's values (llama.cpp pads V to it when the layers differ and flash attention is off:
    gemma4's 256-wide sliding-window and 512-wide full-attention heads). Sliding-window layers
    hold the whole context (swa_full, llama.cpp's default), or with `swa_ubatch` (swa_full off,
    that micro-batch size) the window plus one micro-batch, padded to 256 cells. Per-layer
    values come from arrays (head_count_kv, sliding_window_pattern), which llama-cpp-python's
    metadata leaves out: pass `gguf_header.read_metadata(path)`.
    """
    arch = metadata.get("general.architecture", "")
    n_layer = int(_number(metadata.get(f"{arch}.block_count"), 0))
    n_embd = int(_number(metadata.get(f"{arch}.embedding_length"), 0))
    if n_layer < 1:
        return 0

    def per_layer(key: str, default: list[int]) -> list[int]:
        raw = metadata.get(f"{arch}.{key}")
        values = _numbers(raw)
        if len(values) == 1:
            return [int(values[0])] * n_layer
        if len(values) == n_layer:
            return [int(v) for v in values]
        return default

    n_head = per_layer("attention.head_count", [1] * n_layer)
    n_head_kv = per_layer("attention.head_count_kv", n_head)
    swa = _swa_layers(metadata, arch, n_layer)
    k_full = int(_number(metadata.get(f"{arch}.attention.key_length"), n_embd // max(1, n_head[0])))
    v_full = int(_number(metadata.get(f"{arch}.attention.value_length"), n_embd // max(1, n_head[0])))
    k_swa = int(_number(metadata.get(f"{arch}.attention.key_length_swa"), k_full))
    v_swa = int(_number(metadata.get(f"{arch}.attention.value_length_swa"), v_full))
    # gemma4's last shared_kv_layers layers read earlier layers' caches
    with_kv = range(n_layer - int(_number(metadata.get(f"{arch}.attention.shared_kv_layers"), 0)))
    k = [n_head_kv[il] * (k_swa if swa[il] else k_full) for il in with_kv]
    v = [n_head_kv[il] * (v_swa if swa[il] else v_full) for il in with_kv]
    window = int(_number(metadata.get(f"{arch}.attention.sliding_window"), 0))
    swa_cells = n_ctx
    if swa_ubatch is not None and window > 0:
        swa_cells = min(n_ctx, -(-(window + swa_ubatch) // 256) * 256)
    cells = [swa_cells if swa[il] else n_ctx for il in with_kv]
    v_max = max(v, default=0)
    return sum(c * (k_il + v_max) for c, k_il in zip(cells, k, strict=True)) * 2


def _swa_layers(metadata: Mapping[str, Any], arch: str, n_layer: int) -> list[bool]:
    """Which layers use the sliding window, where the header says so: a per-layer array, or
    gpt-oss's fixed pattern (the even layers, llama.cpp's default there). Else none: a scalar
    period leaves open which layer of a period is the full one, and counting every layer as full
    can only overestimate the cache."""
    raw = metadata.get(f"{arch}.attention.sliding_window_pattern")
    if isinstance(raw, (list, tuple)) and len(raw) == n_layer:
        return [bool(x) for x in raw]
    if raw is None and arch == "gpt-oss" and _number(metadata.get(f"{arch}.attention.sliding_window"), 0) > 0:
        return [il % 2 == 0 for il in range(n_layer)]
    return [False] * n_layer


def _numbers(raw: Any) -> list[float]:
    """A scalar or array metadata value as numbers (booleans as 0 / 1); [] if absent or not numeric."""
    if raw is None:
        return []
    if isinstance(raw, (list, tuple)):
        return [float(x) for x in raw if isinstance(x, (int, float))]
    if isinstance(raw, (int, float)):
        return [float(raw)]
    return [float(x) for x in re.findall(r"-?\d+(?:\.\d+)?", str(raw))]


def _number(raw: Any, default: float) -> float:
    values = _numbers(raw)
    return values[0] if len(values) == 1 else default
