"""`moeflash bench`: one subcommand a benchmark, each with only the flags it runs with.

moeflash bench suite --shape qwen30b-shape --caps 0.25,0.5          # generates (or reuses) the model
moeflash bench suite --model m.gguf --caps 4G,8G --tokens 32
moeflash bench replay bench/route-traces/qwen.route.csv
moeflash bench warm-start --shape qwen30b-shape --caps 0.25  # the first answer after a restart
moeflash bench prompt-cache --shape qwen30b-8l-shape --caps 0.5  # agents taking turns, cache on/off
moeflash bench parallel --shape qwen30b-shape --caps all,0.5,0.25  # several clients at once

A benchmark's flags given to `bench` itself, as the command once took them (`bench --replay T`,
`bench --warm-start ...`, `bench --shape ...` for the suite), are refused with the subcommand's
command spelled out, exit status 2 as argparse's errors; so is bench's `--models-dir`, named
`--shapes-dir` (serve's `--models-dir` is a directory of models to serve, a thing of its own).
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import shlex
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from server.cli.arguments import add_arguments, given_flags, settings_of
from server.errors import ConfigError, MoeflashError
from server.settings import ModelSettings, RouteTraceSettings

logger = logging.getLogger(__name__)

# the context of every run unless --ctx-size says otherwise (a full-context run fills it)
BENCH_CTX_SIZE = 1024
# the prompt-cache replay's, as in issue 40's report (its conversations grow to about 3,400 tokens)
PROMPT_CACHE_CTX_SIZE = 8192
# the mode flags of `bench` before its subcommands, and the subcommand each became
OLD_MODES = (("--replay", "replay"), ("--warm-start", "warm-start"), ("--prompt-cache", "prompt-cache"))
# bench's flags that were renamed, and their names now
RENAMED = (("--models-dir", "--shapes-dir"),)


class _Renamed(argparse.Action):
    """A flag of bench that has another name now: refused, naming the new one."""

    def __call__(self, parser: argparse.ArgumentParser, *_: Any, **__: Any) -> None:
        new = dict(RENAMED)[self.option_strings[0]]
        parser.error(
            f"{self.option_strings[0]} is {new} in bench: where --shape models are generated and "
            "reused (serve's --models-dir is a directory of models to serve)"
        )


class _OldForm(argparse.Action):
    """A flag given to `bench` itself, as before its benchmarks were subcommands: kept with its
    values in order, for `_refuse_old_form` to spell out the new command."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: Any = None,
    ) -> None:
        given = [*(getattr(namespace, self.dest) or ()), (str(option_string), list(values))]
        setattr(namespace, self.dest, given)


def _new_form(given: Sequence[tuple[str, list[str]]], options: Mapping[str, set[str]]) -> tuple[str, str]:
    """The subcommand an old form meant, and its command line: the mode flag's subcommand (the
    suite without one), --replay's traces as replay's arguments, renamed flags under their new
    name, and flags the old form ignored in that mode left out."""
    modes, renamed = dict(OLD_MODES), dict(RENAMED)
    name = next((modes[flag] for flag, _ in given if flag in modes), "suite")
    words = ["moeflash", "bench", name]
    for flag, values in given:
        new = renamed.get(flag, flag)
        if flag in modes:
            words += values
        elif new in options[name]:
            words += [new, *values]
    return name, shlex.join(words)


def _refuse_old_form(
    parser: argparse.ArgumentParser, options: Mapping[str, set[str]], args: argparse.Namespace
) -> int:
    """`bench` without a subcommand: a usage error (exit status 2) that names the subcommand an
    old form's flags meant, spelled out with them."""
    if not args.old_form:
        parser.error(f"name a benchmark: moeflash bench {{{','.join(options)}}} (moeflash bench --help)")
    name, command = _new_form(args.old_form, options)
    first = next((flag for flag, _ in args.old_form if flag in dict(OLD_MODES)), args.old_form[0][0])
    parser.error(
        f"`moeflash bench {first}` is `moeflash bench {name}` now (each benchmark is a subcommand "
        f"with its own flags): {command}"
    )


