"""What a synthetic model looks like: `ModelSpec` (a frozen, self-validating shape), `QType`, and
`TensorSpec` (one tensor of the plan archs.py makes from a ModelSpec)."""

from __future__ import annotations

import dataclasses
import enum
import math

from server.errors import ModelGenError
from server.modelgen.tokenizer import base_vocab_size

# llama.cpp limits (src/llama-hparams.h)
LLAMA_MAX_LAYERS = 512
LLAMA_MAX_EXPERTS = 1024

# the architectures the generator writes, as llama.cpp spells them in general.architecture
ARCHITECTURES = ("qwen3moe", "gpt-oss", "llama", "qwen2moe", "hy_v3", "gemma4")

# architectures whose MoE block has an always-active shared expert (n_ff_shexp > 0 required);
# gemma4's is a dense MLP beside the experts (ffn_gate/up/down, feed_forward_length)
SHARED_EXPERT_ARCHS = frozenset({"qwen2moe", "hy_v3", "gemma4"})

# gemma4 attends through a sliding window on five layers of six; every sixth and the last layer
# attend to the whole context (Gemma-4-26B-A4B: layers 5, 11, 17, 23, 29 of 30)
GEMMA4_FULL_ATTN_PERIOD = 6


class QType(enum.Enum):
    """Tensor storage types the generator writes: (ggml type id, values per block, bytes per block)."""

    F32 = (0, 1, 4)
    F16 = (1, 1, 2)
    Q4_0 = (2, 32, 18)
    Q5_0 = (6, 32, 22)
    Q8_0 = (8, 32, 34)
    MXFP4 = (39, 32, 17)
    Q4_K = (12, 256, 144)
    Q6_K = (14, 256, 210)

    @property
    def ggml_type(self) -> int:
        return self.value[0]

    @property
    def block_size(self) -> int:
        return self.value[1]

    @property
    def type_size(self) -> int:
        return self.value[2]

    def row_bytes(self, n: int) -> int:
        """Bytes of a row of `n` values (n must be a multiple of block_size)."""
        return n // self.block_size * self.type_size

    @classmethod
    def parse(cls, name: str) -> QType:
        try:
            return cls[name.upper()]
        except KeyError:
            valid = ", ".join(q.name for q in WEIGHT_QTYPES)
            raise ModelGenError(f"unknown quantization type {name!r}; valid: {valid}") from None


# types a weight matrix may be stored in (F32 is reserved for norms, biases and routers)
WEIGHT_QTYPES = (QType.F16, QType.Q8_0, QType.Q5_0, QType.Q4_0, QType.MXFP4, QType.Q4_K, QType.Q6_K)

