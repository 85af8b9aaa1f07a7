"""The memory budget: what the process holds beside the expert cache, and the cache's share.

Every term is measured where it can be, once the llama.cpp context exists:
- in use: the process before the model (Python, libraries), its RSS; counted only under a
  cgroup limit (MemAvailable, read before the load, already leaves the process out);
- weights in RAM (`dense`): a streamed model's non-expert tensors, read at load; with `--repack
  on`, a resident model's weights in the CPU backend's repacked layouts (repacked_bytes), which
  llama.cpp copies out of the file (the rest of a resident model is page cache, which the kernel
  reclaims instead of killing the process);
- the context (server/loading/context.py): KV cache, compute buffers reserved for a full micro-batch
  over the whole context, output buffer, and without flash attention ggml's work buffer for the
  attention product (allocated on the first long prompt);
- prompt cache: the KV states of recent prompt prefixes the server keeps in RAM
  (server/engine/prompt_cache.py), a bound chosen in the settings (auto: one full context's
  state);
- margin: what cannot be measured (page tables, thread stacks, allocator slack, ggml's other
  work buffers, the server's per-request objects): 64 MiB + 3% of the limit.
auto = limit - all of them, clamped to [one layer's experts, all experts]; below the floor the
context cannot be held in this memory and that is an error naming the terms.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from server.errors import ConfigError
from server.loading.context import ContextBytes
from server.loading.gguf_header import TensorInfo, read_tensor_table
from server.loading.memcg import OwnMemoryCgroup, own_memory_cgroup
from server.loading.model_files import split_files
from server.units import format_size

logger = logging.getLogger(__name__)

_MIB = 2**20

# the prompt cache's RAM as the settings give it: bytes, "auto", or None for no prompt cache
PromptCacheRam = int | Literal["auto"] | None
_UNLIMITED = 2**60  # cgroup v1 reports "no limit" as a huge page-rounded number


def _mib(n: int) -> str:
    """A figure of the budget's arithmetic (limit - terms = what is left), all in whole MiB so
    that a reader can check the sum."""
    return format_size(n, unit="MiB", digits=0)


@dataclass(frozen=True)
class BudgetChoice:
    """The budget in bytes and the reason it was chosen (logged at start-up)."""

    bytes: int
    reason: str


@dataclass(frozen=True)
class MemoryLimit:
    """The memory this process may use, where that number comes from, and what of it the process
    already held when it was read (its RSS under a cgroup limit; 0 for MemAvailable)."""

    bytes: int
    source: str
    in_use: int = 0


@dataclass(frozen=True)
class MemoryTerms:
    """What the process holds beside the expert cache, bytes (see the module docstring)."""

    in_use: int
    dense: int
    context: ContextBytes
    margin: int
    prompt_cache: int = 0  # RAM for prompt-prefix states (0: no prompt cache)

    @property
    def total(self) -> int:
        return self.in_use + self.dense + self.context.total + self.prompt_cache + self.margin

    def describe(self) -> str:
        c = self.context
        parts = [
            f"in use {_mib(self.in_use)}",
            f"weights in RAM {_mib(self.dense)}",
            f"KV {_mib(c.kv)}",
            f"compute {_mib(c.compute)}",
            f"output {_mib(c.output)}",
        ]
        if c.attention_scratch:
            parts.append(f"attention scratch {_mib(c.attention_scratch)}")
        if self.prompt_cache:
            parts.append(f"prompt cache {_mib(self.prompt_cache)}")
        parts.append(f"margin {_mib(self.margin)}")
        return " - ".join(parts)


def return_freed_buffers() -> None:
    """Make glibc hand every buffer over 1 MiB back to the kernel when it is freed. Its default
    mmap threshold follows the largest block freed so far (up to 32 MiB), so once a model's
    buffers have been freed, the next model's of that size come from its arenas and stay held
    after they too are freed: a server that switches models grows by each switch
    (tests/loading/test_switch_memory.py). A no-op on other C libraries."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is None or not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):
        return
    m_mmap_threshold = -3  # malloc.h; setting it also stops the threshold from moving
    libc.mallopt(m_mmap_threshold, _MIB)


