"""Per-architecture tensor sets and hyperparameter keys, as llama.cpp loads them.

Sources (llama.cpp 0c1e570): src/models/{qwen3moe,openai-moe,llama,qwen2moe,hy-v3}.cpp for the
tensors each architecture creates (every tensor in the file must be used, or loading fails
with "wrong number of tensors"), src/llama-arch.cpp for names and keys, src/llama-model.cpp
for the shared hparams. Key value types must match exactly: llama.cpp rejects a u64 where it
reads a u32. gemma4, which differs from these in most respects, is in gemma4.py.

Initial value spreads: weights are zero-mean with std 1/sqrt(fan_in), so every projection
keeps unit-scale activations; the token embedding has std 1 and the output head gives logits
of std ~3, so greedy decoding follows the input instead of collapsing onto one token. Routers
are F32 with logits of std ~2: expert choice varies from token to token and layer to layer.
"""

from __future__ import annotations

import math

from gguf import GGUFValueType

from server.modelgen import gemma4
from server.modelgen.gguf_format import KV
from server.modelgen.spec import FILE_TYPES, ModelSpec, QType, TensorSpec
from server.modelgen.tokenizer import Vocab

# llama_expert_gating_func_type (src/llama-hparams.h)
GATING_SIGMOID = 2


def tensor_plan(spec: ModelSpec) -> list[TensorSpec]:
    """Every tensor of the model, in file order: embedding, blocks 0..n-1, output norm, output."""
    e, v = spec.n_embd, spec.n_vocab
    dense = spec.dense_qtype
    f32 = QType.F32
    if spec.arch == "gemma4":
        # gemma4 multiplies the embeddings by sqrt(n_embd)
        out = [TensorSpec("token_embd.weight", (e, v), dense, std=1.0 / math.sqrt(e))]
        out += gemma4.global_tensors(spec)
        for il in range(spec.n_layer):
            out.extend(gemma4.block(spec, il))
    else:
        out = [TensorSpec("token_embd.weight", (e, v), dense, std=1.0)]
        for il in range(spec.n_layer):
            out.extend(_block(spec, il))
    if spec.tied_embeddings:
        # the output matrix is then the embeddings themselves: with a positive norm every hidden
        # state still close to its token's embedding gives that token the top logit, and greedy
        # decoding repeats the last token (gemma4-26b-shape wrote "gggg..."); random signs
        # decorrelate the two
        out.append(TensorSpec("output_norm.weight", (e,), f32, std=1.0))
    else:
        out.append(TensorSpec("output_norm.weight", (e,), f32, std=0.1, mean=1.0))
    if not spec.tied_embeddings:
        out.append(TensorSpec("output.weight", (e, v), dense, std=3.0 / math.sqrt(e)))
    return out


def _block(spec: ModelSpec, il: int) -> list[TensorSpec]:
    p = f"blk.{il}."
    e, q, kv, hd = spec.n_embd, spec.n_embd_q, spec.n_embd_kv, spec.head_size
    n_exp, ff = spec.n_expert, spec.n_ff_exp
    dense, experts, f32 = spec.dense_qtype, spec.expert_qtype, QType.F32
    # projections that write into the residual stream are scaled by 1/sqrt(2 n_layer) (GPT-2's
    # init), so the sum over all layers stays comparable to the token embedding
    res = 1.0 / math.sqrt(2 * spec.n_layer)
    in_std, q_std, ff_std = 1.0 / math.sqrt(e), res / math.sqrt(q), res / math.sqrt(ff)
    arch = spec.arch

    def norm(name: str, n: int) -> TensorSpec:
        return TensorSpec(p + name, (n,), f32, std=0.1, mean=1.0)

    def bias(name: str, ne: tuple[int, ...], std: float = 0.1) -> TensorSpec:
        return TensorSpec(p + name, ne, f32, std=std)

    t = [norm("attn_norm.weight", e)]
    t += [
        TensorSpec(p + "attn_q.weight", (e, q), dense, in_std),
        TensorSpec(p + "attn_k.weight", (e, kv), dense, in_std),
        TensorSpec(p + "attn_v.weight", (e, kv), dense, in_std),
    ]
    if arch in ("qwen2moe", "gpt-oss"):
        t += [bias("attn_q.bias", (q,)), bias("attn_k.bias", (kv,)), bias("attn_v.bias", (kv,))]
    t.append(TensorSpec(p + "attn_output.weight", (q, e), dense, q_std))
    if arch == "gpt-oss":
        t.append(bias("attn_output.bias", (e,)))
        # per-head attention sink logits (F32, consumed by soft_max_ext)
        t.append(TensorSpec(p + "attn_sinks.weight", (spec.n_head,), f32, std=1.0))
        # gpt-oss normalises the FFN input with post_attention_norm; it has no ffn_norm
        t.append(norm("post_attention_norm.weight", e))
    if arch in ("qwen3moe", "hy_v3"):
        t += [norm("attn_q_norm.weight", hd), norm("attn_k_norm.weight", hd)]
    if arch != "gpt-oss":
        t.append(norm("ffn_norm.weight", e))

    # router: F32 so that expert selection is sensitive to the input
    t.append(TensorSpec(p + "ffn_gate_inp.weight", (e, n_exp), f32, std=2.0 / math.sqrt(e)))
    if arch == "gpt-oss":
        t.append(bias("ffn_gate_inp.bias", (n_exp,), std=0.5))
    if arch == "hy_v3":
        # expert-selection bias added to the sigmoid probabilities (not to the weights)
        t.append(TensorSpec(p + "exp_probs_b", (n_exp,), f32, std=0.05))
        # the merged gate+up expert tensor: rows [0, ff) are gate, [ff, 2ff) are up
        t.append(TensorSpec(p + "ffn_gate_up_exps.weight", (e, 2 * ff, n_exp), experts, in_std))
    else:
        t.append(TensorSpec(p + "ffn_gate_exps.weight", (e, ff, n_exp), experts, in_std))
        t.append(TensorSpec(p + "ffn_up_exps.weight", (e, ff, n_exp), experts, in_std))
    t.append(TensorSpec(p + "ffn_down_exps.weight", (ff, e, n_exp), spec.down_qtype_of(il), ff_std))
    if arch == "gpt-oss":
        t += [
            bias("ffn_gate_exps.bias", (ff, n_exp)),
            bias("ffn_up_exps.bias", (ff, n_exp)),
            bias("ffn_down_exps.bias", (e, n_exp)),
        ]

    if spec.n_ff_shexp:
        sh = spec.n_ff_shexp
        if arch == "qwen2moe":
            # sigmoid gate scaling the shared expert's output, a single row
            t.append(TensorSpec(p + "ffn_gate_inp_shexp.weight", (e,), f32, in_std))
        t += [
            TensorSpec(p + "ffn_gate_shexp.weight", (e, sh), dense, in_std),
            TensorSpec(p + "ffn_up_shexp.weight", (e, sh), dense, in_std),
            TensorSpec(p + "ffn_down_shexp.weight", (sh, e), dense, res / math.sqrt(sh)),
        ]
    return t