# llama_ftype (include/llama.h) written to general.file_type, keyed by the expert type (Q4_K
# experts: Q4_K_M, the recipe whose ffn_down layout `down_qtype` reproduces)
FILE_TYPES = {
    QType.F16: 1,
    QType.Q4_0: 2,
    QType.Q8_0: 7,
    QType.Q5_0: 8,
    QType.MXFP4: 38,
    QType.Q4_K: 15,
    QType.Q6_K: 18,
}


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """The shape and storage of a synthetic MoE model; validated on construction.

    Dimensions follow llama.cpp's hparams. `head_dim=None` means n_embd // n_head. The expert
    matrices use `expert_qtype`, the other weight matrices `dense_qtype`; norms, biases, routers
    and attention sinks are always F32. `down_qtype` (None: `expert_qtype`) stores ffn_down_exps
    on the layers llama.cpp's Q4_K_M recipe gives more bits (`more_bits_layer`), as real
    Q4_K_M files do (Qwen3-30B-A3B: Q6_K down on 24 of 48 layers, Q4_K on the rest), so one
    expert's slices differ in type and the layers differ in expert size; `down_qtype_rest`
    (None: `expert_qtype`) is ffn_down_exps' type on the other layers, for widths a K-quant
    cannot store (Gemma-4's 704: Q5_0, and Q8_0 where Q4_K_M asks for Q6_K). `n_ff_shexp` is
    the shared expert's FFN width (qwen2moe, hy_v3; gemma4's dense MLP beside the experts; 0
    elsewhere). `n_swa` is the sliding-window length (gpt-oss, gemma4). gemma4's full-attention
    layers use `head_dim` and `n_head_kv`, its sliding-window layers `head_dim_swa` and
    `n_head_kv_swa` (None: the same); other architectures leave those None. `tied_embeddings`
    leaves out output.weight: the embeddings double as the output matrix.
    """

    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int | None
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    n_vocab: int
    n_ctx: int
    expert_qtype: QType
    dense_qtype: QType
    down_qtype: QType | None = None
    down_qtype_rest: QType | None = None
    n_ff_shexp: int = 0
    n_swa: int = 128
    head_dim_swa: int | None = None
    n_head_kv_swa: int | None = None
    rope_freq_base: float = 1_000_000.0
    rms_eps: float = 1e-6
    alignment: int = 32
    name: str = ""
    # no output.weight: llama.cpp multiplies by the token embeddings instead (Gemma, small Qwens)
    tied_embeddings: bool = False

    def __post_init__(self) -> None:
        problems = _problems(self)
        if problems:
            raise ModelGenError("invalid model shape: " + "; ".join(problems))

    @property
    def head_size(self) -> int:
        """Per-head q/k/v width (head_dim, or n_embd // n_head when head_dim is None)."""
        return self.head_dim if self.head_dim is not None else self.n_embd // self.n_head

    @property
    def n_embd_q(self) -> int:
        return self.n_head * self.head_size

    @property
    def n_embd_kv(self) -> int:
        return self.n_head_kv * self.head_size

    def is_swa_layer(self, layer: int) -> bool:
        """Whether layer `layer` attends through the sliding window (gemma4's pattern; gpt-oss's is
        llama.cpp's built-in one and not written to the file)."""
        if self.arch != "gemma4":
            return False
        return layer != self.n_layer - 1 and (layer + 1) % GEMMA4_FULL_ATTN_PERIOD != 0

    def head_size_of(self, layer: int) -> int:
        """Per-head q/k/v width of layer `layer`."""
        if self.is_swa_layer(layer) and self.head_dim_swa is not None:
            return self.head_dim_swa
        return self.head_size

    def n_head_kv_of(self, layer: int) -> int:
        """Key/value heads of layer `layer`."""
        if self.is_swa_layer(layer) and self.n_head_kv_swa is not None:
            return self.n_head_kv_swa
        return self.n_head_kv

    def down_qtype_of(self, layer: int) -> QType:
        """The storage type of layer `layer`'s ffn_down_exps."""
        if self.down_qtype is not None and more_bits_layer(layer, self.n_ffn_down):
            return self.down_qtype
        return self.down_qtype_rest or self.expert_qtype

    @property
    def n_ffn_down(self) -> int:
        """How many ffn_down tensors the Q4_K_M recipe counts layers over: gemma4 has two per layer
        (its dense MLP's and the experts'), and the published Gemma-4-26B-A4B Q4_K_M file was made
        with a llama.cpp that counted both (its layers 0-6, 9, 12, ..., 27 have the bigger
        experts: use_more_bits over 60, as the route trace's header shows)."""
        return 2 * self.n_layer if self.arch == "gemma4" else self.n_layer

    def expert_bytes_of(self, layer: int) -> int:
        """Bytes of one expert's slices in layer `layer` (gate + up + down weights, biases excluded)."""
        gate_up = 2 * self.n_ff_exp * self.expert_qtype.row_bytes(self.n_embd)
        down = self.n_embd * self.down_qtype_of(layer).row_bytes(self.n_ff_exp)
        return gate_up + down

    @property
    def routed_bytes_per_token(self) -> int:
        """Expert bytes one decoded token reads when nothing is cached (used experts x layers)."""
        return self.n_expert_used * sum(self.expert_bytes_of(il) for il in range(self.n_layer))

    @property
    def bytes_per_expert(self) -> int:
        """Bytes of one expert in one layer, the mean over the layers (they differ with down_qtype)."""
        return self.routed_bytes_per_token // (self.n_expert_used * self.n_layer)

    def describe(self) -> str:
        """One-line human summary of the shape."""
        beside = "dense MLP" if self.arch == "gemma4" else "shared"
        shexp = f" + {beside} ff {self.n_ff_shexp}" if self.n_ff_shexp else ""
        heads = f"heads {self.n_head}/{self.n_head_kv} x {self.head_size}"
        if self.arch == "gemma4":
            n_swa = sum(self.is_swa_layer(il) for il in range(self.n_layer))
            kv_swa = self.n_head_kv_swa if self.n_head_kv_swa is not None else self.n_head_kv
            hd_swa = self.head_dim_swa if self.head_dim_swa is not None else self.head_size
            swa = f"{self.n_head}/{kv_swa} x {hd_swa}"
            heads += f" ({swa} on {n_swa} sliding-window layers, window {self.n_swa})"
        return (
            f"{self.arch}, {self.n_layer} layers, n_embd {self.n_embd}, {heads}, "
            f"experts {self.n_expert_used}/{self.n_expert} x ff {self.n_ff_exp}{shexp} "
            f"({self.expert_qtype.name}{self._down_note()}; dense {self.dense_qtype.name}), "
            f"vocab {self.n_vocab}, ctx {self.n_ctx}"
        )

    def _down_note(self) -> str:
        rest = self.down_qtype_rest or self.expert_qtype
        note = "" if rest is self.expert_qtype else f", down {rest.name}"
        if self.down_qtype is None or self.down_qtype is rest:
            return note
        n = sum(more_bits_layer(il, self.n_ffn_down) for il in range(self.n_layer))
        return f"{note}, down {self.down_qtype.name} on {n} of {self.n_layer} layers"


