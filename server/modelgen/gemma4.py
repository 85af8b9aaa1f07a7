"""gemma4 (Gemma-4-26B-A4B's text model): its tensors and hyperparameter keys.

Source: llama.cpp 0c1e570 src/models/gemma4.cpp (load_arch_hparams, load_arch_tensors, the
graph) and conversion/gemma.py (Gemma4Model, which writes the keys). What sets it apart from the
other architectures the generator writes, and what a streamer must cope with:

- every MoE layer runs a dense MLP (ffn_gate/up/down, GELU) beside the experts and adds the two;
- the experts sit in one merged ffn_gate_up_exps tensor, with a per-expert output scale
  (ffn_down_exps.scale, F32, kept resident like any non-weight tensor);
- the router is not fed the MoE input: it reads rms_norm(attn_out) / sqrt(n_embd) times a
  learned per-channel scale (ffn_gate_inp.scale), and build_moe_ffn gets its logits ready-made;
- five layers of six attend through a sliding window with one head width and key/value head
  count, the rest to the whole context with another (Gemma-4-26B-A4B: 256 / 8 heads and 512 /
  2); full-attention layers have no v projection (the keys double as values) and share one
  rope_freqs tensor;
- norms around everything: q/k norms, post-attention, pre- and post-MLP, post-experts, and a
  scalar per layer output (layer_output_scale).

Value spreads: the token embedding has std 1/sqrt(n_embd) because gemma4 scales it by
sqrt(n_embd); every block output is rms-normed before it joins the residual stream, so the
weights of those two norms (post_attention_norm, post_ffw_norm) carry the GPT-2 1/sqrt(2 n_layer)
scale that keeps the sum of the layers comparable to the embedding.
"""

from __future__ import annotations

import math

from gguf import GGUFValueType

from server.modelgen.gguf_format import KV
from server.modelgen.spec import ModelSpec, QType, TensorSpec

# Gemma 4 caps the logits at +-30 with tanh (final_logit_softcapping in its config)
FINAL_LOGIT_SOFTCAP = 30.0
# RoPE base of the sliding-window layers (the full-attention ones use spec.rope_freq_base)
ROPE_FREQ_BASE_SWA = 10000.0