def register(subparsers: Any) -> None:
    """Add `bench` and its subcommands; flags given to `bench` itself are the old forms'."""
    p = subparsers.add_parser(
        "bench",
        help="benchmark moeflash against stock mmap and the disk ceiling (or replay routing traces)",
        description="The benchmarks, one subcommand each (docs/benchmarks.md); `moeflash bench BENCH "
        "--help` gives a benchmark's flags.",
    )
    # not required: `bench` alone or with the old forms' flags reaches _refuse_old_form, which
    # names the subcommand meant
    benches = p.add_subparsers(title="benchmarks", metavar="BENCH")
    _register_suite(benches)
    replay = benches.add_parser(
        "replay",
        help="replay routing traces through the streamer's cache policies (no model, no clock)",
        description="Replay routing traces (*.route.csv) through the streamer's cache policies, beside "
        "LRU, LFU, random and Belady's optimum (server/bench/replay_report.py).",
    )
    replay.add_argument("traces", type=Path, nargs="+", metavar="TRACE", help="route trace(s) to replay")
    _add_out(replay, "trace-replay")
    replay.set_defaults(func=run_replay)
    _register_served(benches)
    # each subcommand's flags, for the old forms' message (argparse keeps them only privately)
    options = {
        name: set(sub._option_string_actions) - {"-h", "--help"} for name, sub in benches.choices.items()
    }
    old = sorted(set().union(*options.values(), dict(OLD_MODES)))
    p.add_argument(*old, dest="old_form", action=_OldForm, nargs="*", help=argparse.SUPPRESS)
    p.set_defaults(func=functools.partial(_refuse_old_form, p, options))


def _model_bench(
    benches: Any,
    name: str,
    run: Callable[[argparse.Namespace], int],
    tokens: tuple[int | None, str],
    caps: str = "0.25,0.5",
    **texts: str,
) -> Any:
    """A benchmark on a model: its parser, with what each of them takes (the model, --caps of
    default `caps`, --tokens of default and help `tokens`, --out) and `run` to run it; `texts` are
    its help and description."""
    p = benches.add_parser(name, **texts)
    p.set_defaults(func=run)
    _add_model_choice(p)
    every = "all (every expert cached), " if "all" in caps.split(",") else ""
    p.add_argument(
        "--caps",
        default=caps,
        help=f"memory caps: {every}fractions of the file size or sizes (4G) (default {caps})",
    )
    p.add_argument("--tokens", type=int, default=tokens[0], help=tokens[1])
    _add_out(p, "<name>" if name == "suite" else f"{name}-<name>")
    return p


def _register_suite(benches: Any) -> None:
    suite = _model_bench(
        benches,
        "suite",
        run_suite,
        (None, "decode tokens per system (default 32; with --route-trace the trace's whole decode)"),
        help="moeflash against stock mmap and the disk ceiling under memory caps, side by side",
        description="Side-by-side benchmark on one model file under memory caps, with the ratios of "
        f"docs/benchmarks.md (server/bench/harness.py); --ctx-size {BENCH_CTX_SIZE} unless given.",
    )
    suite.add_argument(
        "--mmap-tokens", type=int, default=8, help="decode tokens of the stock mmap run (slow)"
    )
    suite.add_argument("--no-levers", action="store_true", help="skip the one-lever-at-a-time variants")
    suite.add_argument("--ceiling-seconds", type=float, default=8.0, help="seconds per disk-ceiling pattern")
    # --route-trace routes every system by the trace, its prompt as long as the trace's
    _add_model_settings(suite, trace=True)


def _register_served(benches: Any) -> None:
    """The benchmarks of real `moeflash serve` processes."""
    warm = _model_bench(
        benches,
        "warm-start",
        run_warm_start,
        (32, "tokens per answer"),
        help="the first answer after a restart of `serve`, warm-started and cold",
        description="The first answer after a restart of `serve` under memory caps, warm-started from "
        f"the last run's hot set and cold (server/bench/warm_start.py); --ctx-size {BENCH_CTX_SIZE} unless "
        "given.",
    )
    warm.add_argument("--rounds", type=int, default=3, help="restarts per cap and schedule")
    _add_model_settings(warm)
    _add_model_settings(
        _model_bench(
            benches,
            "prompt-cache",
            run_prompt_cache,
            (16, "tokens per answer"),
            help="an agent-like replay of `serve` with and without the prompt cache",
            description="Three agents taking turns on `serve` under memory caps, with and without the "
            "prompt cache, a restart in the middle (server/bench/prompt_cache.py); --ctx-size "
            f"{PROMPT_CACHE_CTX_SIZE} unless given.",
        )
    )
    parallel = _model_bench(
        benches,
        "parallel",
        run_parallel,
        (128, "tokens per stream"),
        caps="all,0.5,0.25",
        help="several clients at once on `serve --parallel 4`: aggregate tokens/s, latencies",
        description="Aggregate tokens/s of 1, 2 and 4 streams at once, and a short and a long request's "
        "time to first token beside a running stream, per memory cap (server/bench/parallel.py).",
    )
    parallel.add_argument("--rounds", type=int, default=2, help="rounds, the stream counts alternated")
    parallel.add_argument("--ctx-size", type=int, default=4096, help="each request's context")
    rpc = _model_bench(
        benches,
        "rpc",
        run_rpc,
        (32, "decode tokens per run"),
        caps="0.25",
        help="the main server alone and with an RPC helper holding its last layers, over shaped links",
        description="The main server (`generate`) under a memory cap alone, and with a `moeflash worker` "
        "holding its last layers over the loopback and shaped links, each process in a memory cgroup, "
        "alternated (server/bench/rpc.py). One cap.",
    )
    rpc.add_argument("--helper-layers", type=int, help="layers the helper holds (default: half the model's)")
    rpc.add_argument(
        "--links", default="loopback,1gbit-1ms,300mbit-3ms", help="links to the helper (default: all three)"
    )
    rpc.add_argument("--rounds", type=int, default=2, help="rounds, the systems alternated")
    _add_model_settings(rpc, trace=True)


