"""`moeflash generate`: prompt in, tokens out, with per-token streamer telemetry.

A thin front end on the server's own path: the model settings (and so the flags) of `serve`,
the one loader (server/loading/loader.py), the one token loop and sampler
(server/engine/token_loop.py). No HTTP, no queue. `--json` prints one machine-readable report:
the benchmark harness runs this command under memory caps, so what it measures is what serves.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import resource
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from server.cli.arguments import add_arguments, settings_of
from server.engine.generation import GenerationRequest, GenerationStats, SamplingParams, TextDelta
from server.engine.token_loop import generate
from server.errors import ConfigError
from server.loading.loader import LoadedModel, load_model
from server.loading.measured import DecodeStep
from server.loading.route_trace import recorded_routes, write_trace
from server.settings import ModelSettings, RouteTraceSettings
from server.units import format_size

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TokenRecord:
    """One token (after the first) and the decode step that produced it (the record every figure
    reads: server/loading/measured.py), with what the process read from storage meanwhile
    (/proc/self/io: a resident model's page faults; a streamed model's expert reads are the
    step's bytes_read)."""

    token: int
    step: DecodeStep
    storage_read_bytes: int

    def to_json(self) -> dict[str, Any]:
        return {"token": self.token, "storage_read_bytes": self.storage_read_bytes, **self.step.to_json()}


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
    # what the process holds beside the expert cache (server/loading/budget.py MemoryTerms), bytes
    memory: dict[str, Any] = field(default_factory=dict)
    # the prompt's reads: the streamer's expert reads, or a resident model's page faults
    prompt_bytes_read: int | None = None
    # every decode call of the run (the prompt's included) as one record; None for a resident model
    totals: DecodeStep | None = None
    per_token: list[TokenRecord] = field(default_factory=list)
    # the trace every token was routed by (lossy: not the model's own output), None for its own
    route_trace: str | None = None
    # the decode steps' span on CLOCK_MONOTONIC (seconds), which other processes read too: the
    # RPC benchmark counts what crossed the link meanwhile (server/bench/rpc.py)
    decode_window: tuple[float, float] = (0.0, 0.0)

    def to_json(self) -> dict[str, Any]:
        """The --json report: its fields, the records in their JSON form (DecodeStep.to_json)."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return fields | {
            "totals": self.totals.to_json() if self.totals is not None else {},
            "per_token": [record.to_json() for record in self.per_token],
        }


def register(subparsers: Any) -> None:
    """Add the `generate` subcommand: the model settings' flags (as `serve`) plus the prompt's."""
    p = subparsers.add_parser(
        "generate",
        help="generate tokens from a prompt on the server's engine (per-token telemetry)",
        description="Generate tokens from a prompt with the model loaded as `serve` loads it (the same "
        "flags), printing the text, per-token telemetry and a summary.",
    )
    add_arguments(p, (ModelSettings, RouteTraceSettings))
    run_group = p.add_argument_group("generation")
    src = run_group.add_mutually_exclusive_group()
    src.add_argument("--prompt", "-p", default="Once upon a time", help="prompt text")
    src.add_argument("--prompt-file", type=Path, help="read the prompt from this file")
    run_group.add_argument(
        "--prompt-tokens", type=int, help="use exactly this many prompt tokens (the prompt repeated and cut)"
    )
    run_group.add_argument("--n-predict", "-n", type=int, default=32, help="tokens to generate (default 32)")
    run_group.add_argument(
        "--chat", action="store_true", help="wrap the prompt as a user message in the chat template"
    )
    run_group.add_argument("--temp", type=float, default=0.0, help="temperature; 0 = greedy (default)")
    run_group.add_argument("--seed", type=int, default=0, help="sampling seed")
    run_group.add_argument(
        "--ignore-eos", action="store_true", help="keep generating past end-of-generation tokens"
    )
    run_group.add_argument(
        "--telemetry", action="store_true", help="print one telemetry line per token (stderr)"
    )
    run_group.add_argument(
        "--json", action="store_true", help="print a JSON report instead of text and summary"
    )
    p.set_defaults(func=run)


def _check_args(args: argparse.Namespace) -> None:
    if args.n_predict < 1:
        raise ConfigError("--n-predict must be at least 1")
    if args.prompt_tokens is not None and args.prompt_tokens < 1:
        raise ConfigError("--prompt-tokens must be at least 1")
    if args.temp < 0:
        raise ConfigError("--temp must be at least 0")


def _prompt_tokens(model: LoadedModel, args: argparse.Namespace) -> tuple[int, ...]:
    from server.engine.generation import text_tokens

    text = args.prompt_file.read_text() if args.prompt_file else args.prompt
    if args.chat:
        from server.engine.chat_template import ChatTemplate, user_message

        template = ChatTemplate(model.llama, model.info.chat_template)
        tokens = template.tokenize(template.render([user_message(text)]))
    else:
        tokens = text_tokens(model.llama, text)
    if not tokens:
        raise ConfigError("the prompt is empty")
    if args.prompt_tokens:
        # a prompt of an exact length (benchmarks): the text's tokens repeated, then cut
        tokens = (tokens * (args.prompt_tokens // len(tokens) + 1))[: args.prompt_tokens]
    if len(tokens) + args.n_predict > model.info.n_ctx:
        raise ConfigError(
            f"prompt ({len(tokens)} tokens) + --n-predict {args.n_predict} exceed "
            f"--ctx-size {model.info.n_ctx}"
        )
    return tokens


def _storage_read_bytes() -> int:
    """Bytes this process caused to be read from storage (/proc/self/io read_bytes)."""
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _telemetry_line(i: int, r: TokenRecord) -> str:
    step, s = r.step, r.step.streamer
    line = f"tok {i:4d} {r.token:7d} | {step.wall_ns / 1e6:8.1f} ms"
    if s is not None:
        line += (
            f" | compute {(step.compute_ns or 0) / 1e6:7.1f} ms | flash wait {s.flash_wait_ns / 1e6:7.1f} ms"
            f" | cache {s.cache_ns / 1e6:6.1f} ms"
            f" | read {format_size(s.bytes_read, unit='MiB', digits=1):>11}"
            + (
                f" | hits {s.hits}/{s.hits + s.misses} (prefetched {s.prefetch_hits}/{s.prefetched})"
                if step.routed
                else " | every expert resident"
            )
            + f" | budget {format_size(s.budget_bytes, unit='MiB', digits=1):>11}"
        )
    if step.helper_wait_ns:
        line += f" | helpers {step.helper_wait_ns / 1e6:7.1f} ms"
    return line


def run_generation(
    model: LoadedModel, args: argparse.Namespace, load_s: float, storage_before_load: int = 0
) -> GenerateReport:
    """Evaluate the prompt, then decode (greedy unless --temp) on the engine's token loop.

    storage_before_load: /proc/self/io read_bytes before the model was loaded, so that the
    report can say what the load read."""
    llama = model.llama
    prompt = _prompt_tokens(model, args)
    records: list[TokenRecord] = []
    tokens: list[int] = []
    first: dict[str, float | int] = {}

    totals0 = llama.totals()
    storage0 = _storage_read_bytes()  # a resident (stock mmap) run's reads are its page faults
    storage_step = storage0
    t0 = time.perf_counter()

    def on_token(token: int, step: DecodeStep | None) -> None:
        nonlocal storage_step
        storage = _storage_read_bytes()
        if step is None:  # the first token: its step was the prompt
            first["ttft_s"] = time.perf_counter() - t0
            first["decode_start"] = time.monotonic()
            prompt_work = llama.totals() - totals0
            first["prompt_read"] = (
                prompt_work.streamer.bytes_read if prompt_work.streamer is not None else storage - storage0
            )
        else:
            records.append(TokenRecord(tokens[-1], step, storage - storage_step))
            if args.telemetry and not args.json:
                print(_telemetry_line(len(records), records[-1]), file=sys.stderr)
        storage_step = storage
        tokens.append(token)

    def emit(delta: TextDelta) -> None:
        if not args.json:
            sys.stdout.write(delta.text)
            sys.stdout.flush()

    params = SamplingParams(
        max_tokens=args.n_predict, temperature=args.temp, seed=args.seed, ignore_eos=args.ignore_eos
    )
    stats = GenerationStats()
    generate(llama, GenerationRequest(prompt, params), stats, emit, lambda: False, on_token)
    decode_end = time.monotonic()
    decode_s = sum(r.step.wall_ns for r in records) / 1e9
    per_tok = sorted(r.step.wall_ns for r in records)
    median_s = per_tok[len(per_tok) // 2] / 1e9 if per_tok else 0.0
    usage = resource.getrusage(resource.RUSAGE_SELF)
    run_totals = llama.totals() - totals0
    report = GenerateReport(
        model=str(model.info.path),
        mode=model.info.mode,
        load_s=load_s,
        prompt_tokens=len(prompt),
        prompt_s=stats.prompt_ns / 1e9,
        ttft_s=float(first.get("ttft_s", 0.0)),
        decode_tokens=len(records),
        decode_s=decode_s,
        decode_tok_s=len(records) / decode_s if decode_s > 0 else 0.0,
        decode_tok_s_median=1.0 / median_s if median_s > 0 else 0.0,
        text=llama.detokenize(tokens).decode(errors="replace"),
        tokens=tokens,
        peak_rss_bytes=usage.ru_maxrss * 1024,
        major_faults=usage.ru_majflt,
        storage_read_bytes=_storage_read_bytes(),
        prompt_bytes_read=int(first.get("prompt_read", 0)),
        load_bytes_read=storage0 - storage_before_load,
        per_token=records,
        decode_window=(float(first.get("decode_start", decode_end)), decode_end),
    )
    if llama.memory is not None:
        report.memory = asdict(llama.memory)
    if model.info.budget_bytes is not None and run_totals.streamer is not None:
        report.budget_bytes = model.info.budget_bytes
        report.budget_reason = model.info.budget_reason
        report.totals = run_totals
    return report


def _summary(r: GenerateReport) -> str:
    lines = [
        f"model {r.model} ({r.mode}), load {r.load_s:.2f} s, peak RSS "
        f"{format_size(r.peak_rss_bytes, unit='MiB', digits=0)}",
        f"prompt {r.prompt_tokens} tokens in {r.prompt_s:.2f} s, time to first token {r.ttft_s:.2f} s",
        f"decode {r.decode_tokens} tokens in {r.decode_s:.2f} s: {r.decode_tok_s:.2f} tok/s "
        f"(median {r.decode_tok_s_median:.2f})",
    ]
    if r.route_trace:
        lines.append(f"routing replayed from {r.route_trace}: the text is not the model's own")
    if r.budget_bytes is not None and r.totals is not None and r.totals.streamer is not None:
        step, t = r.totals, r.totals.streamer
        hits = (
            f"hit rate {step.hit_rate or 0:.1%} (cache {step.cache_hit_rate or 0:.1%}, "
            f"prefetch {t.prefetch_hits} of {t.prefetched} read ahead used)"
        )
        if t.routing_off:
            watched = f": before, over {t.routes} routes, {hits}" if t.routes else ""
            hits = f"every expert resident, routing no longer watched{watched}"
        lines.append(
            f"experts: budget {format_size(r.budget_bytes, unit='MiB', digits=0)} ({r.budget_reason}); "
            f"{hits}; read {format_size(t.bytes_read, unit='MiB', digits=0)}; "
            f"flash wait {t.flash_wait_ns / 1e9:.2f} s; cache {t.cache_ns / 1e9:.2f} s; "
            f"O_DIRECT {'on' if t.direct_io else 'off'}"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """The `generate` subcommand."""
    _check_args(args)
    settings = settings_of(ModelSettings, args)
    routing = settings_of(RouteTraceSettings, args)
    if settings.model is None:
        raise ConfigError("no model given: moeflash generate --model PATH (or MOEFLASH_MODEL)")
    if settings.parallel == "auto":
        # one request: the memory other slots would take stays the expert cache's
        settings = settings.model_copy(update={"parallel": 1})
    storage_before_load = _storage_read_bytes()
    t0 = time.perf_counter()
    model = load_model(settings, routing)
    load_s = time.perf_counter() - t0
    try:
        report = run_generation(model, args, load_s, storage_before_load)
        report.route_trace = str(routing.route_trace) if routing.route_trace else None
        if routing.record_route_trace is not None and model.route_shape is not None:
            write_trace(routing.record_route_trace, model.route_shape, recorded_routes(model.llama))
    finally:
        model.close()
    if args.json:
        print(json.dumps(report.to_json()))
    else:
        print()
        print(_summary(report), file=sys.stderr)
    return 0