def global_tensors(spec: ModelSpec) -> list[TensorSpec]:
    """rope_freqs: one tensor the full-attention layers share (per-pair frequency factors; ones
    here, where the real file stops rotating three quarters of the pairs with 1e30)."""
    return [TensorSpec("rope_freqs.weight", (spec.head_size // 2,), QType.F32, std=0.0, mean=1.0)]


def block(spec: ModelSpec, il: int) -> list[TensorSpec]:
    """Layer `il`'s tensors (the full-attention layers have no attn_v)."""
    p = f"blk.{il}."
    e, n_exp, ff, mlp = spec.n_embd, spec.n_expert, spec.n_ff_exp, spec.n_ff_shexp
    hd = spec.head_size_of(il)
    q, kv = spec.n_head * hd, spec.n_head_kv_of(il) * hd
    dense, f32 = spec.dense_qtype, QType.F32
    res = 1.0 / math.sqrt(2 * spec.n_layer)
    in_std = 1.0 / math.sqrt(e)

    def norm(name: str, n: int, mean: float = 1.0) -> TensorSpec:
        return TensorSpec(p + name, (n,), f32, std=0.1 * mean, mean=mean)

    t = [
        norm("attn_norm.weight", e),
        TensorSpec(p + "attn_q.weight", (e, q), dense, in_std),
        TensorSpec(p + "attn_k.weight", (e, kv), dense, in_std),
    ]
    if spec.is_swa_layer(il):
        # full-attention layers have none: llama.cpp uses the keys as values there
        t.append(TensorSpec(p + "attn_v.weight", (e, kv), dense, in_std))
    t += [
        TensorSpec(p + "attn_output.weight", (q, e), dense, 1.0 / math.sqrt(q)),
        norm("attn_q_norm.weight", hd),
        norm("attn_k_norm.weight", hd),
        norm("post_attention_norm.weight", e, mean=res),
        TensorSpec(p + "layer_output_scale.weight", (1,), f32, std=0.05, mean=1.0),
        # the dense MLP beside the experts
        norm("ffn_norm.weight", e),
        TensorSpec(p + "ffn_gate.weight", (e, mlp), dense, in_std),
        TensorSpec(p + "ffn_up.weight", (e, mlp), dense, in_std),
        TensorSpec(p + "ffn_down.weight", (mlp, e), dense, 1.0 / math.sqrt(mlp)),
        norm("post_ffw_norm_1.weight", e),
        norm("post_ffw_norm.weight", e, mean=res),
        # router: F32, logits of std ~2 as the other architectures' (its input has rms
        # 1 / sqrt(n_embd) before the per-channel scale)
        TensorSpec(p + "ffn_gate_inp.weight", (e, n_exp), f32, std=2.0),
        # a per-channel scale of the router input, spread wide so that it changes the ranking
        # a router without it would give
        TensorSpec(p + "ffn_gate_inp.scale", (e,), f32, std=0.5, mean=1.0),
        norm("pre_ffw_norm_2.weight", e),
        TensorSpec(p + "ffn_gate_up_exps.weight", (e, 2 * ff, n_exp), spec.expert_qtype, in_std),
        TensorSpec(p + "ffn_down_exps.weight", (ff, e, n_exp), spec.down_qtype_of(il), 1.0 / math.sqrt(ff)),
        TensorSpec(p + "ffn_down_exps.scale", (n_exp,), f32, std=0.1, mean=1.0),
        norm("post_ffw_norm_2.weight", e),
    ]
    return t


def kvs(spec: ModelSpec) -> list[KV]:
    """The gemma4.* keys (general.* and tokenizer.* come from archs.model_kvs)."""
    a, u32, f32, arr, bool_ = (
        "gemma4",
        GGUFValueType.UINT32,
        GGUFValueType.FLOAT32,
        GGUFValueType.ARRAY,
        GGUFValueType.BOOL,
    )
    layers = range(spec.n_layer)
    swa_hd = spec.head_dim_swa if spec.head_dim_swa is not None else spec.head_size
    return [
        KV(f"{a}.context_length", u32, spec.n_ctx),
        KV(f"{a}.embedding_length", u32, spec.n_embd),
        KV(f"{a}.block_count", u32, spec.n_layer),
        KV(f"{a}.feed_forward_length", u32, spec.n_ff_shexp),
        KV(f"{a}.expert_feed_forward_length", u32, spec.n_ff_exp),
        KV(f"{a}.expert_count", u32, spec.n_expert),
        KV(f"{a}.expert_used_count", u32, spec.n_expert_used),
        KV(f"{a}.embedding_length_per_layer_input", u32, 0),
        KV(f"{a}.attention.head_count", u32, spec.n_head),
        KV(f"{a}.attention.head_count_kv", arr, [spec.n_head_kv_of(il) for il in layers], u32),
        KV(f"{a}.attention.key_length", u32, spec.head_size),
        KV(f"{a}.attention.value_length", u32, spec.head_size),
        KV(f"{a}.attention.key_length_swa", u32, swa_hd),
        KV(f"{a}.attention.value_length_swa", u32, swa_hd),
        KV(f"{a}.attention.sliding_window", u32, spec.n_swa),
        KV(f"{a}.attention.sliding_window_pattern", arr, [spec.is_swa_layer(il) for il in layers], bool_),
        KV(f"{a}.attention.shared_kv_layers", u32, 0),
        KV(f"{a}.attention.layer_norm_rms_epsilon", f32, spec.rms_eps),
        KV(f"{a}.rope.freq_base", f32, spec.rope_freq_base),
        KV(f"{a}.rope.freq_base_swa", f32, ROPE_FREQ_BASE_SWA),
        KV(f"{a}.rope.dimension_count", u32, spec.head_size),
        KV(f"{a}.rope.dimension_count_swa", u32, swa_hd),
        KV(f"{a}.final_logit_softcapping", f32, FINAL_LOGIT_SOFTCAP),
    ]
