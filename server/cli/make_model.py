"""`moeflash make-model`: write a synthetic MoE GGUF from a preset plus shape overrides."""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path
from typing import Any

from server.errors import ModelGenError
from server.modelgen.presets import preset, presets
from server.modelgen.spec import ARCHITECTURES, WEIGHT_QTYPES, ModelSpec, QType
from server.modelgen.writer import estimate_size, generate_model
from server.units import format_size

# the preset a bare --arch starts from
_TINY_PRESET_BY_ARCH = {
    "qwen3moe": "tiny-qwen3moe",
    "gpt-oss": "tiny-gptoss",
    "llama": "tiny-mixtral",
    "qwen2moe": "tiny-qwen2moe",
    "hy_v3": "tiny-hyv3",
    "gemma4": "tiny-gemma4",
}

# CLI flag -> ModelSpec field, for the integer shape overrides
_SHAPE_FLAGS = {
    "layers": "n_layer",
    "embd": "n_embd",
    "heads": "n_head",
    "heads_kv": "n_head_kv",
    "head_dim": "head_dim",
    "experts": "n_expert",
    "experts_used": "n_expert_used",
    "ff_exp": "n_ff_exp",
    "ff_shexp": "n_ff_shexp",
    "vocab": "n_vocab",
    "ctx": "n_ctx",
    "swa": "n_swa",
    "head_dim_swa": "head_dim_swa",
    "heads_kv_swa": "n_head_kv_swa",
    "alignment": "alignment",
}