def _add_model_choice(p: argparse.ArgumentParser) -> None:
    """--shape or --model, exactly one: the model a benchmark runs on (argparse refuses both or
    neither); --shapes-dir, where --shape's are generated and reused."""
    group = p.add_argument_group("the model (one of --shape, --model)")
    choice = group.add_mutually_exclusive_group(required=True)
    choice.add_argument("--shape", help="synthetic model preset to generate or reuse (e.g. qwen30b-shape)")
    choice.add_argument("-m", "--model", type=Path, help="an existing GGUF (the first file of a split set)")
    group.add_argument(
        "--shapes-dir",
        type=Path,
        default=Path("models"),
        help="where --shape models are generated and reused (default models)",
    )
    p.add_argument(*dict(RENAMED), nargs="?", action=_Renamed, help=argparse.SUPPRESS)


def _add_out(p: argparse.ArgumentParser, name: str) -> None:
    p.add_argument("--out", type=Path, help=f"report path without suffix (default bench/reports/{name})")


def _add_model_settings(p: argparse.ArgumentParser, trace: bool = False) -> None:
    """The model settings of serve and generate but --model (the model is --shape's or --model's),
    with `trace` --route-trace too: the ones given, and --config, go to every run (a system's own
    levers come later and win; --ctx-size is the benchmark's own unless given); and --delete-model."""
    p.add_argument("--delete-model", action="store_true", help="delete a model --shape generated afterwards")
    replay_only = {name for name in RouteTraceSettings.model_fields if name != "route_trace"}
    add_arguments(
        p, (ModelSettings, RouteTraceSettings) if trace else (ModelSettings,), {"model", *replay_only}
    )


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


def _command() -> str:
    """The command line as the reports record it."""
    return "moeflash " + " ".join(shlex.quote(a) for a in sys.argv[1:])


def _model_path(args: argparse.Namespace) -> tuple[Path, bool]:
    """--shape's model, generated (True) or reused in --shapes-dir, or --model's."""
    from server.bench.models import shape_model

    if args.shape:
        return shape_model(args.shape, args.shapes_dir, progress=sys.stderr.isatty())
    if not args.model.exists():
        raise ConfigError(f"model {args.model} does not exist")
    return args.model, False


def run_flags(args: argparse.Namespace) -> list[str]:
    """What a benchmark passes on to each run it starts: its --config and the model settings'
    flags given (but --model and --ctx-size, the benchmark's own)."""
    config = ["--config", str(args.config)] if args.config is not None else []
    return config + given_flags(args, ModelSettings, skip=("model", "ctx_size"))


@contextmanager
def _bench_model(args: argparse.Namespace) -> Iterator[tuple[Path, dict[str, Any], list[str]]]:
    """The model a benchmark of model settings runs on, its description (a generated one's sha256
    too) and the settings' flags given; with --delete-model, a model generated here is deleted
    afterwards, however the benchmark ended."""
    from server.bench.models import describe_model

    path, generated = _model_path(args)
    try:
        info = describe_model(path)
        if args.shape:
            info["sha256"] = path.with_suffix(".sha256").read_text().strip()
        yield path, info, run_flags(args)
    finally:
        if generated and args.delete_model:
            path.unlink(missing_ok=True)
            path.with_suffix(".sha256").unlink(missing_ok=True)


def _write(
    data: dict[str, Any],
    info: dict[str, Any],
    out: Path | None,
    name: str,
    write: Callable[[dict[str, Any], Path, str], list[Path]],
) -> int:
    """A served benchmark's report: its data with the model and the environment, under `out` or
    bench/reports/<name>; prints the files' paths."""
    from server.bench.harness import environment

    data = {"model": info, "environment": environment(), **data}
    for path in write(data, out or Path("bench/reports") / name, _command()):
        print(path)
    return 0


def run_replay(args: argparse.Namespace) -> int:
    """`moeflash bench replay`."""
    from server.bench.replay_report import run_replay as replay

    return replay(args.traces, args.out, _command(), _progress)