def more_bits_layer(layer: int, n_layer: int) -> bool:
    """llama.cpp's use_more_bits (src/llama-quant.cpp): the layers whose ffn_down a Q4_K_M file
    stores in Q6_K: the first and last eighth, and every third layer between."""
    eighth = n_layer // 8
    return layer < eighth or layer >= 7 * n_layer // 8 or (layer - eighth) % 3 == 2


def _problems(s: ModelSpec) -> list[str]:
    """Every reason `s` cannot become a model llama.cpp loads; empty when it is fine."""
    if s.arch not in ARCHITECTURES:
        return [f"unknown architecture {s.arch!r}; valid: {', '.join(ARCHITECTURES)}"]
    # the later checks compute with the fields: a field of the wrong type or sign ends the list
    out = _count_problems(s) or _type_problems(s)
    if out:
        return out
    _add_limit_problems(s, out)
    _add_head_problems(s, out)
    _add_layout_problems(s, out)
    _add_qtype_problems(s, out)
    if not out:
        _add_block_problems(s, out)
    _add_scalar_problems(s, out)
    return out


def _count_problems(s: ModelSpec) -> list[str]:
    """The counts that must be positive integers and are not."""
    out: list[str] = []
    positive = ("n_layer", "n_embd", "n_head", "n_head_kv", "n_expert", "n_expert_used", "n_ff_exp")
    for field in (*positive, "n_vocab", "n_ctx"):
        value = getattr(s, field)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            out.append(f"{field} must be a positive integer (got {value!r})")
    return out


def _type_problems(s: ModelSpec) -> list[str]:
    """The storage types that are not QTypes, and gemma4's sliding-window fields out of place."""
    out: list[str] = []
    for field in ("expert_qtype", "dense_qtype"):
        if not isinstance(getattr(s, field), QType):
            out.append(f"{field} must be a QType")
    for field in ("down_qtype", "down_qtype_rest"):
        if getattr(s, field) is not None and not isinstance(getattr(s, field), QType):
            out.append(f"{field} must be a QType or None")
    for field in ("head_dim_swa", "n_head_kv_swa"):
        value = getattr(s, field)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            out.append(f"{field} must be a positive integer or None (got {value!r})")
        elif value is not None and s.arch != "gemma4":
            out.append(f"{field} is for gemma4's sliding-window layers; {s.arch} has none (leave it None)")
    return out


def _add_limit_problems(s: ModelSpec, out: list[str]) -> None:
    """llama.cpp's limits on layers and experts."""
    if s.n_layer > LLAMA_MAX_LAYERS:
        out.append(f"n_layer {s.n_layer} exceeds llama.cpp's limit of {LLAMA_MAX_LAYERS}")
    if s.n_expert > LLAMA_MAX_EXPERTS:
        out.append(f"n_expert {s.n_expert} exceeds llama.cpp's limit of {LLAMA_MAX_EXPERTS}")
    if s.n_expert_used > s.n_expert:
        out.append(f"n_expert_used {s.n_expert_used} exceeds n_expert {s.n_expert}")


def _add_head_problems(s: ModelSpec, out: list[str]) -> None:
    """The attention heads' widths and counts (a width is checked once the earlier checks pass)."""
    if s.head_dim is None:
        if s.n_embd % s.n_head:
            out.append(f"n_embd {s.n_embd} is not divisible by n_head {s.n_head} (or give head_dim)")
    elif not isinstance(s.head_dim, int) or isinstance(s.head_dim, bool) or s.head_dim < 1:
        out.append(f"head_dim must be a positive integer or None (got {s.head_dim!r})")
    for field in ("n_head_kv", "n_head_kv_swa"):
        kv = getattr(s, field)
        if kv is not None and s.n_head % kv:
            out.append(f"n_head {s.n_head} is not a multiple of {field} {kv}")
    if not out and s.head_size % 2:
        out.append(f"head_dim {s.head_size} must be even (RoPE rotates pairs)")
    if s.head_dim_swa is not None and s.head_dim_swa % 2:
        out.append(f"head_dim_swa {s.head_dim_swa} must be even (RoPE rotates pairs)")
    if not out and s.arch == "qwen2moe" and s.n_embd_q != s.n_embd:
        out.append(f"qwen2moe needs n_head * head_dim == n_embd ({s.n_head} * {s.head_size} != {s.n_embd})")