def margin_bytes(limit_bytes: int) -> int:
    """What cannot be measured ahead of time (module docstring)."""
    return 64 * _MIB + limit_bytes * 3 // 100


def model_tensors(path: Path) -> dict[str, TensorInfo]:
    """The tensor tables of `path` and the rest of its split set, by tensor name."""
    return {t.name: t for part in split_files(path) for t in read_tensor_table(part)[0]}


def repacked_bytes(path: Path) -> int:
    """Bytes of the weights of `path` (every file of a split set) that llama.cpp holds in the CPU
    backend's repacked layouts on this CPU: anonymous memory beside a resident model's mapping."""
    from streaming_ext import load_library

    repacked = load_library().repacked_bytes
    tensors = model_tensors(path)
    total = sum(repacked(t.name, t.ggml_type, t.shape) for t in tensors.values())
    return total + tied_output_bytes(tensors, repacked)


def tied_output_bytes(
    tensors: Mapping[str, TensorInfo], repacked: Callable[[str, int, tuple[int, ...]], int]
) -> int:
    """The repacked copy of the token embeddings a model without output.weight multiplies by (0
    when it has one, or the CPU has no layout for their type)."""
    embd = tensors.get("token_embd.weight")
    if "output.weight" in tensors or embd is None:
        return 0
    return repacked("output.weight", embd.ggml_type, embd.shape)


def streamer_dense_bytes(path: Path, expert_bytes: int) -> int:
    """Bytes of everything but the experts (dense weights, plus the small header)."""
    total = sum(p.stat().st_size for p in split_files(path) if p.exists())
    return max(0, total - expert_bytes)


def cgroup_limit(cg: OwnMemoryCgroup | None) -> tuple[int, str] | None:
    """The limit of the memory cgroup `cg` (own_memory_cgroup()) and where it was read, or None
    when there is no cgroup or it sets no limit."""
    if cg is None:
        return None
    try:
        raw = cg.limit_file.read_text().strip()
    except OSError:
        return None
    if raw != "max" and raw.isdigit() and int(raw) < _UNLIMITED:
        return int(raw), f"cgroup v{cg.version} {cg.limit_file.name} ({cg.limit_file})"
    return None