def _run_served(
    args: argparse.Namespace,
    name: str,
    ctx_size: int,
    measure: Callable[..., dict[str, Any]],
    write: Callable[[dict[str, Any], Path, str], list[Path]],
    **more: Any,
) -> int:
    """A benchmark of `serve` processes on the model under each cap, the model settings given
    passed to them, --ctx-size `ctx_size` unless given; its report is <name>-<model>."""
    with _bench_model(args) as (path, info, flags):
        data = measure(
            path,
            _parse_caps(args.caps, info["file_bytes"]),
            tokens=args.tokens,
            ctx_size=int(args.ctx_size or ctx_size),
            settings_flags=tuple(flags),
            progress=_progress,
            **more,
        )
        return _write(data, info, args.out, f"{name}-{info['name']}", write)


def run_warm_start(args: argparse.Namespace) -> int:
    """`moeflash bench warm-start`."""
    from server.bench.warm_start import run_warm_start as measure
    from server.bench.warm_start import write_warm_report

    if args.tokens < 4 or args.rounds < 1:
        raise ConfigError("--tokens must be >= 4 and --rounds >= 1")
    return _run_served(args, "warm-start", BENCH_CTX_SIZE, measure, write_warm_report, rounds=args.rounds)


def run_prompt_cache(args: argparse.Namespace) -> int:
    """`moeflash bench prompt-cache`."""
    from server.bench.prompt_cache import run_prompt_cache as measure
    from server.bench.prompt_cache import write_prompt_cache_report

    if args.tokens < 4:
        raise ConfigError("--tokens must be >= 4")
    return _run_served(args, "prompt-cache", PROMPT_CACHE_CTX_SIZE, measure, write_prompt_cache_report)


def run_parallel(args: argparse.Namespace) -> int:
    """`moeflash bench parallel`."""
    from server.bench.models import describe_model
    from server.bench.parallel import ALL, write_parallel_report
    from server.bench.parallel import run_parallel as measure

    if args.tokens < 8 or args.rounds < 1:
        raise ConfigError("--tokens must be >= 8 and --rounds >= 1")
    path, _ = _model_path(args)
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
    return _write(data, info, args.out, f"parallel-{info['name']}", write_parallel_report)


def run_rpc(args: argparse.Namespace) -> int:
    """`moeflash bench rpc`."""
    from server.bench.rpc import markdown, parse_links, summary
    from server.bench.rpc import run_rpc as measure
    from server.bench.served import write_report

    if args.tokens < 4 or args.rounds < 1:
        raise ConfigError("--tokens must be >= 4 and --rounds >= 1")
    shapes = parse_links(args.links)
    with _bench_model(args) as (path, info, flags):
        caps = _parse_caps(args.caps, info["file_bytes"])
        if len(caps) != 1:
            raise ConfigError("bench rpc takes one cap")
        trace = settings_of(RouteTraceSettings, args).route_trace
        if trace is not None:
            flags += _trace_flags(trace, path, info)
        if args.helper_layers is None:
            from server.loading.gguf_header import read_metadata

            meta = read_metadata(path)
            args.helper_layers = int(meta.get(f"{meta.get('general.architecture')}.block_count", 2)) // 2
        layers = args.helper_layers
        data = measure(
            path,
            caps[0],
            helper_layers=layers,
            shapes=shapes,
            rounds=args.rounds,
            tokens=args.tokens,
            settings_flags=tuple(flags),
            progress=_progress,
        )
        routing = "-trace" if trace is not None else ""

        def write(data: dict[str, Any], out: Path, command: str) -> list[Path]:
            return write_report(data, summary(data), out, command, markdown)

        return _write(data, info, args.out, f"rpc-{info['name']}{routing}", write)


def run_suite(args: argparse.Namespace) -> int:
    """`moeflash bench suite`."""
    from server.bench.harness import BenchConfig, run_bench
    from server.bench.report import write_reports
    from server.bench.systems import default_systems

    if (args.tokens is not None and args.tokens < 4) or args.mmap_tokens < 1:
        raise ConfigError("--tokens must be >= 4 and --mmap-tokens >= 1")
    trace = settings_of(RouteTraceSettings, args).route_trace
    with _bench_model(args) as (path, info, flags):
        tokens = args.tokens or 32
        if trace is not None:
            flags += _trace_flags(trace, path, info)
            # what the replay of each run's routes needs to judge its hit rate (ratios.py)
            given = settings_of(ModelSettings, args)
            info["route_trace"] |= {"cache_policy": given.cache_policy, "n_batch": given.n_batch}
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
        systems = default_systems(args.mmap_tokens, levers=not args.no_levers, traced=trace is not None)
        try:
            result = run_bench(cfg, systems, info, _progress)
        except OSError as exc:
            raise MoeflashError(str(exc)) from exc
        for report in write_reports(result, args.out or Path("bench/reports") / info["name"], _command()):
            print(report)
        print(json.dumps(result.ratios, indent=1))
    return 0
