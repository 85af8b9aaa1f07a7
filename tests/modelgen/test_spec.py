"""ModelSpec validation, presets, quant-type table, and the size/shape arithmetic."""

from __future__ import annotations

import dataclasses
from typing import Any

import gguf
import pytest

from server.cli.make_model import parse_size
from server.errors import ModelGenError
from server.modelgen import ARCHITECTURES, ModelSpec, QType, estimate_size, preset, preset_names
from server.modelgen.spec import more_bits_layer
from server.modelgen.tokenizer import FAMILY_BY_ARCH, base_vocab_size

TINY = [name for name in preset_names() if name.startswith("tiny-")]


def test_required_presets_exist() -> None:
    required = {
        "tiny-qwen3moe",
        "tiny-gptoss",
        "tiny-mixtral",
        "tiny-qwen2moe",
        "tiny-hyv3",
        "tiny-gemma4",
        "qwen30b-shape",
        "gemma4-26b-shape",
        "gptoss-120b-shape",
        "gptoss-20b-shape",
        "gptoss-shape",
        "mixtral-shape",
    }
    assert required <= set(preset_names())
    assert {preset(n).arch for n in TINY} == set(ARCHITECTURES)


def test_unknown_preset_lists_the_valid_names() -> None:
    with pytest.raises(ModelGenError, match=r"unknown preset 'nope'; valid: .*tiny-qwen3moe.*qwen30b-shape"):
        preset("nope")


@pytest.mark.parametrize("name", TINY)
def test_tiny_presets_are_a_few_mb(name: str) -> None:
    assert 1 << 20 < estimate_size(preset(name)) < 16 << 20


def test_real_shapes_match_the_published_models() -> None:
    q = preset("qwen30b-shape")
    assert (q.arch, q.n_layer, q.n_embd, q.n_head, q.n_head_kv, q.head_size) == (
        "qwen3moe",
        48,
        2048,
        32,
        4,
        128,
    )
    assert (q.n_expert, q.n_expert_used, q.n_ff_exp, q.n_vocab, q.expert_qtype) == (
        128,
        8,
        768,
        151936,
        QType.Q4_0,
    )
    # 48 layers x 8 experts x 3 x 2048 x 768 Q4_0 weights: ~1 GB routed per token (docs/benchmarks.md)
    assert q.routed_bytes_per_token == 48 * 8 * 3 * 2048 * 768 // 32 * 18
    g = preset("gptoss-120b-shape")
    assert (g.arch, g.n_layer, g.n_embd, g.n_head, g.n_head_kv, g.head_size) == (
        "gpt-oss",
        36,
        2880,
        64,
        8,
        64,
    )
    assert (g.n_expert, g.n_expert_used, g.n_ff_exp, g.n_vocab, g.expert_qtype) == (
        128,
        4,
        2880,
        201088,
        QType.MXFP4,
    )
    assert round(g.bytes_per_expert / 1e6, 1) == 13.2  # "13 MB per expert" (docs/benchmarks.md)
    assert preset("gptoss-shape") == g
    small = preset("gptoss-20b-shape")
    assert (small.n_layer, small.n_expert) == (24, 32)
    m = preset("mixtral-shape")
    assert (m.arch, m.n_layer, m.n_embd, m.n_expert, m.n_expert_used, m.n_ff_exp, m.n_vocab) == (
        "llama",
        32,
        4096,
        8,
        2,
        14336,
        32000,
    )
    assert 16.5e9 < estimate_size(q) < 18.5e9
    assert 60e9 < estimate_size(g) < 65e9


def _bad(name: str, message: str, **changes: Any) -> Any:
    return pytest.param(
        name, changes, message, id=f"{name}:" + ",".join(f"{k}={v}" for k, v in changes.items())
    )