def meminfo_bytes(path: str, key: str) -> int | None:
    """A "Key: N kB" field of /proc/meminfo or /proc/self/status, in bytes (None if absent)."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def memory_limit() -> MemoryLimit:
    """What this process may use now: its cgroup's limit (minus nothing yet: `in_use` says what
    the process holds of it), else MemAvailable, which already leaves the process out."""
    cg = cgroup_limit(own_memory_cgroup())
    if cg is not None:
        return MemoryLimit(cg[0], cg[1], meminfo_bytes("/proc/self/status", "VmRSS") or 0)
    available = meminfo_bytes("/proc/meminfo", "MemAvailable")
    if available is None:
        raise ConfigError("cannot read MemAvailable from /proc/meminfo; give an explicit --budget")
    return MemoryLimit(available, "MemAvailable (/proc/meminfo)")


def memory_terms(
    limit: MemoryLimit, dense: int, context: ContextBytes, prompt_cache: PromptCacheRam = None
) -> MemoryTerms:
    """The terms beside the expert cache under `limit`, the prompt cache's RAM resolved for
    `context` (prompt_cache_bytes)."""
    return MemoryTerms(
        limit.in_use, dense, context, margin_bytes(limit.bytes), prompt_cache_bytes(prompt_cache, context)
    )


def prompt_cache_bytes(setting: PromptCacheRam, context: ContextBytes) -> int:
    """RAM for the prompt cache: `setting` bytes, or for "auto" one full context's sequence state
    (a slot's share of the KV cache plus llama.cpp's per-cell record, a position and a sequence id,
    12 bytes, rounded up to 16, and 1 MiB for the per-layer headers); None: no prompt cache."""
    if setting is None:
        return 0
    if setting == "auto":
        return (context.kv + context.n_ctx * 16) // context.n_seq + _MIB
    return setting


def choose_budget(
    *,
    requested: int | None,
    expert_bytes: int,
    layer_bytes: int,
    terms: MemoryTerms,
    limit: MemoryLimit,
    n_ctx: int,
) -> BudgetChoice:
    """The expert budget: `requested` bytes as given (a warning when it and the rest exceed the
    limit), or automatic when it is None (ConfigError when the rest leaves less than one layer's
    experts: this context cannot be held in this memory)."""
    free = limit.bytes - terms.total
    why = f"{limit.source} {_mib(limit.bytes)} - {terms.describe()}"
    if requested is not None:
        check_budget_floor(requested, layer_bytes)
        if requested > free:
            logger.warning(
                "expert budget %s + the rest (%s) exceed the memory limit (%s %s) by %s: a prompt "
                "that fills the %d-token context may get the process killed; lower --budget or --ctx-size",
                _mib(requested),
                terms.describe(),
                limit.source,
                _mib(limit.bytes),
                _mib(requested - free),
                n_ctx,
            )
        return BudgetChoice(requested, "given explicitly")
    if free >= expert_bytes:
        return BudgetChoice(
            expert_bytes, f"auto: {why} >= all experts ({_mib(expert_bytes)}): everything cached"
        )
    if free < layer_bytes:
        raise ConfigError(
            f"not enough memory for {_contexts(terms, n_ctx)}: {why} = {_mib(free)}, below one layer's "
            f"experts ({_mib(layer_bytes)}); {_context_levers(terms)}, free memory, or use a smaller model"
        )
    return BudgetChoice(free, f"auto: {why}")


def _contexts(terms: MemoryTerms, n_ctx: int) -> str:
    """The context the memory must hold, in the words of a refusal: each slot's when several."""
    n_seq = terms.context.n_seq
    return f"{n_seq} contexts of {n_ctx // n_seq} tokens" if n_seq > 1 else f"a {n_ctx}-token context"


def _context_levers(terms: MemoryTerms) -> str:
    """What shrinks the context, in the words of a refusal."""
    levers = "lower --ctx-size" + (" or --parallel" if terms.context.n_seq > 1 else "")
    if not terms.context.flash_attn:
        levers += ", set --flash-attn on (attention buffers about 6x smaller; docs/memory.md)"
    return levers


def check_budget_floor(requested: int, layer_bytes: int) -> None:
    """An explicit budget must hold one layer's experts, which one prompt can route to."""
    if requested < layer_bytes:
        raise ConfigError(
            f"budget {format_size(requested, unit='MiB', digits=1)} is smaller than one layer's experts "
            f"({format_size(layer_bytes, unit='MiB', digits=1)}), which one prompt can route to"
        )


def check_resident(terms: MemoryTerms, limit: MemoryLimit, mapped_bytes: int, n_ctx: int) -> None:
    """A resident model's context and weights in RAM must fit beside the process (ConfigError
    otherwise); its mapped weights (`mapped_bytes`) should too (the page cache holds them; a warning
    when they do not: they are read again and again from flash)."""
    why = f"{limit.source} {_mib(limit.bytes)} - {terms.describe()}"
    free = limit.bytes - terms.total
    if free < 0:
        raise ConfigError(
            f"not enough memory for {_contexts(terms, n_ctx)}: {why} = {_mib(free)}; "
            f"{_context_levers(terms)} or free memory"
        )
    if free < mapped_bytes:
        logger.warning(
            "the model's mapped weights (%s) do not fit in what the context leaves (%s = %s): they will "
            "be read from flash again and again; --mode streaming bounds that",
            _mib(mapped_bytes),
            why,
            _mib(free),
        )


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


def max_heads(metadata: Mapping[str, Any]) -> int:
    """The most attention heads of any layer (a scalar or a per-layer array in the header)."""
    arch = metadata.get("general.architecture", "")
    return max((int(v) for v in _numbers(metadata.get(f"{arch}.attention.head_count"))), default=1)
