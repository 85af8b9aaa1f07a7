"""A qwen3moe language model in torch, computing what llama.cpp's qwen3moe graph computes.

Per block (src/models/qwen3moe.cpp): x += attn(rmsnorm(x)); x += moe(rmsnorm(x)). Attention
has per-head RMSNorm on q and k before NEOX-style RoPE, grouped KV heads, scale 1/sqrt(head
dim). The MoE router is softmax over all experts, top-k, weights renormalised to sum 1
(norm_topk_prob); each expert is SwiGLU (down(silu(gate x) * up x)). No biases anywhere.

Expert dispatch is sparse: token rows are gathered per expert and only the chosen experts run.
`forward` also returns the load-balancing loss (Switch Transformer's n_expert * sum f_e * P_e)
that keeps routing from collapsing onto a few experts.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn


@dataclasses.dataclass(frozen=True)
class Config:
    n_vocab: int = 8192
    n_embd: int = 256
    n_layer: int = 8
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 64
    n_expert: int = 32
    n_expert_used: int = 4
    n_ff_exp: int = 128
    n_ctx: int = 512
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_tables(cfg: Config, n_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, (n_pos, head_dim / 2), NEOX layout (dims i and i + head_dim/2 rotate together)."""
    half = cfg.head_dim // 2
    inv_freq = cfg.rope_theta ** (-torch.arange(half, dtype=torch.float64) * 2 / cfg.head_dim)
    angles = torch.arange(n_pos, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (batch, heads, seq, head_dim)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.cfg = cfg
        e, hd = cfg.n_embd, cfg.head_dim
        self.q = nn.Linear(e, cfg.n_head * hd, bias=False)
        self.k = nn.Linear(e, cfg.n_head_kv * hd, bias=False)
        self.v = nn.Linear(e, cfg.n_head_kv * hd, bias=False)
        self.o = nn.Linear(cfg.n_head * hd, e, bias=False)
        self.q_norm = RMSNorm(hd, cfg.norm_eps)
        self.k_norm = RMSNorm(hd, cfg.norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        c = self.cfg
        q = self.q_norm(self.q(x).view(b, t, c.n_head, c.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k(x).view(b, t, c.n_head_kv, c.head_dim)).transpose(1, 2)
        v = self.v(x).view(b, t, c.n_head_kv, c.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos[:t], sin[:t]), apply_rope(k, cos[:t], sin[:t])
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        out: torch.Tensor = self.o(y.transpose(1, 2).reshape(b, t, c.n_head * c.head_dim))
        return out


class MoE(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.cfg = cfg
        e, ff, n = cfg.n_embd, cfg.n_ff_exp, cfg.n_expert
        self.router = nn.Linear(e, n, bias=False)
        # (expert, out, in), the layout of ggml's ffn_*_exps tensors
        self.gate = nn.Parameter(torch.empty(n, ff, e))
        self.up = nn.Parameter(torch.empty(n, ff, e))
        self.down = nn.Parameter(torch.empty(n, e, ff))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(probs over all experts, chosen expert ids, their renormalised weights), rows of x."""
        probs = torch.softmax(self.router(x).float(), dim=-1)
        top_p, top_i = torch.topk(probs, self.cfg.n_expert_used, dim=-1)
        return probs, top_i, top_p / top_p.sum(-1, keepdim=True)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs, top_i, top_w = self.route(x)
        k, n = self.cfg.n_expert_used, self.cfg.n_expert
        flat = top_i.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=n).tolist()
        rows = order // k  # token row of each sorted assignment
        weights = top_w.reshape(-1)[order]
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            idx = rows[start : start + count]
            xs = x.index_select(0, idx)
            h = F.silu(xs @ self.gate[expert].t()) * (xs @ self.up[expert].t())
            y = (h @ self.down[expert].t()) * weights[start : start + count, None]
            out.index_add_(0, idx, y)
            start += count
        frac = torch.bincount(flat, minlength=n).float() / flat.numel()
        balance = n * (frac * probs.mean(0)).sum()
        return out.reshape(shape), balance


class Block(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.moe = MoE(cfg)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        y, balance = self.moe(self.ffn_norm(x))
        return x + y, balance


class MoeLM(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.n_vocab, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.output = nn.Linear(cfg.n_embd, cfg.n_vocab, bias=False)
        cos, sin = rope_tables(cfg, cfg.n_ctx)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def init_weights(self, generator: torch.Generator) -> None:
        """GPT-2 style: std 0.02, residual-branch outputs scaled by 1/sqrt(2 n_layer)."""
        resid_std = 0.02 / math.sqrt(2 * self.cfg.n_layer)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                nn.init.ones_(p)
            elif name.endswith(("attn.o.weight", "moe.down")):
                nn.init.normal_(p, 0.0, resid_std, generator=generator)
            else:
                nn.init.normal_(p, 0.0, 0.02, generator=generator)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits (batch, seq, vocab), mean load-balancing loss over layers)."""
        x = self.embed(ids)
        cos, sin = self.cos, self.sin
        assert isinstance(cos, torch.Tensor) and isinstance(sin, torch.Tensor)
        balance = x.new_zeros(())
        for block in self.blocks:
            x, b = block(x, cos, sin)
            balance = balance + b
        return self.output(self.norm(x)), balance / len(self.blocks)