def _add_layout_problems(s: ModelSpec, out: list[str]) -> None:
    """What the architecture needs: a shared expert or none, a sliding window, enough layers."""
    if s.arch in SHARED_EXPERT_ARCHS:
        if s.n_ff_shexp < 1:
            out.append(f"{s.arch} has a shared expert: n_ff_shexp must be positive (got {s.n_ff_shexp})")
    elif s.n_ff_shexp != 0:
        out.append(f"{s.arch} has no shared expert: n_ff_shexp must be 0 (got {s.n_ff_shexp})")
    if s.arch in ("gpt-oss", "gemma4") and s.n_swa < 1:
        out.append(f"{s.arch} needs a positive sliding window n_swa (got {s.n_swa})")
    if s.arch == "gemma4" and s.n_layer < 2:
        # llama.cpp's gemma4 KV cache needs a sliding-window layer besides the last (full) one
        out.append(f"gemma4 needs at least 2 layers (got {s.n_layer})")


def _add_qtype_problems(s: ModelSpec, out: list[str]) -> None:
    """Storage types that are not weight types, and MXFP4 where llama.cpp does not take it."""
    typed = [("expert_qtype", s.expert_qtype), ("dense_qtype", s.dense_qtype)]
    typed += [(f, getattr(s, f)) for f in ("down_qtype", "down_qtype_rest") if getattr(s, f) is not None]
    for field, qtype in typed:
        if qtype not in WEIGHT_QTYPES:
            out.append(
                f"{field} {qtype.name} is not a weight type ({', '.join(q.name for q in WEIGHT_QTYPES)})"
            )
    if QType.MXFP4 in (s.expert_qtype, s.down_qtype, s.down_qtype_rest) and s.arch != "gpt-oss":
        out.append(f"MXFP4 experts are only supported for gpt-oss, not {s.arch}")
    if s.dense_qtype is QType.MXFP4:
        out.append("MXFP4 is for expert tensors only; use F16, Q8_0, Q4_0, Q4_K or Q6_K for dense_qtype")


def _add_block_problems(s: ModelSpec, out: list[str]) -> None:
    """Every quantized matrix's row (ne0) must hold whole blocks."""
    rows = {"n_embd": s.n_embd, "n_head * head_dim": s.n_embd_q}
    if s.head_dim_swa is not None:
        rows["n_head * head_dim_swa"] = s.n_head * s.head_dim_swa
    if s.n_ff_shexp:
        rows["n_ff_shexp"] = s.n_ff_shexp
    for label, n in rows.items():
        if n % s.dense_qtype.block_size:
            out.append(
                f"{label} = {n} is not a multiple of {s.dense_qtype.name}'s block of "
                f"{s.dense_qtype.block_size}"
            )
    # gate and up rows are n_embd wide, down rows n_ff_exp
    down = {s.down_qtype_of(il) for il in range(s.n_layer)}
    widths = [("n_embd", s.n_embd, s.expert_qtype)]
    widths += [("n_ff_exp", s.n_ff_exp, q) for q in sorted(down, key=lambda q: q.name)]
    for label, n, qtype in dict.fromkeys(widths):
        if n % qtype.block_size:
            out.append(f"{label} = {n} is not a multiple of {qtype.name}'s block of {qtype.block_size}")


def _add_scalar_problems(s: ModelSpec, out: list[str]) -> None:
    """The vocabulary's size, the alignment and the float hyperparameters."""
    if s.n_vocab >= 2**31:
        out.append(f"n_vocab {s.n_vocab} does not fit llama.cpp's int32 token ids")
    elif not out and s.n_vocab < base_vocab_size(s.arch):
        out.append(
            f"n_vocab {s.n_vocab} is smaller than the {s.arch} tokenizer's "
            f"{base_vocab_size(s.arch)} base tokens"
        )
    if not (isinstance(s.alignment, int) and s.alignment >= 8 and s.alignment & (s.alignment - 1) == 0):
        out.append(f"alignment must be a power of two >= 8 (got {s.alignment!r})")
    if not (math.isfinite(s.rope_freq_base) and s.rope_freq_base > 0):
        out.append(f"rope_freq_base must be positive (got {s.rope_freq_base})")
    if not (math.isfinite(s.rms_eps) and s.rms_eps > 0):
        out.append(f"rms_eps must be positive (got {s.rms_eps})")


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One tensor to generate: name, ggml-order shape, storage type, and its value spread."""

    name: str
    ne: tuple[int, ...]
    qtype: QType
    std: float
    mean: float = 0.0

    @property
    def n_elements(self) -> int:
        return math.prod(self.ne)

    @property
    def nbytes(self) -> int:
        return self.n_elements // self.qtype.block_size * self.qtype.type_size
