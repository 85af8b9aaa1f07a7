"""A training run's checkpoint as a qwen3moe GGUF that llama.cpp loads and moeflash streams.

The file is planned by server/modelgen (the same metadata keys, tensor list and order, header
encoding as every synthetic qwen3moe model), with the run's trained tokenizer and ChatML chat
template; only the tensor bytes differ: the trained weights, quantized by gguf-py. Norms and
routers stay F32 as modelgen writes them; weight matrices take `qtype` (F16, Q8_0, Q5_0, Q4_0).
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import torch

from server.modelgen.gguf_format import pad_to
from server.modelgen.layout import plan_layout
from server.modelgen.spec import ModelSpec, QType, TensorSpec
from server.training import tokenizer, train
from server.training.model import Config, MoeLM

logger = logging.getLogger(__name__)

EXPORT_QTYPES = (QType.F16, QType.Q8_0, QType.Q5_0, QType.Q4_0)

# torch state_dict name -> GGUF tensor name ({i}: the block)
_BLOCK_NAMES = {
    "attn_norm.weight": "attn_norm.weight",
    "attn.q.weight": "attn_q.weight",
    "attn.k.weight": "attn_k.weight",
    "attn.v.weight": "attn_v.weight",
    "attn.o.weight": "attn_output.weight",
    "attn.q_norm.weight": "attn_q_norm.weight",
    "attn.k_norm.weight": "attn_k_norm.weight",
    "ffn_norm.weight": "ffn_norm.weight",
    "moe.router.weight": "ffn_gate_inp.weight",
    "moe.gate": "ffn_gate_exps.weight",
    "moe.up": "ffn_up_exps.weight",
    "moe.down": "ffn_down_exps.weight",
}
_TOP_NAMES = {
    "embed.weight": "token_embd.weight",
    "norm.weight": "output_norm.weight",
    "output.weight": "output.weight",
}


def gguf_name(torch_name: str) -> str:
    if torch_name in _TOP_NAMES:
        return _TOP_NAMES[torch_name]
    m = re.fullmatch(r"blocks\.(\d+)\.(.+)", torch_name)
    if not m or m.group(2) not in _BLOCK_NAMES:
        raise ValueError(f"no GGUF tensor for {torch_name}")
    return f"blk.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}"


def model_spec(cfg: Config, qtype: QType, name: str) -> ModelSpec:
    return ModelSpec(
        arch="qwen3moe",
        n_layer=cfg.n_layer,
        n_embd=cfg.n_embd,
        n_head=cfg.n_head,
        n_head_kv=cfg.n_head_kv,
        head_dim=cfg.head_dim,
        n_expert=cfg.n_expert,
        n_expert_used=cfg.n_expert_used,
        n_ff_exp=cfg.n_ff_exp,
        n_vocab=cfg.n_vocab,
        n_ctx=cfg.n_ctx,
        expert_qtype=qtype,
        dense_qtype=qtype,
        rope_freq_base=cfg.rope_theta,
        rms_eps=cfg.norm_eps,
        name=name,
    )


def _encode(array: np.ndarray, qtype: QType) -> bytes:
    data = gguf.quants.quantize(array.astype(np.float32), gguf.GGMLQuantizationType(qtype.ggml_type))
    return bytes(np.ascontiguousarray(data).data)


def write_gguf(model: MoeLM, tok_path: Path, out: Path, qtype: QType, name: str) -> str:
    """Write `model` with the tokenizer at `tok_path` to `out`; return the file's sha256."""
    if qtype not in EXPORT_QTYPES:
        raise ValueError(f"export qtype must be one of {', '.join(q.name for q in EXPORT_QTYPES)}")
    vocab = tokenizer.to_vocab(tokenizer.load(tok_path))
    spec = model_spec(model.cfg, qtype, name)
    planned = plan_layout(spec, out, vocab=vocab).files[0]
    weights = {gguf_name(n): t.detach().float().numpy() for n, t in model.state_dict().items()}
    if set(weights) != {t.name for t in planned.tensors}:
        raise ValueError(f"tensor sets differ: {sorted(set(weights) ^ {t.name for t in planned.tensors})}")
    tmp = out.with_name(f".{out.name}.{os.getpid()}.partial")
    digest = hashlib.sha256()
    try:
        with tmp.open("wb") as f:
            for chunk in _chunks(planned.header, planned.tensors, weights, spec.alignment):
                f.write(chunk)
                digest.update(chunk)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return digest.hexdigest()


def _chunks(
    header: bytes, tensors: tuple[TensorSpec, ...], weights: dict[str, np.ndarray], align: int
) -> Iterator[bytes]:
    yield header
    for t in tensors:
        data = _encode(weights[t.name], t.qtype)
        if len(data) != t.nbytes:
            raise ValueError(f"{t.name}: {len(data)} bytes, planned {t.nbytes}")
        yield data
        yield bytes(pad_to(len(data), align) - len(data))


def export(run_dir: Path, out: Path, qtype: QType) -> str:
    """The run's latest checkpoint as a GGUF at `out`; returns its sha256."""
    model, _, step = train.load_model(run_dir)
    name = f"moeflash-trained-qwen3moe-{run_dir.name}-step{step}"
    return write_gguf(model, run_dir / "tokenizer.json", out, qtype, name)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Export a training run's checkpoint as a qwen3moe GGUF")
    p.add_argument("--run-dir", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True, help="the .gguf to write")
    p.add_argument("--qtype", default="Q8_0", help="F16, Q8_0, Q5_0 or Q4_0 (default Q8_0)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(1)
    sha = export(args.run_dir, args.out, QType.parse(args.qtype))
    print(f"{sha}  {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