@pytest.mark.parametrize(
    ("name", "changes", "message"),
    [
        _bad("tiny-qwen3moe", r"unknown architecture 'mamba'; valid: qwen3moe, gpt-oss", arch="mamba"),
        _bad("tiny-qwen3moe", r"n_expert_used 17 exceeds n_expert 16", n_expert_used=17),
        _bad("tiny-qwen3moe", r"n_expert must be a positive integer", n_expert=0),
        _bad("tiny-qwen3moe", r"n_layer must be a positive integer", n_layer=-1),
        _bad("tiny-qwen3moe", r"n_layer 513 exceeds llama.cpp's limit of 512", n_layer=513),
        _bad("tiny-qwen3moe", r"exceeds llama.cpp's limit of 1024", n_expert=1025),
        _bad("tiny-qwen3moe", r"224 is not divisible by n_head 3", n_embd=224, n_head=3, head_dim=None),
        _bad("tiny-qwen3moe", r"n_head 4 is not a multiple of n_head_kv 3", n_head=4, n_head_kv=3),
        _bad("tiny-qwen3moe", r"head_dim 33 must be even", head_dim=33),
        _bad("tiny-qwen3moe", r"head_dim must be a positive integer or None \(got 0\)", head_dim=0),
        _bad("tiny-qwen3moe", r"n_ff_exp = 100 is not a multiple of Q4_0's block of 32", n_ff_exp=100),
        _bad("tiny-qwen3moe", r"n_embd = 200 is not a multiple of Q8_0's", n_embd=200, head_dim=64),
        _bad("tiny-qwen3moe", r"MXFP4 experts are only supported for gpt-oss", expert_qtype=QType.MXFP4),
        _bad("tiny-gptoss", r"MXFP4 is for expert tensors only", dense_qtype=QType.MXFP4),
        _bad("tiny-gptoss", r"expert_qtype F32 is not a weight type", expert_qtype=QType.F32),
        _bad("tiny-gptoss", r"sliding window", n_swa=0),
        _bad("tiny-qwen3moe", r"n_vocab 300 is smaller than the qwen3moe tokenizer's", n_vocab=300),
        _bad("tiny-qwen2moe", r"qwen2moe has a shared expert: n_ff_shexp must be positive", n_ff_shexp=0),
        _bad("tiny-qwen3moe", r"qwen3moe has no shared expert", n_ff_shexp=128),
        _bad("tiny-qwen2moe", r"qwen2moe needs n_head \* head_dim == n_embd", head_dim=32),
        _bad("tiny-qwen3moe", r"alignment must be a power of two", alignment=48),
        _bad("tiny-qwen3moe", r"rms_eps must be positive", rms_eps=0.0),
        _bad("tiny-qwen3moe", r"MXFP4 experts are only supported for gpt-oss", down_qtype=QType.MXFP4),
        _bad("tiny-qwen3moe", r"down_qtype F32 is not a weight type", down_qtype=QType.F32),
        _bad("tiny-qwen3moe", r"down_qtype must be a QType or None", down_qtype="Q8_0"),
        _bad("tiny-qwen3moe", r"down_qtype_rest must be a QType or None", down_qtype_rest="Q8_0"),
        _bad("tiny-qwen3moe", r"head_dim_swa is for gemma4's sliding-window layers", head_dim_swa=32),
        _bad("tiny-gptoss", r"n_head_kv_swa is for gemma4's sliding-window layers", n_head_kv_swa=2),
        _bad("tiny-gemma4", r"gemma4 needs at least 2 layers \(got 1\)", n_layer=1),
        _bad("tiny-gemma4", r"gemma4 needs a positive sliding window", n_swa=0),
        _bad("tiny-gemma4", r"n_head 4 is not a multiple of n_head_kv_swa 3", n_head_kv_swa=3),
        _bad("tiny-gemma4", r"head_dim_swa 33 must be even", head_dim_swa=33),
        _bad("tiny-gemma4", r"head_dim_swa must be a positive integer or None \(got 0\)", head_dim_swa=0),
        _bad("tiny-gemma4", r"gemma4 has a shared expert: n_ff_shexp must be positive", n_ff_shexp=0),
        _bad(
            "tiny-gemma4",
            r"n_ff_exp = 96 is not a multiple of Q4_K's block of 256",
            expert_qtype=QType.Q4_K,
            down_qtype=QType.Q8_0,
        ),
        _bad(
            "tiny-qwen3moe",
            r"n_ff_exp = 48 is not a multiple of Q4_0's block of 32",
            n_ff_exp=48,
            expert_qtype=QType.F16,
            down_qtype=QType.Q4_0,
        ),
    ],
)
def test_impossible_shapes_are_refused(name: str, changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ModelGenError, match=message):
        dataclasses.replace(preset(name), **changes)


def test_more_bits_layers_follow_llama_cpps_q4_k_m_recipe() -> None:
    # the Qwen3-30B-A3B Q4_K_M route trace's header (bench/route-traces) gives 3059712
    # bytes per expert (Q6_K down) on exactly these layers and 2654208 (Q4_K down) on the others
    qwen_q6_k = [*range(6), *range(8, 42, 3), *range(42, 48)]
    assert [il for il in range(48) if more_bits_layer(il, 48)] == qwen_q6_k
    assert [il for il in range(4) if more_bits_layer(il, 4)] == [2, 3]


