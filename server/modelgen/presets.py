"""Named model shapes: tiny ones for tests, and the real models' shapes for benchmarks.

The `*-shape` presets copy the published architecture of the real model (layers, widths, heads,
experts, vocabulary, context) with random weights. Their experts use the real release's
storage (Q4_0 stands in for Qwen's and Mixtral's Q4_K_M: same 4.5 bits per weight; gpt-oss
ships MXFP4; qwen30b-q4km-shape has the real Q4_K_M file's expert bytes, K-quants and all).
Their dense weights are Q8_0, as llama.cpp's MXFP4_MOE recipe stores gpt-oss's: at real
vocabulary sizes the embedding and output matrices are the biggest dense tensors.

The tiny presets (a few MB) load and decode in milliseconds; every width is a multiple of the
32-value quant block. tiny-gptoss keeps gpt-oss's quirk of a q projection wider than n_embd.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from server.errors import ModelGenError
from server.modelgen.spec import ModelSpec, QType


@dataclasses.dataclass(frozen=True)
class Preset:
    name: str
    description: str
    spec: ModelSpec


def _tiny(arch: str, **fields: Any) -> ModelSpec:
    """A tiny model of `arch`: the common tiny shape with `fields` changed."""
    common = ModelSpec(
        arch="qwen3moe",
        n_layer=3,
        n_embd=256,
        n_head=4,
        n_head_kv=2,
        head_dim=64,
        n_expert=16,
        n_expert_used=4,
        n_ff_exp=128,
        n_vocab=512,
        # generous, so servers can run tiny models at large context sizes without warnings
        n_ctx=32768,
        expert_qtype=QType.Q4_0,
        dense_qtype=QType.Q8_0,
    )
    return dataclasses.replace(common, arch=arch, **fields)


def _gptoss(n_layer: int, n_expert: int, name: str) -> ModelSpec:
    return ModelSpec(
        arch="gpt-oss",
        n_layer=n_layer,
        n_embd=2880,
        n_head=64,
        n_head_kv=8,
        head_dim=64,
        n_expert=n_expert,
        n_expert_used=4,
        n_ff_exp=2880,
        n_vocab=201088,
        n_ctx=131072,
        expert_qtype=QType.MXFP4,
        dense_qtype=QType.Q8_0,
        n_swa=128,
        rope_freq_base=150000.0,
        rms_eps=1e-5,
        name=name,
    )


_GPTOSS_120B = _gptoss(36, 128, "gptoss-120b-shape")
_GEMMA4_26B = ModelSpec(
    arch="gemma4",
    n_layer=30,
    n_embd=2816,
    n_head=16,
    n_head_kv=2,
    head_dim=512,
    head_dim_swa=256,
    n_head_kv_swa=8,
    n_expert=128,
    n_expert_used=8,
    n_ff_exp=704,
    n_ff_shexp=2112,
    n_vocab=262144,
    n_ctx=262144,
    expert_qtype=QType.Q4_K,
    dense_qtype=QType.Q8_0,
    down_qtype=QType.Q8_0,
    down_qtype_rest=QType.Q5_0,
    n_swa=1024,
    tied_embeddings=True,
    name="gemma4-26b-shape",
)
_QWEN30B = ModelSpec(
    arch="qwen3moe",
    n_layer=48,
    n_embd=2048,
    n_head=32,
    n_head_kv=4,
    head_dim=128,
    n_expert=128,
    n_expert_used=8,
    n_ff_exp=768,
    n_vocab=151936,
    n_ctx=40960,
    expert_qtype=QType.Q4_0,
    dense_qtype=QType.Q8_0,
    name="qwen30b-shape",
)
# every preset, tiny ones first
PRESETS: tuple[Preset, ...] = (
    Preset(
        "tiny-qwen3moe",
        "qwen3moe, 4 layers, 16 experts (4 used), Q4_0 experts, q/k norms",
        _tiny("qwen3moe", n_layer=4, name="tiny-qwen3moe"),
    ),
    Preset(
        "tiny-gptoss",
        "gpt-oss, 4 layers (2 sliding-window), 16 experts (4 used), MXFP4 experts, biases, sinks",
        _tiny(
            "gpt-oss",
            n_layer=4,
            n_embd=192,
            n_ff_exp=192,
            expert_qtype=QType.MXFP4,
            n_swa=64,
            rope_freq_base=150000.0,
            rms_eps=1e-5,
            name="tiny-gptoss",
        ),
    ),
    Preset(
        "tiny-mixtral",
        "llama (Mixtral layout), 3 layers, 8 experts (2 used), Q4_0 experts, [INST] template",
        _tiny(
            "llama",
            n_head=8,
            n_head_kv=4,
            head_dim=32,
            n_expert=8,
            n_expert_used=2,
            n_ff_exp=384,
            rms_eps=1e-5,
            name="tiny-mixtral",
        ),
    ),
    Preset(
        "tiny-qwen2moe",
        "qwen2moe, 3 layers, 12 experts (4 used) + gated shared expert, Q8_0 experts, F16 dense",
        _tiny(
            "qwen2moe",
            n_expert=12,
            n_ff_shexp=256,
            expert_qtype=QType.Q8_0,
            dense_qtype=QType.F16,
            name="tiny-qwen2moe",
        ),
    ),
    Preset(
        "tiny-hyv3",
        "hy_v3, 3 layers, 16 experts (4 used) in a merged gate_up tensor + shared expert, sigmoid router",
        _tiny("hy_v3", n_ff_shexp=128, name="tiny-hyv3"),
    ),
    Preset(
        "tiny-gemma4",
        "gemma4, 4 layers (3 sliding-window, 1 full with other head widths), 16 experts (4 used) "
        "in a merged gate_up tensor + dense MLP, router input scale, per-expert output scale",
        _tiny(
            "gemma4",
            n_layer=4,
            head_dim=64,
            n_head_kv=1,
            head_dim_swa=32,
            n_head_kv_swa=2,
            n_ff_exp=96,
            n_ff_shexp=128,
            n_swa=64,
            name="tiny-gemma4",
        ),
    ),
    Preset(
        "qwen30b-shape",
        "Qwen3-30B-A3B's shape: qwen3moe, 48 layers, 128 experts (8 used), Q4_0 experts, Q8_0 dense",
        _QWEN30B,
    ),
    Preset(
        "qwen30b-q4km-shape",
        "qwen30b-shape stored as the real Q4_K_M file's experts: Q4_K gate/up, Q6_K down on 24 "
        "of 48 layers (Q4_K elsewhere), so 2.92 or 2.53 MiB per expert by layer",
        dataclasses.replace(
            _QWEN30B,
            expert_qtype=QType.Q4_K,
            down_qtype=QType.Q6_K,
            name="qwen30b-q4km-shape",
        ),
    ),
    Preset(
        "qwen30b-q4km-k6-shape",
        "qwen30b-q4km-shape routing 6 experts per token, as the Qwen route trace was recorded "
        "(bench/route-traces/qwen.route.csv): the shape of trace-routed benchmarks",
        dataclasses.replace(
            _QWEN30B,
            n_expert_used=6,
            expert_qtype=QType.Q4_K,
            down_qtype=QType.Q6_K,
            name="qwen30b-q4km-k6-shape",
        ),
    ),
    Preset(
        "qwen30b-8l-shape",
        "qwen30b-shape, 8 layers, 32k vocabulary (~3 GB): the quick benchmark (make bench-small)",
        dataclasses.replace(_QWEN30B, n_layer=8, n_vocab=32000, name="qwen30b-8l-shape"),
    ),
    Preset(
        "gemma4-26b-shape",
        "Gemma-4-26B-A4B's shape with the real Q4_K_M file's experts: gemma4, 30 layers, 128 "
        "experts (8 used), Q4_K gate_up, Q5_0 down (Q8_0 on 14 layers, as the route trace's "
        "header), Q8_0 dense, tied embeddings",
        _GEMMA4_26B,
    ),
    Preset(
        "gemma4-26b-k6-shape",
        "gemma4-26b-shape routing 6 experts per token, as the Gemma route trace was recorded "
        "(bench/route-traces/gemma.route.csv): the shape of trace-routed benchmarks",
        dataclasses.replace(_GEMMA4_26B, n_expert_used=6, name="gemma4-26b-k6-shape"),
    ),
    Preset(
        "gptoss-120b-shape",
        "gpt-oss-120b's shape: 36 layers, 128 experts (4 used), MXFP4 experts, Q8_0 dense",
        _GPTOSS_120B,
    ),
    Preset(
        "gptoss-20b-shape",
        "gpt-oss-20b's shape: 24 layers, 32 experts (4 used), MXFP4 experts, Q8_0 dense",
        _gptoss(24, 32, "gptoss-20b-shape"),
    ),
    Preset(
        "gptoss-shape",
        "alias of gptoss-120b-shape (the name docs/benchmarks.md uses)",
        _GPTOSS_120B,
    ),
    Preset(
        "mixtral-shape",
        "Mixtral-8x7B's shape: llama, 32 layers, 8 experts (2 used), Q4_0 experts, Q8_0 dense",
        ModelSpec(
            arch="llama",
            n_layer=32,
            n_embd=4096,
            n_head=32,
            n_head_kv=8,
            head_dim=128,
            n_expert=8,
            n_expert_used=2,
            n_ff_exp=14336,
            n_vocab=32000,
            n_ctx=32768,
            expert_qtype=QType.Q4_0,
            dense_qtype=QType.Q8_0,
            rms_eps=1e-5,
            name="mixtral-shape",
        ),
    ),
)


def presets() -> tuple[Preset, ...]:
    """Every preset, tiny ones first."""
    return PRESETS


def preset_names() -> list[str]:
    """The valid preset names."""
    return [p.name for p in PRESETS]


def preset(name: str) -> ModelSpec:
    """The ModelSpec of preset `name`; ModelGenError listing the valid names if there is none."""
    for p in PRESETS:
        if p.name == name:
            return p.spec
    raise ModelGenError(f"unknown preset {name!r}; valid: {', '.join(preset_names())}")