def model_kvs(spec: ModelSpec, vocab: Vocab) -> list[KV]:
    """The metadata of an unsplit file: general.*, the architecture's hparams, tokenizer.*."""
    a = spec.arch
    u32, f32 = GGUFValueType.UINT32, GGUFValueType.FLOAT32
    general = [
        KV("general.architecture", GGUFValueType.STRING, a),
        KV("general.name", GGUFValueType.STRING, spec.name or f"moeflash-synthetic-{a}"),
        KV("general.file_type", u32, FILE_TYPES[spec.expert_qtype]),
        KV("general.quantization_version", u32, 2),
        KV("general.alignment", u32, spec.alignment),
        KV(f"{a}.vocab_size", u32, spec.n_vocab),
    ]
    if a == "gemma4":
        return general + gemma4.kvs(spec) + tokenizer_kvs(vocab)
    kvs = general + [
        KV(f"{a}.context_length", u32, spec.n_ctx),
        KV(f"{a}.embedding_length", u32, spec.n_embd),
        KV(f"{a}.block_count", u32, spec.n_layer),
        # llama (Mixtral) reads the expert width from feed_forward_length; the others from
        # expert_feed_forward_length and ignore this one
        KV(f"{a}.feed_forward_length", u32, spec.n_ff_exp),
        KV(f"{a}.expert_count", u32, spec.n_expert),
        KV(f"{a}.expert_used_count", u32, spec.n_expert_used),
        KV(f"{a}.attention.head_count", u32, spec.n_head),
        KV(f"{a}.attention.head_count_kv", u32, spec.n_head_kv),
        KV(f"{a}.attention.key_length", u32, spec.head_size),
        KV(f"{a}.attention.value_length", u32, spec.head_size),
        KV(f"{a}.attention.layer_norm_rms_epsilon", f32, spec.rms_eps),
        KV(f"{a}.rope.freq_base", f32, spec.rope_freq_base),
        KV(f"{a}.rope.dimension_count", u32, spec.head_size),
    ]
    if a != "llama":
        kvs.append(KV(f"{a}.expert_feed_forward_length", u32, spec.n_ff_exp))
    if spec.n_ff_shexp:
        kvs.append(KV(f"{a}.expert_shared_feed_forward_length", u32, spec.n_ff_shexp))
    if a == "gpt-oss":
        # every other layer (0, 2, ...) uses the sliding window (llama.cpp's default pattern 2)
        kvs.append(KV(f"{a}.attention.sliding_window", u32, spec.n_swa))
    if a == "hy_v3":
        kvs += [
            KV(f"{a}.expert_gating_func", u32, GATING_SIGMOID),
            KV(f"{a}.expert_weights_norm", GGUFValueType.BOOL, True),
            KV(f"{a}.expert_weights_scale", f32, 1.0),
        ]
    kvs += tokenizer_kvs(vocab)
    return kvs


def tokenizer_kvs(vocab: Vocab) -> list[KV]:
    u32, arr = GGUFValueType.UINT32, GGUFValueType.ARRAY
    fam = vocab.family
    return [
        KV("tokenizer.ggml.model", GGUFValueType.STRING, "gpt2"),
        KV("tokenizer.ggml.pre", GGUFValueType.STRING, fam.pre),
        KV("tokenizer.ggml.tokens", arr, vocab.tokens, GGUFValueType.STRING),
        KV("tokenizer.ggml.token_type", arr, vocab.token_types, GGUFValueType.INT32),
        KV("tokenizer.ggml.merges", arr, vocab.merges, GGUFValueType.STRING),
        KV("tokenizer.ggml.bos_token_id", u32, vocab.bos_id),
        KV("tokenizer.ggml.eos_token_id", u32, vocab.eos_id),
        KV("tokenizer.ggml.eot_token_id", u32, vocab.eot_id),
        KV("tokenizer.ggml.padding_token_id", u32, vocab.pad_id),
        KV("tokenizer.ggml.add_bos_token", GGUFValueType.BOOL, fam.add_bos),
        KV("tokenizer.ggml.add_eos_token", GGUFValueType.BOOL, False),
        KV("tokenizer.chat_template", GGUFValueType.STRING, fam.chat_template),
    ]