# size suffixes as llama.cpp's gguf-split reads them (decimal), plus binary ones
_SIZE_UNITS = {
    "": 1,
    "B": 1,
    "K": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def register(subparsers: Any) -> None:
    """Add the `make-model` subcommand to the `moeflash` parser."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "make-model",
        help="write a synthetic Mixture-of-Experts GGUF with random weights",
        description=(
            "Write a random-weight MoE GGUF that llama.cpp loads: a preset, optionally reshaped. "
            "Shape flags override the preset's fields; changing --embd or --heads without "
            "--head-dim derives head_dim = embd / heads."
        ),
    )
    p.add_argument(
        "out",
        nargs="?",
        type=Path,
        metavar="OUT.gguf",
        help="output file (split sets: OUT-0000i-of-0000N.gguf)",
    )
    p.add_argument("--list-presets", action="store_true", help="list the presets with their sizes and exit")
    p.add_argument("--preset", help="base shape (default: the tiny preset of --arch, else tiny-qwen3moe)")
    p.add_argument("--arch", choices=ARCHITECTURES, help="llama.cpp architecture")
    p.add_argument("--layers", type=int, help="number of layers")
    p.add_argument("--embd", type=int, help="hidden size n_embd")
    p.add_argument("--heads", type=int, help="attention (query) heads")
    p.add_argument("--heads-kv", type=int, help="key/value heads")
    p.add_argument("--head-dim", type=int, help="per-head width")
    p.add_argument("--experts", type=int, help="experts per layer")
    p.add_argument("--experts-used", type=int, help="experts routed per token")
    p.add_argument("--ff-exp", type=int, help="expert FFN width")
    p.add_argument(
        "--ff-shexp", type=int, help="shared expert FFN width (qwen2moe, hy_v3; gemma4's dense MLP)"
    )
    p.add_argument("--vocab", type=int, help="vocabulary size")
    p.add_argument("--ctx", type=int, help="training context length written to the GGUF")
    p.add_argument("--swa", type=int, help="sliding-window length (gpt-oss, gemma4)")
    p.add_argument("--head-dim-swa", type=int, help="per-head width of gemma4's sliding-window layers")
    p.add_argument("--heads-kv-swa", type=int, help="key/value heads of gemma4's sliding-window layers")
    p.add_argument("--alignment", type=int, help="tensor data alignment in bytes (power of two, default 32)")
    qtypes = [q.name for q in WEIGHT_QTYPES]
    p.add_argument("--qtype", choices=qtypes, type=str.upper, help="expert weight type")
    p.add_argument("--dense-qtype", choices=qtypes, type=str.upper, help="non-expert weight matrix type")
    p.add_argument(
        "--down-qtype",
        choices=qtypes,
        type=str.upper,
        help="ffn_down_exps type on the layers a Q4_K_M file gives more bits (the first and last "
        "eighth, every third between), as real Q4_K_M models do: expert sizes then differ by layer",
    )
    p.add_argument(
        "--down-qtype-rest",
        choices=qtypes,
        type=str.upper,
        help="ffn_down_exps type on the other layers (default: --qtype), for widths a K-quant "
        "cannot hold (Gemma-4's 704: Q5_0)",
    )
    p.add_argument(
        "--tied-embeddings", action="store_true", help="no output.weight (embeddings as output matrix)"
    )
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0); same seed, same bytes")
    p.add_argument(
        "--split-max-size", metavar="SIZE", help="split into files of at most SIZE (e.g. 2G, 500M, 4GiB)"
    )
    p.add_argument("--force", action="store_true", help="overwrite existing output files")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.list_presets:
        for p in presets():
            print(f"{p.name:20} {format_size(estimate_size(p.spec)):>10}  {p.description}")
        return 0
    if args.out is None:
        raise ModelGenError("missing OUT.gguf (or use --list-presets)")
    spec = spec_from_args(args)
    split = parse_size(args.split_max_size) if args.split_max_size is not None else None
    paths = generate_model(
        spec,
        args.out,
        seed=args.seed,
        split_max_size=split,
        progress=not args.no_progress,
        overwrite=args.force,
    )
    size = sum(p.stat().st_size for p in paths)
    files = str(paths[0]) if len(paths) == 1 else f"{paths[0]} .. {paths[-1].name} ({len(paths)} files)"
    varies = len({spec.expert_bytes_of(il) for il in range(spec.n_layer)}) > 1
    print(
        f"wrote {files}: {format_size(size)}; {spec.describe()}; "
        f"{format_size(spec.bytes_per_expert)} per expert{' (mean over layers)' if varies else ''}, "
        f"{format_size(spec.routed_bytes_per_token)} routed per token"
    )
    return 0


def spec_from_args(args: argparse.Namespace) -> ModelSpec:
    """The preset named by the arguments with their overrides applied (validated)."""
    name = args.preset or _TINY_PRESET_BY_ARCH.get(args.arch or "", "tiny-qwen3moe")
    base = preset(name)
    changes: dict[str, Any] = {}
    if args.arch is not None:
        changes["arch"] = args.arch
    for flag, field in _SHAPE_FLAGS.items():
        value = getattr(args, flag)
        if value is not None:
            changes[field] = value
    if ("n_embd" in changes or "n_head" in changes) and "head_dim" not in changes:
        changes["head_dim"] = None
    if args.qtype is not None:
        changes["expert_qtype"] = QType.parse(args.qtype)
    if args.dense_qtype is not None:
        changes["dense_qtype"] = QType.parse(args.dense_qtype)
    if args.down_qtype is not None:
        changes["down_qtype"] = QType.parse(args.down_qtype)
    if args.down_qtype_rest is not None:
        changes["down_qtype_rest"] = QType.parse(args.down_qtype_rest)
    if args.tied_embeddings:
        changes["tied_embeddings"] = True
    return dataclasses.replace(base, **changes)


def parse_size(text: str) -> int:
    """'2G' -> 2_000_000_000, '4GiB' -> 4 * 2**30, '1500' -> 1500 (bytes)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    unit = m.group(2).upper() if m else ""
    if m is None or unit not in _SIZE_UNITS:
        raise ModelGenError(
            f"invalid size {text!r}: use bytes or a number with K, M, G, T (or KiB, MiB, GiB, TiB)"
        )
    n = int(float(m.group(1)) * _SIZE_UNITS[unit])
    if n < 1:
        raise ModelGenError(f"size must be positive: {text!r}")
    return n
