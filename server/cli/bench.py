"""`moeflash bench`: the side-by-side benchmark, and `--replay` of routing traces.

moeflash bench --shape qwen30b-shape --caps 0.25,0.5          # generates (or reuses) the model
moeflash bench --model m.gguf --caps 4G,8G --tokens 32
moeflash bench --replay bench/route-traces/qwen.route.csv
moeflash bench --warm-start --shape qwen30b-shape --caps 0.25  # the first answer after a restart
moeflash bench --prompt-cache --shape qwen30b-8l-shape --caps 0.5  # agents taking turns, cache on/off
moeflash bench parallel --shape qwen30b-shape --caps all,0.5,0.25  # several clients at once
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from server.errors import ConfigError, MoeflashError
from server.settings import ModelSettings, RouteTraceSettings, add_arguments, given_flags

logger = logging.getLogger(__name__)

# the context of every run unless --ctx-size says otherwise (a full-context run fills it)
BENCH_CTX_SIZE = 1024
# the prompt-cache replay's, as in issue 40's report (its conversations grow to about 3,400 tokens)
PROMPT_CACHE_CTX_SIZE = 8192


def register(subparsers: Any) -> None:
    """Add the `bench` subcommand."""
    p = subparsers.add_parser(
        "bench",
        help="benchmark moeflash against stock mmap and the disk ceiling (or replay routing traces)",
        description="Side-by-side benchmark on one model file under memory caps, with the ratios of "
        "docs/benchmarks.md; or --replay a routing trace through the streamer's cache policy.",
    )
    what = p.add_argument_group("what to measure (one of --shape, --model, --replay)")
    what.add_argument("--shape", help="synthetic model preset to generate or reuse (e.g. qwen30b-shape)")
    what.add_argument("--replay", type=Path, nargs="+", help="route trace(s) to replay (*.route.csv)")
    p.add_argument("--caps", default="0.25,0.5", help="memory caps: fractions of the file size or sizes (4G)")
    p.add_argument(
        "--tokens",
        type=int,
        default=None,
        help="decode tokens per system (default 32; with --route-trace the trace's whole decode)",
    )
    p.add_argument("--mmap-tokens", type=int, default=8, help="decode tokens of the stock mmap run (slow)")
    p.add_argument("--no-levers", action="store_true", help="skip the one-lever-at-a-time variants")
    p.add_argument(
        "--warm-start",
        action="store_true",
        help="measure instead the first answer after a restart of `serve`, warm-started and cold "
        "(server/bench/warm_start.py)",
    )
    p.add_argument("--rounds", type=int, default=3, help="--warm-start: restarts per cap and schedule")
    p.add_argument(
        "--prompt-cache",
        action="store_true",
        help="measure instead an agent-like replay of `serve` with and without the prompt cache "
        f"(server/bench/prompt_cache.py; --ctx-size {PROMPT_CACHE_CTX_SIZE} unless given)",
    )
    p.add_argument("--ceiling-seconds", type=float, default=8.0, help="seconds per disk-ceiling pattern")
    p.add_argument("--models-dir", type=Path, default=Path("models"), help="where --shape models live")
    p.add_argument("--delete-model", action="store_true", help="delete a generated model afterwards")
    p.add_argument("--out", type=Path, help="report path without suffix (default bench/reports/<name>)")
    # the model settings of serve and generate: --model is an existing GGUF (the first file of a split
    # set); the others given go to every system's run (its own levers come later and win), and
    # --ctx-size is 1024 unless given; --route-trace routes every system by the trace, its prompt
    # as long as the trace's
    add_arguments(p, (ModelSettings, RouteTraceSettings))
    p.set_defaults(func=run)
    benches = p.add_subparsers(title="benchmarks with a subcommand", metavar="BENCH")
    parallel = benches.add_parser(
        "parallel",
        help="several clients at once on `serve --parallel 4`: aggregate tokens/s, latencies",
        description="Aggregate tokens/s of 1, 2 and 4 streams at once, and a short and a long request's "
        "time to first token beside a running stream, per memory cap (server/bench/parallel.py).",
    )
    shape = parallel.add_mutually_exclusive_group(required=True)
    shape.add_argument("--shape", help="synthetic model preset to generate or reuse (e.g. qwen30b-shape)")
    shape.add_argument("--model", "-m", type=Path, help="an existing GGUF (the first file of a split set)")
    parallel.add_argument(
        "--caps",
        default="all,0.5,0.25",
        help="memory caps: all (every expert cached), fractions of the file size or sizes (4G)",
    )
    parallel.add_argument("--tokens", type=int, default=128, help="tokens per stream")
    parallel.add_argument("--rounds", type=int, default=2, help="rounds, the stream counts alternated")
    parallel.add_argument("--ctx-size", type=int, default=4096, help="each request's context")
    parallel.add_argument("--models-dir", type=Path, default=Path("models"), help="where --shape models live")
    parallel.add_argument(
        "--out", type=Path, help="report path without suffix (default bench/reports/<name>)"
    )
    parallel.set_defaults(func=run_parallel)


def _parse_caps(text: str, file_bytes: int) -> list[int]:
    from server.units import parse_size

    caps = []
    for part in filter(None, (x.strip() for x in text.split(","))):
        try:
            value = float(part)
            caps.append(int(value * file_bytes) if value <= 1.0 else int(value))
        except ValueError:
            try:
                caps.append(parse_size(part))
            except ValueError as exc:
                raise ConfigError(f"--caps: {exc}") from None
    if not caps:
        raise ConfigError("--caps needs at least one cap")
    return caps


def _trace_flags(trace_path: Path, model: Path, info: dict[str, Any]) -> list[str]:
    """The flags that route every system by the trace (checked against the model first, so a
    trace that does not fit fails here, not in every run), its prompt the trace's prompt length;
    the report says the routing is the trace's."""
    from server.loading.route_trace import ModelShape, check_fits, load_trace

    trace = load_trace(trace_path)
    check_fits(trace, ModelShape.of(model), trace_path)
    prompt = len(trace.steps(decode=False))
    decode = len(trace.steps(decode=True))
    info["route_trace"] = {"path": str(trace_path), "prompt_steps": prompt, "decode_steps": decode}
    return ["--route-trace", str(trace_path.resolve()), "--prompt-tokens", str(prompt)]


