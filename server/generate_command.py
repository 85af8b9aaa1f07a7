"""`moeflash generate`: prompt in, tokens out, with per-token streamer telemetry.

The shortest path from a model file to tokens (no server, no queue), like the phone's CLI. It
streams experts by default; `--resident` runs the same model the stock way (load mode MMAP,
use_extra_bufts off) for comparison. `--json` prints one machine-readable report (the benchmark
harness runs this command under memory caps).
"""

from __future__ import annotations

import argparse
import codecs
import json
import logging
import resource
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from server.errors import ConfigError, ModelLoadError
from server.settings import parse_budget
from server.streaming import (
    DecodeTelemetry,
    StreamingLlama,
    StreamingOptions,
    load_streaming_llama,
)

logger = logging.getLogger(__name__)

_MB = 1e6


@dataclass
class TokenRecord:
    """One decoded token: its id and where its time went (seconds, bytes)."""

    token: int
    seconds: float
    compute_s: float | None = None
    flash_wait_s: float | None = None
    cache_s: float | None = None
    # streaming: what the streamer read; resident: what the kernel read for the process (faults)
    bytes_read: int | None = None
    hits: int | None = None
    misses: int | None = None
    evictions: int | None = None
    prefetched: int | None = None
    prefetch_used: int | None = None


@dataclass
class GenerateReport:
    """Everything one run measured (the --json output)."""

    model: str
    mode: str
    load_s: float
    prompt_tokens: int
    prompt_s: float
    ttft_s: float
    decode_tokens: int
    decode_s: float
    decode_tok_s: float
    decode_tok_s_median: float
    text: str
    tokens: list[int]
    peak_rss_bytes: int
    major_faults: int = 0
    storage_read_bytes: int = 0  # what this process read from storage (page faults included)
    # what the load read from storage: the dense weights of a streamed model, never its experts
    load_bytes_read: int | None = None
    budget_bytes: int | None = None
    budget_reason: str | None = None
    # what the process holds beside the expert cache (server/budget.py MemoryTerms), bytes
    memory: dict[str, Any] = field(default_factory=dict)
    prompt_bytes_read: int | None = None  # the prompt's reads, as TokenRecord.bytes_read
    totals: dict[str, Any] = field(default_factory=dict)
    per_token: list[TokenRecord] = field(default_factory=list)


def register(subparsers: Any) -> None:
    """Add the `generate` subcommand."""
    p = subparsers.add_parser(
        "generate",
        help="generate tokens from a prompt, streaming experts (per-token telemetry)",
        description="Generate tokens from a prompt with expert streaming (or --resident), printing "
        "the text, per-token telemetry and a summary.",
    )
    p.add_argument("--model", "-m", required=True, type=Path, help="GGUF file (or first file of a split set)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", "-p", default="Once upon a time", help="prompt text")
    src.add_argument("--prompt-file", type=Path, help="read the prompt from this file")
    p.add_argument(
        "--prompt-tokens", type=int, help="use exactly this many prompt tokens (the prompt repeated and cut)"
    )
    p.add_argument("--n-predict", "-n", type=int, default=32, help="tokens to generate (default 32)")
    p.add_argument(
        "--chat", action="store_true", help="wrap the prompt as a user message in the chat template"
    )
    p.add_argument("--resident", action="store_true", help="load the model the stock way (no streaming)")
    p.add_argument(
        "--budget",
        default="auto",
        help="expert cache budget: bytes (4G, 512M), auto (default) or all (every expert)",
    )
    p.add_argument("--preload", action="store_true", help="read every expert at load (needs --budget all)")
    p.add_argument("--lanes", type=int, default=4, help="reader threads (default 4)")
    p.add_argument("--no-direct-io", action="store_true", help="buffered reads instead of O_DIRECT")
    p.add_argument(
        "--no-prefetch",
        action="store_true",
        help="do not read the next layer's predicted experts while this layer computes",
    )
    p.add_argument(
        "--overlap",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="overlap a layer's reads with the matmuls of its experts already read (default: off)",
    )
    p.add_argument("--policy", default="layer", choices=["layer", "lru", "none"], help="cache policy")
    p.add_argument("--ctx-size", "-c", type=int, default=4096, help="context size in tokens")
    p.add_argument("--batch-size", type=int, default=512, help="logical batch size (n_batch)")
    p.add_argument("--ubatch-size", type=int, default=512, help="micro-batch size (n_ubatch)")
    p.add_argument(
        "--flash-attn",
        default="auto",
        choices=["auto", "on", "off"],
        help="flash attention (default auto: on when a full context's attention buffers would crowd "
        "the expert cache or the weights out of memory)",
    )
    p.add_argument("--threads", "-t", type=int, default=None, help="compute threads (default: all cores)")
    p.add_argument("--temp", type=float, default=0.0, help="temperature; 0 = greedy (default)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-generation tokens")
    p.add_argument("--telemetry", action="store_true", help="print one telemetry line per token (stderr)")
    p.add_argument("--json", action="store_true", help="print a JSON report instead of text and summary")
    p.set_defaults(func=run)