def test_gemma4_shape_has_the_real_files_expert_bytes() -> None:
    # the Gemma-4-26B-A4B Q4_K_M route trace's header (bench/route-traces): 4336640 bytes
    # per expert (Q4_K gate_up, Q8_0 down) on layers 0-6 and every third from 9 to 27, 3593216
    # (Q5_0 down) on the others: use_more_bits over its 60 ffn_down tensors
    spec = preset("gemma4-26b-shape")
    big = [*range(7), *range(9, 28, 3)]
    assert [il for il in range(30) if spec.expert_bytes_of(il) == 4336640] == big
    assert {spec.expert_bytes_of(il) for il in range(30) if il not in big} == {3593216}
    # five sliding-window layers to each full-attention one, the last layer full
    assert [il for il in range(30) if not spec.is_swa_layer(il)] == [5, 11, 17, 23, 29]
    assert (spec.head_size_of(0), spec.n_head_kv_of(0), spec.head_size_of(5), spec.n_head_kv_of(5)) == (
        256,
        8,
        512,
        2,
    )


def test_q4km_shape_has_the_real_files_expert_bytes() -> None:
    # the Qwen3-30B-A3B Q4_K_M route trace's header: 3059712 bytes per expert on the layers with
    # Q6_K down, 2654208 on the others
    spec = preset("qwen30b-q4km-shape")
    assert {spec.expert_bytes_of(il) for il in range(48)} == {3059712, 2654208}
    assert [spec.expert_bytes_of(il) == 3059712 for il in range(48)] == [
        more_bits_layer(il, 48) for il in range(48)
    ]
    assert dataclasses.replace(spec, down_qtype=None, expert_qtype=QType.Q4_0) == dataclasses.replace(
        preset("qwen30b-shape"), name=spec.name
    )


def test_down_qtype_sizes_the_layers_apart() -> None:
    base = preset("qwen30b-shape")
    mixed = dataclasses.replace(base, down_qtype=QType.Q8_0)
    gate_up = 2 * 768 * 2048 // 32 * 18
    assert mixed.expert_bytes_of(0) == gate_up + 2048 * 768 // 32 * 34  # layer 0: more bits
    assert mixed.expert_bytes_of(6) == gate_up + 2048 * 768 // 32 * 18 == base.expert_bytes_of(6)
    assert mixed.down_qtype_of(0) is QType.Q8_0 and mixed.down_qtype_of(6) is QType.Q4_0
    assert mixed.routed_bytes_per_token == 8 * (24 * mixed.expert_bytes_of(0) + 24 * mixed.expert_bytes_of(6))
    assert mixed.bytes_per_expert == mixed.routed_bytes_per_token // (8 * 48)
    assert "down Q8_0 on 24 of 48 layers" in mixed.describe() and "down" not in base.describe()
    assert estimate_size(mixed) - estimate_size(base) == 24 * 128 * 2048 * 768 // 32 * (34 - 18)


def test_several_problems_are_reported_together() -> None:
    with pytest.raises(
        ModelGenError, match=r"n_expert_used 9 exceeds n_expert 8.*n_head 4 is not a multiple"
    ):
        dataclasses.replace(preset("tiny-qwen3moe"), n_expert=8, n_expert_used=9, n_head_kv=3)


def test_head_dim_none_derives_from_n_embd() -> None:
    spec = dataclasses.replace(preset("tiny-qwen3moe"), head_dim=None, n_head=8)
    assert spec.head_size == 32 and spec.n_embd_q == spec.n_embd


def test_qtype_table_matches_ggml() -> None:
    for q in QType:
        assert gguf.GGMLQuantizationType[q.name].value == q.ggml_type
        assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[q.name]] == (q.block_size, q.type_size)


def test_qtype_parse() -> None:
    assert QType.parse("q4_0") is QType.Q4_0
    valid = "F16, Q8_0, Q5_0, Q4_0, MXFP4, Q4_K, Q6_K"
    with pytest.raises(ModelGenError, match=rf"unknown quantization type 'Q5_K'; valid: {valid}"):
        QType.parse("Q5_K")


def test_every_architecture_has_a_tokenizer_family() -> None:
    assert set(FAMILY_BY_ARCH) == set(ARCHITECTURES)
    assert all(260 < base_vocab_size(a) < 512 for a in ARCHITECTURES)


def test_modelspec_is_frozen() -> None:
    spec = preset("tiny-qwen3moe")
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.n_layer = 2  # type: ignore[misc]
    assert isinstance(spec, ModelSpec)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1500", 1500),
        ("2G", 2_000_000_000),
        ("500M", 500_000_000),
        ("1.5K", 1500),
        ("4GiB", 4 * 2**30),
        ("3mib", 3 << 20),
    ],
)
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "G", "2X", "-1G", "0"])
def test_parse_size_refuses_garbage(text: str) -> None:
    with pytest.raises(ModelGenError, match="size"):
        parse_size(text)