def _progress(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _write(
    data: dict[str, Any],
    info: dict[str, Any],
    out: Path | None,
    name: str,
    write: Callable[[dict[str, Any], Path, str], list[Path]],
    command: str,
) -> int:
    """A served benchmark's report: its data with the model and the environment, under `out` or
    bench/reports/<name>; prints the files' paths."""
    from server.bench.harness import environment

    data = {"model": info, "environment": environment(), **data}
    for path in write(data, out or Path("bench/reports") / name, command):
        print(path)
    return 0


def _warm_start(
    args: argparse.Namespace, path: Path, info: dict[str, Any], flags: list[str], tokens: int, command: str
) -> int:
    from server.bench.warm_start import run_warm_start, write_warm_report

    if args.rounds < 1:
        raise ConfigError("--rounds must be >= 1")
    data = run_warm_start(
        path,
        _parse_caps(args.caps, info["file_bytes"]),
        rounds=args.rounds,
        tokens=tokens,
        ctx_size=int(args.ctx_size or BENCH_CTX_SIZE),
        settings_flags=tuple(flags),
        progress=_progress,
    )
    return _write(data, info, args.out, f"warm-start-{info['name']}", write_warm_report, command)


def _prompt_cache(
    args: argparse.Namespace, path: Path, info: dict[str, Any], flags: list[str], tokens: int, command: str
) -> int:
    from server.bench.prompt_cache import run_prompt_cache, write_prompt_cache_report

    data = run_prompt_cache(
        path,
        _parse_caps(args.caps, info["file_bytes"]),
        tokens=tokens,
        ctx_size=int(args.ctx_size or PROMPT_CACHE_CTX_SIZE),
        settings_flags=tuple(flags),
        progress=_progress,
    )
    return _write(data, info, args.out, f"prompt-cache-{info['name']}", write_prompt_cache_report, command)


def run_parallel(args: argparse.Namespace) -> int:
    """`moeflash bench parallel`."""
    from server.bench.models import describe_model, shape_model
    from server.bench.parallel import ALL, write_parallel_report
    from server.bench.parallel import run_parallel as measure

    command = "moeflash " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    if args.tokens < 8 or args.rounds < 1:
        raise ConfigError("--tokens must be >= 8 and --rounds >= 1")
    path = (
        shape_model(args.shape, args.models_dir, progress=sys.stderr.isatty())[0]
        if args.shape
        else args.model
    )
    if not path.exists():
        raise ConfigError(f"model {path} does not exist")
    info = describe_model(path)
    words = [c.strip() for c in args.caps.split(",") if c.strip()]
    caps: list[int | str] = [ALL] * (ALL in words)
    rest = ",".join(w for w in words if w != ALL)
    caps += _parse_caps(rest, info["file_bytes"]) if rest else []
    data = measure(
        path,
        caps,
        tokens=args.tokens,
        rounds=args.rounds,
        ctx_size=args.ctx_size,
        settings_flags=(),
        progress=_progress,
    )
    return _write(data, info, args.out, f"parallel-{info['name']}", write_parallel_report, command)


def run(args: argparse.Namespace) -> int:
    """The `bench` subcommand."""
    command = "moeflash " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    if sum(bool(x) for x in (args.shape, args.model, args.replay)) != 1:
        raise ConfigError("name one of --shape, --model or --replay")
    if args.replay:
        from server.bench.replay_report import run_replay

        return run_replay(args.replay, args.out, command, _progress)
    if (args.tokens is not None and args.tokens < 4) or args.mmap_tokens < 1:
        raise ConfigError("--tokens must be >= 4 and --mmap-tokens >= 1")
    routing = RouteTraceSettings.from_args(args)
    if routing.record_route_trace is not None:
        raise ConfigError("--record-route-trace records one run: use it with moeflash generate")
    if routing.prefetch_from_trace:
        raise ConfigError(
            "--prefetch-from-trace is one of the systems a traced bench runs: give --route-trace"
        )
    from server.bench.harness import BenchConfig, run_bench
    from server.bench.models import describe_model, shape_model
    from server.bench.report import write_reports
    from server.bench.systems import default_systems

    generated = False
    if args.shape:
        path, generated = shape_model(args.shape, args.models_dir, progress=sys.stderr.isatty())
    else:
        path = Path(args.model)
        if not path.exists():
            raise ConfigError(f"model {path} does not exist")
    try:
        info = describe_model(path)
        if args.shape:
            info["sha256"] = path.with_suffix(".sha256").read_text().strip()
        flags = given_flags(args, ModelSettings, skip=("model", "ctx_size", "config"))
        tokens = args.tokens or 32
        if args.warm_start:
            if routing.route_trace is not None:
                raise ConfigError("--warm-start measures `serve`, which runs the model's own routing")
            return _warm_start(args, path, info, flags, tokens, command)
        if args.prompt_cache:
            if routing.route_trace is not None:
                raise ConfigError("--prompt-cache measures `serve`, which runs the model's own routing")
            return _prompt_cache(args, path, info, flags, args.tokens or 16, command)
        if routing.route_trace is not None:
            flags += _trace_flags(routing.route_trace, path, info)
            # what the replay of each run's routes needs to judge its hit rate (ratios.py)
            defaults = ModelSettings.model_fields
            info["route_trace"] |= {
                "cache_policy": args.cache_policy or defaults["cache_policy"].default,
                "n_batch": int(args.n_batch or defaults["n_batch"].default),
            }
            # the first token comes from the prompt: one decode step fewer than tokens
            tokens = args.tokens or info["route_trace"]["decode_steps"] + 1
        cfg = BenchConfig(
            model=path,
            caps=_parse_caps(args.caps, info["file_bytes"]),
            decode_tokens=tokens,
            ctx_size=int(args.ctx_size or BENCH_CTX_SIZE),
            ceiling_seconds=args.ceiling_seconds,
            settings_flags=tuple(flags),
        )
        systems = default_systems(
            args.mmap_tokens, levers=not args.no_levers, traced=routing.route_trace is not None
        )
        try:
            result = run_bench(cfg, systems, info, _progress)
        except OSError as exc:
            raise MoeflashError(str(exc)) from exc
        out = args.out or Path("bench/reports") / info["name"]
        for p in write_reports(result, out, command):
            print(p)
        print(json.dumps(result.ratios, indent=1))
    finally:
        if generated and args.delete_model:
            path.unlink(missing_ok=True)
            path.with_suffix(".sha256").unlink(missing_ok=True)
    return 0