def _check_args(args: argparse.Namespace) -> None:
    if args.n_predict < 1:
        raise ConfigError("--n-predict must be at least 1")
    if args.prompt_tokens is not None and args.prompt_tokens < 1:
        raise ConfigError("--prompt-tokens must be at least 1")
    if args.ctx_size < 16:
        raise ConfigError("--ctx-size must be at least 16")
    if args.threads is not None and args.threads < 1:
        raise ConfigError("--threads must be at least 1")
    if not 1 <= args.ubatch_size <= args.batch_size:
        raise ConfigError("--ubatch-size must be between 1 and --batch-size")
    if not args.model.exists():
        raise ModelLoadError(f"model file {args.model} does not exist")


def _load(args: argparse.Namespace) -> Any:
    import os

    threads = args.threads or os.cpu_count() or 1
    common: dict[str, Any] = {
        "n_ctx": args.ctx_size,
        "n_batch": args.batch_size,
        "n_ubatch": args.ubatch_size,
        "swa_full": False,  # as the server: sliding-window layers keep the window, not the context
        "n_threads": threads,
        "n_threads_batch": threads,
        "seed": args.seed,
        "verbose": False,
    }
    if args.resident:
        from server.resident import load_resident_llama

        return load_resident_llama(args.model, flash_attn=args.flash_attn, **common)
    try:
        budget = parse_budget(args.budget)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    options = StreamingOptions(
        budget_bytes=budget,
        lanes=args.lanes,
        direct_io=not args.no_direct_io,
        prefetch=not args.no_prefetch,
        overlap=args.overlap,
        policy=args.policy,
        preload=args.preload,
    )
    n_ctx = common.pop("n_ctx")
    return load_streaming_llama(args.model, options, n_ctx=n_ctx, flash_attn=args.flash_attn, **common)


def _prompt_tokens(llm: Any, args: argparse.Namespace) -> list[int]:
    text = args.prompt_file.read_text() if args.prompt_file else args.prompt
    if args.chat:
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        template = llm.metadata.get("tokenizer.chat_template")
        if not template:
            raise ConfigError(f"{args.model} has no chat template (tokenizer.chat_template); drop --chat")
        eos = llm.detokenize([llm.token_eos()], special=True).decode(errors="replace")
        bos = llm.detokenize([llm.token_bos()], special=True).decode(errors="replace")
        formatter = Jinja2ChatFormatter(template=template, eos_token=eos, bos_token=bos)
        text = formatter(messages=[{"role": "user", "content": text}]).prompt
    tokens: list[int] = llm.tokenize(text.encode(), add_bos=not args.chat, special=True)
    if not tokens:
        raise ConfigError("the prompt is empty")
    if args.prompt_tokens:
        # a prompt of an exact length (benchmarks): the text's tokens repeated, then cut
        tokens = (tokens * (args.prompt_tokens // len(tokens) + 1))[: args.prompt_tokens]
    if len(tokens) + args.n_predict > llm.n_ctx():
        raise ConfigError(
            f"prompt ({len(tokens)} tokens) + --n-predict {args.n_predict} exceed --ctx-size {llm.n_ctx()}"
        )
    return tokens


def _next_token(llm: Any, args: argparse.Namespace, rng: np.random.Generator) -> int:
    import llama_cpp

    logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),))
    if args.temp <= 0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / args.temp
    p = np.exp(z - z.max())
    return int(rng.choice(len(p), p=p / p.sum()))


def _storage_read_bytes() -> int:
    """Bytes this process caused to be read from storage (/proc/self/io read_bytes)."""
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _record(token: int, seconds: float, t: DecodeTelemetry | None, storage_read: int | None) -> TokenRecord:
    """A token's record: the streamer's telemetry, or for a resident run what it read from storage."""
    if t is None:
        return TokenRecord(token=token, seconds=seconds, bytes_read=storage_read)
    return TokenRecord(
        token=token,
        seconds=seconds,
        compute_s=t.compute_ns / 1e9,
        flash_wait_s=t.flash_wait_ns / 1e9,
        cache_s=t.cache_ns / 1e9,
        bytes_read=t.bytes_read,
        # None: routing was not watched (every expert resident), not "no hits"
        hits=t.hits if t.routed else None,
        misses=t.misses if t.routed else None,
        evictions=t.evictions,
        prefetched=t.prefetched,
        prefetch_used=t.prefetch_used,
    )


def _telemetry_line(i: int, r: TokenRecord) -> str:
    line = f"tok {i:4d} {r.token:7d} | {r.seconds * 1e3:8.1f} ms"
    if r.compute_s is not None:
        line += (
            f" | compute {r.compute_s * 1e3:7.1f} ms | flash wait {(r.flash_wait_s or 0) * 1e3:7.1f} ms"
            f" | cache {(r.cache_s or 0) * 1e3:6.1f} ms | read {(r.bytes_read or 0) / _MB:7.1f} MB"
            + (
                f" | hits {r.hits}/{(r.hits or 0) + (r.misses or 0)}"
                f" (prefetched {r.prefetch_used}/{r.prefetched})"
                if r.hits is not None
                else " | every expert resident"
            )
        )
    return line


def generate(
    llm: Any, args: argparse.Namespace, load_s: float, storage_before_load: int = 0
) -> GenerateReport:
    """Evaluate the prompt, then decode greedily (or sampled) token by token.

    storage_before_load: /proc/self/io read_bytes before the model was loaded, so that the
    report can say what the load read."""
    streaming = isinstance(llm, StreamingLlama)
    prompt = _prompt_tokens(llm, args)
    rng = np.random.default_rng(args.seed)
    eog = {llm.token_eos()}
    records: list[TokenRecord] = []

    stats0 = llm.stats() if streaming else None
    # a resident (stock mmap) run's reads are its page faults: what the kernel read for it
    storage0 = _storage_read_bytes()
    t0 = time.perf_counter()
    llm.reset()
    llm.eval(prompt)
    prompt_s = time.perf_counter() - t0
    if streaming and stats0 is not None:
        prompt_read = (llm.stats() - stats0).bytes_read
    else:
        prompt_read = _storage_read_bytes() - storage0

    text = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def emit(tok: int) -> None:
        if not args.json:
            sys.stdout.write(text.decode(llm.detokenize([tok])))
            sys.stdout.flush()

    token = _next_token(llm, args, rng)
    ttft = time.perf_counter() - t0
    out = [token]
    emit(token)
    while len(out) < args.n_predict and (args.ignore_eos or token not in eog):
        storage1 = 0 if streaming else _storage_read_bytes()
        t1 = time.perf_counter()
        llm.eval([token])
        seconds = time.perf_counter() - t1
        read = None if streaming else _storage_read_bytes() - storage1
        records.append(_record(token, seconds, llm.telemetry[-1] if streaming else None, read))
        if args.telemetry and not args.json:
            print(_telemetry_line(len(records), records[-1]), file=sys.stderr)
        token = _next_token(llm, args, rng)
        out.append(token)
        emit(token)
    decode_s = sum(r.seconds for r in records)
    per_tok = sorted(r.seconds for r in records)
    median = per_tok[len(per_tok) // 2] if per_tok else 0.0
    report = GenerateReport(
        model=str(args.model),
        mode="resident" if not streaming else "streaming",
        load_s=load_s,
        prompt_tokens=len(prompt),
        prompt_s=prompt_s,
        ttft_s=ttft,
        decode_tokens=len(records),
        decode_s=decode_s,
        decode_tok_s=len(records) / decode_s if decode_s > 0 else 0.0,
        decode_tok_s_median=1.0 / median if median > 0 else 0.0,
        text=llm.detokenize(out).decode(errors="replace"),
        tokens=out,
        peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        major_faults=resource.getrusage(resource.RUSAGE_SELF).ru_majflt,
        storage_read_bytes=_storage_read_bytes(),
        prompt_bytes_read=prompt_read,
        load_bytes_read=storage0 - storage_before_load,
        per_token=records,
    )
    if llm.memory is not None:
        report.memory = asdict(llm.memory)
    if streaming:
        report.budget_bytes = llm.budget.bytes
        report.budget_reason = llm.budget.reason
        report.totals = asdict(llm.stats())
    return report


def _summary(r: GenerateReport) -> str:
    lines = [
        f"model {r.model} ({r.mode}), load {r.load_s:.2f} s, peak RSS {r.peak_rss_bytes / 2**20:.0f} MiB",
        f"prompt {r.prompt_tokens} tokens in {r.prompt_s:.2f} s, time to first token {r.ttft_s:.2f} s",
        f"decode {r.decode_tokens} tokens in {r.decode_s:.2f} s: {r.decode_tok_s:.2f} tok/s "
        f"(median {r.decode_tok_s_median:.2f})",
    ]
    if r.budget_bytes is not None:
        t = r.totals
        routed = max(1, t["hits"] + t["misses"])
        hits = (
            f"hit rate {t['hits'] / routed:.1%} (cache {(t['hits'] - t['prefetch_used']) / routed:.1%}, "
            f"prefetch {t['prefetch_used']} of {t['prefetched']} read ahead used)"
        )
        if t["routing_off"]:
            watched = f": before, over {t['routes']} routes, {hits}" if t["routes"] else ""
            hits = f"every expert resident, routing no longer watched{watched}"
        lines.append(
            f"experts: budget {r.budget_bytes / 2**20:.0f} MiB ({r.budget_reason}); {hits}; "
            f"read {t['bytes_read'] / _MB:.0f} MB; "
            f"flash wait {t['wait_ns'] / 1e9:.2f} s; cache {t['manage_ns'] / 1e9:.2f} s; "
            f"O_DIRECT {'on' if t['direct_io'] else 'off'}"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """The `generate` subcommand."""
    _check_args(args)
    storage_before_load = _storage_read_bytes()
    t0 = time.perf_counter()
    llm = _load(args)
    load_s = time.perf_counter() - t0
    try:
        report = generate(llm, args, load_s, storage_before_load)
    finally:
        llm.close()
    if args.json:
        print(json.dumps(asdict(report)))
    else:
        print()
        print(_summary(report), file=sys.stderr)
    return 0
