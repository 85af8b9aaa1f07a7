"""The ratios of docs/benchmarks.md, computed from one benchmark's figures.

Each ratio says what it divides; None where a figure it needs is missing (a run failed or was
not part of this benchmark). Decode figures come from the per-token records (prompt excluded).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from server.bench.targets import check_targets
from server.loading.measured import DecodeStep
from server.loading.route_trace import load_trace

if TYPE_CHECKING:
    from server.bench.results import BenchResult, Run
    from server.loading.route_trace import Trace


def decode_figures(run: Run) -> dict[str, float] | None:
    """Per-token means of a run's decode steps (seconds, bytes) and its hit rates, read from the
    steps' records (server/loading/measured.py DecodeStep, which defines each figure).

    Hit rates are over the tokens whose routing was watched, and absent when none was (every
    expert resident: the streamer stops watching). bytes_read is the streamer's expert reads,
    or for a resident run what the process read from storage (its page faults).
    """
    if not run.ok:
        return None
    toks = run.report.get("per_token") or []
    if not toks:
        return None
    steps = [DecodeStep.from_json(t) for t in toks]
    n = len(steps)
    total = sum(steps[1:], steps[0])
    s = total.streamer
    reads = s.bytes_read if s is not None else sum(int(t.get("storage_read_bytes") or 0) for t in toks)
    # the report's records are in ns (streaming_ext's names); these figures in seconds
    out = {
        "tok_s_median": 1e9 / statistics.median(step.wall_ns for step in steps),
        "tok_s_mean": n * 1e9 / total.wall_ns,
        "seconds": total.wall_ns / n / 1e9,
        "compute_s": (total.compute_ns or 0) / n / 1e9,
        "flash_wait_s": (s.flash_wait_ns if s is not None else 0) / n / 1e9,
        "cache_s": (s.cache_ns if s is not None else 0) / n / 1e9,
        "bytes_read": reads / n,
    }
    watched = [step for step in steps if step.routed]
    if not watched:
        return out
    routed = sum(watched[1:], watched[0])
    figures = {
        "hit_rate": routed.hit_rate,
        "cache_hit_rate": routed.cache_hit_rate,
        "prefetch_hit_rate": routed.prefetch_hit_rate,
        "prefetch_accuracy": routed.prefetch_accuracy,
    }
    return out | {name: value for name, value in figures.items() if value is not None}


def _median_tok_s(run: Run) -> float | None:
    d = decode_figures(run)
    return d["tok_s_median"] if d else None


def _runs_of(result: BenchResult, name: str, cap: int | None) -> list[Run]:
    return [r for r in result.runs if r.system == name and r.cap_bytes == cap]


def _by_name(result: BenchResult, name: str, cap: int | None) -> Run | None:
    """A system's run; of a system run several times, the one that decoded fastest."""
    return max(_runs_of(result, name, cap), key=lambda r: _median_tok_s(r) or -1.0, default=None)


def _median_run(runs: list[Run]) -> Run | None:
    """Of a system's runs, the one of median decode speed (of an even number, the slower middle)."""
    decoded = sorted((r for r in runs if _median_tok_s(r) is not None), key=lambda r: _median_tok_s(r) or 0.0)
    return decoded[(len(decoded) - 1) // 2] if decoded else (runs[0] if runs else None)


def system_run(result: BenchResult, name: str, cap: int | None) -> Run | None:
    """The run that stands for a system at a cap in the report: of several rounds, the median."""
    return _median_run(_runs_of(result, name, cap))


def _round_ratios(num: list[Run], den: list[Run]) -> list[float | None]:
    """Decode tok/s of run i of one system over run i of another (runs are listed in the order
    they ran, so run i of each is round i; harness._in_rounds)."""
    return [_ratio(_median_tok_s(a), _median_tok_s(b)) for a, b in zip(num, den, strict=False)]


def _prompt_tok_s(run: Run | None) -> float | None:
    """Prompt tokens per second of a run, None when it failed."""
    if not run or not run.ok or not run.report.get("prompt_s"):
        return None
    return float(run.report["prompt_tokens"]) / float(run.report["prompt_s"])


def _ttft(run: Run | None) -> float | None:
    """Seconds from the start of the prompt to the first token, None when the run failed."""
    return run.report.get("ttft_s") if run and run.ok else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _median(values: list[float | None]) -> float | None:
    """Median of the values that exist, None when none does."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _best_random(ceiling: list[dict[str, Any]], probes: set[int] | None = None) -> float | None:
    """The best O_DIRECT random-read rate of the given probes (all when None)."""
    rates = [
        c["bytes_per_s"]
        for c in ceiling
        if c["pattern"] == "random" and (probes is None or c.get("probe", 0) in probes)
    ]
    return max(rates, default=None)


def _cap_ceiling(ceiling: list[dict[str, Any]], cap: int) -> float | None:
    """The disk ceiling a cap's runs are judged against: the best random-read rate of the probes
    just before and just after them (harness.run_bench), else of every probe."""
    before = next((c["probe"] for c in ceiling if c.get("before_cap_bytes") == cap), None)
    if before is None:
        return _best_random(ceiling)
    return _best_random(ceiling, {before, before + 1})


def _same_flash_attn(runs: list[Run]) -> bool:
    """Whether the runs (that succeeded) computed with the same flash attention setting: a share
    of the cached speed is a roofline only when both sides run the same graph."""
    seen = {((r.report.get("memory") or {}).get("context") or {}).get("flash_attn") for r in runs if r.ok}
    return len(seen) == 1 and None not in seen


def _cached_share_bound(
    ceiling: float | None, bytes_per_token: float | None, cached_tok_s: float | None
) -> float | None:
    """The most of the cached speed a run reading `bytes_per_token` can reach on this disk: the
    lower of 1 and ceiling / bytes per token / cached tok/s."""
    if not ceiling or not bytes_per_token or not cached_tok_s:
        return 1.0 if cached_tok_s and bytes_per_token == 0 else None
    return min(1.0, ceiling / bytes_per_token / cached_tok_s)


def _memory_discipline(run: Run | None) -> float | None:
    """Peak memory of a capped run (RSS + page cache charged) / what the loader accounted for:
    the budget and the terms it measured beside it (server/loading/budget.py), its margin left out."""
    if run is None or not run.ok or not run.cgroup_peak_bytes:
        return None
    rep = run.report
    terms = rep.get("memory") or {}
    if not terms:
        return None
    accounted = rep["budget_bytes"] + terms["in_use"] + terms["dense"]
    accounted += sum(v for k, v in terms["context"].items() if k != "flash_attn")
    return float(run.cgroup_peak_bytes / accounted)


def compute_ratios(result: BenchResult) -> dict[str, Any]:
    """Every ratio of docs/benchmarks.md, per cap where it depends on one."""
    refs = _references(result)
    out = _uncapped_ratios(result, refs)
    # a trace-routed bench: the trace its runs' routes are replayed from (read once)
    trace = load_trace(Path(result.model["route_trace"]["path"])) if result.model.get("route_trace") else None
    for cap in sorted({r.cap_bytes for r in result.runs if r.cap_bytes is not None}):
        out["per_cap"][str(cap)] = _cap_ratios(result, _cap_runs(result, cap), refs, trace)
    out["targets"] = [t.to_json() for t in check_targets(out, int(result.model["file_bytes"]))]
    return out


@dataclass(frozen=True)
class _References:
    """The uncapped references every cap is judged against."""

    routed: float  # expert bytes one token routes
    compute_bound: float | None  # decode tok/s with every expert cached
    prefill_compute: float | None  # the 512-token prompt's tok/s with every expert cached


def _references(result: BenchResult) -> _References:
    cached = _by_name(result, "streaming-all-cached", None)
    cached_d = decode_figures(cached) if cached else None
    return _References(
        routed=float(result.model["routed_bytes_per_token"]),
        compute_bound=cached_d["tok_s_median"] if cached_d else None,
        prefill_compute=_prompt_tok_s(_by_name(result, "streaming-all-cached-prefill-512", None)),
    )


def _uncapped_ratios(result: BenchResult, refs: _References) -> dict[str, Any]:
    """The ratios of the uncapped runs (the disk ceiling, residency), and an empty per_cap."""
    probes = sorted({c.get("probe", 0) for c in result.ceiling})
    resident = _by_name(result, "resident", None)
    res_d = decode_figures(resident) if resident else None
    prefill_resident = _prompt_tok_s(_by_name(result, "resident-prefill-512", None))
    cached_runs = _runs_of(result, "streaming-all-cached", None)
    rounds = _round_ratios(cached_runs, _runs_of(result, "resident", None))
    return {
        # the best probe of the whole run; each cap has its own (per_cap.disk_ceiling_bytes_per_s)
        "disk_ceiling_bytes_per_s": _best_random(result.ceiling),
        "disk_ceiling_probes_bytes_per_s": [_best_random(result.ceiling, {p}) for p in probes],
        "compute_bound_tok_s": refs.compute_bound,
        "prefill_512_compute_bound_tok_s": refs.prefill_compute,
        "resident_prefill_512_tok_s": prefill_resident,
        # residency for a long prompt: the batched expert matmuls run on cached slices too
        "prefill_512_residency": _ratio(refs.prefill_compute, prefill_resident),
        # the median over rounds of run i of each (adjacent runs, see harness.py): this machine's
        # speed drifts by 10-30% between runs minutes apart (one report: the resident run at 9.84
        # then 8.46 tok/s), which a ratio of neighbours mostly cancels and the median of three
        # rounds keeps one disturbed run out of; the faster run of each is kept for comparison
        "residency_overhead": _median(rounds),
        "residency_overhead_rounds": rounds,
        "residency_overhead_fastest": _ratio(refs.compute_bound, res_d["tok_s_median"] if res_d else None),
        "per_cap": {},
    }


@dataclass(frozen=True)
class _CapRuns:
    """A cap's disk ceiling and the runs its ratios divide: of the systems run in rounds (the
    default, stock mmap, every expert cached beside them), every run and the median one."""

    cap: int
    ceiling: float | None
    stream_runs: list[Run]
    mmap_runs: list[Run]
    paired_runs: list[Run]
    stream: Run | None
    mmap: Run | None
    sd: dict[str, float] | None  # the decode figures of the default's median run
    cached_tok_s: float | None  # decode over every expert cached, the median over the cap's rounds


def _cap_runs(result: BenchResult, cap: int) -> _CapRuns:
    # the default and stock mmap run in rounds (systems.CAPPED_ROUNDS): the same streaming run
    # decoded 1.47 to 1.90 tok/s by its place in the sequence. The speedup is the median of
    # the rounds' ratios; every other figure of the cap comes from the median run of each
    stream_runs = _runs_of(result, "streaming", cap)
    mmap_runs = _runs_of(result, "mmap-capped", cap)
    stream = _median_run(stream_runs)
    paired_runs = _runs_of(result, "streaming-all-cached-paired", cap)
    return _CapRuns(
        cap=cap,
        ceiling=_cap_ceiling(result.ceiling, cap),
        stream_runs=stream_runs,
        mmap_runs=mmap_runs,
        paired_runs=paired_runs,
        stream=stream,
        mmap=_median_run(mmap_runs),
        sd=decode_figures(stream) if stream else None,
        cached_tok_s=_median([_median_tok_s(r) for r in paired_runs]),
    )


def _cap_ratios(result: BenchResult, c: _CapRuns, refs: _References, trace: Trace | None) -> dict[str, Any]:
    """A cap's ratios: its load and prompt, its decode, and under trace routing the prefetch's."""
    decode = _cap_decode_ratios(result, c, refs)
    prompt = _cap_prompt_ratios(result, c, refs)
    out: dict[str, Any] = {"cap_bytes": c.cap, "disk_ceiling_bytes_per_s": c.ceiling, **prompt, **decode}
    if trace is not None:
        out["trace"] = _cap_trace_ratios(result, trace, c)
    return out


def _cap_prompt_ratios(result: BenchResult, c: _CapRuns, refs: _References) -> dict[str, Any]:
    """What a cap's load read, and its prompts: the short one's TTFT, the 512-token one's rate
    against stock mmap's and its rooflines."""
    stream, mmap, ceiling = c.stream, c.mmap, c.ceiling
    prefill = _by_name(result, "streaming-prefill-512", c.cap)
    prefill_tok_s = _prompt_tok_s(prefill)
    mmap_prefill = _by_name(result, "mmap-capped-prefill-512", c.cap)
    mmap_prefill_tok_s = _prompt_tok_s(mmap_prefill)
    prefill_bound = None
    if prefill and prefill_tok_s and ceiling and prefill.report.get("prompt_bytes_read"):
        prefill_bound = prefill.report["prompt_tokens"] * ceiling / prefill.report["prompt_bytes_read"]
    # as for decode: the prefill's roofline is the lower of its I/O bound and the same prompt
    # with every expert cached
    prefill_roof = min((x for x in (prefill_bound, refs.prefill_compute) if x), default=None)
    load_read = stream.report.get("load_bytes_read") if stream and stream.ok else None
    return {
        # what the load read from storage: a streamed model's dense weights, not its experts
        "load_bytes_read": load_read,
        "load_read_over_non_expert": _ratio(load_read, float(result.model["dense_bytes"])),
        "mmap_load_bytes_read": mmap.report.get("load_bytes_read") if mmap and mmap.ok else None,
        "ttft_20_s": _ttft(stream),
        "mmap_ttft_20_s": _ttft(mmap),
        "prefill_512_tok_s": prefill_tok_s,
        "mmap_prefill_512_tok_s": mmap_prefill_tok_s,
        "prefill_512_speedup_vs_mmap": _ratio(prefill_tok_s, mmap_prefill_tok_s),
        "ttft_512_s": _ttft(prefill),
        "mmap_ttft_512_s": _ttft(mmap_prefill),
        "prefill_512_io_bound_tok_s": prefill_bound,
        "prefill_512_efficiency": _ratio(prefill_tok_s, prefill_bound),
        "prefill_512_roofline_efficiency": _ratio(prefill_tok_s, prefill_roof),
    }


def _cap_decode_ratios(result: BenchResult, c: _CapRuns, refs: _References) -> dict[str, Any]:
    """A cap's decode: against stock mmap, its rooflines and the cached speed, and where its
    time, reads and memory went."""
    sd, ceiling, compute_bound = c.sd, c.ceiling, refs.compute_bound
    md = decode_figures(c.mmap) if c.mmap else None
    serial = _by_name(result, "lever-no-overlap", c.cap)
    ser_d = decode_figures(serial) if serial else None
    # docs/benchmarks.md: ceiling / (routed bytes x measured miss rate). A prefetched expert was still
    # read from flash (and so was a wrong guess), so the measured share of routed bytes that
    # came from flash is bytes read / routed bytes: I/O-bound = ceiling / bytes read per token
    io_bound = ceiling / sd["bytes_read"] if sd and ceiling and sd["bytes_read"] > 0 else None
    bound = (
        min(x for x in (compute_bound, io_bound) if x is not None) if (compute_bound or io_bound) else None
    )
    # decode over every expert cached, both in the cap's rounds with the same flash attention
    same_graph = _same_flash_attn(c.stream_runs + c.paired_runs)
    vs_cached_rounds = _round_ratios(c.stream_runs, c.paired_runs) if same_graph else []
    ideal = None
    if sd and ceiling and compute_bound:
        ideal = max(1.0 / compute_bound, sd["bytes_read"] / ceiling)
    speedups = _round_ratios(c.stream_runs, c.mmap_runs)
    return {
        "streaming_tok_s": sd["tok_s_median"] if sd else None,
        # medians on both sides, as docs/benchmarks.md's decode tok/s (the mean and the median of stock
        # mmap's few tokens differ by 1-3% either way: like must be divided by like)
        "mmap_tok_s": md["tok_s_median"] if md else None,
        "io_bound_tok_s": io_bound,
        "roofline_efficiency": _ratio(sd["tok_s_median"] if sd else None, bound),
        "cached_tok_s": c.cached_tok_s,
        "vs_cached": _median(vs_cached_rounds),
        "vs_cached_rounds": vs_cached_rounds,
        "vs_cached_same_flash_attn": same_graph,
        "vs_cached_bound": _cached_share_bound(ceiling, sd["bytes_read"] if sd else None, c.cached_tok_s),
        "speedup_vs_mmap": _median(speedups),
        "speedup_vs_mmap_rounds": speedups,
        # bytes read per second of waiting, of the serial lever: there every read is waited for,
        # while the default (overlap) reads on through the matmuls of the experts already read,
        # so its bytes per second of waiting would count reads nobody waited for
        "io_efficiency": _ratio(
            ser_d["bytes_read"] / ser_d["flash_wait_s"] if ser_d and ser_d["flash_wait_s"] else None,
            ceiling,
        ),
        "serial_lever_tok_s": ser_d["tok_s_median"] if ser_d else None,
        # the disk's busy share over the whole token: reads per token x tok/s / ceiling. With
        # prefetch most reading happens while layers compute, outside the flash wait, so this
        # (not io_efficiency) says how close decode runs to the disk
        "disk_utilisation": _ratio(
            sd["bytes_read"] / sd["seconds"] if sd and sd["seconds"] else None, ceiling
        ),
        "overlap_efficiency": _ratio(ideal, sd["seconds"] if sd else None),
        "memory_discipline": _memory_discipline(c.stream),
        "memory_discipline_full_context": _memory_discipline(
            _by_name(result, "streaming-full-context", c.cap)
        ),
        "hit_rate": sd.get("hit_rate") if sd else None,
        "cache_hit_rate": sd.get("cache_hit_rate") if sd else None,
        "prefetch_hit_rate": sd.get("prefetch_hit_rate") if sd else None,
        "read_fraction": sd["bytes_read"] / refs.routed if sd and refs.routed else None,
        "per_token_split_s": {k: sd[k] for k in ("compute_s", "flash_wait_s", "cache_s")} if sd else None,
        # what the kernel read for stock mmap per decoded token (its page faults)
        "mmap_bytes_read_per_token": md["bytes_read"] if md else None,
    }


def _cap_trace_ratios(result: BenchResult, trace: Trace, c: _CapRuns) -> dict[str, Any]:
    """A trace-routed cap's prefetch figures, and the emulated predictor's share of the cached
    speed where it ran the cached runs' graph."""
    traced = _trace_figures(result, trace, c.cap, c.sd)
    emulated = traced.get("prefetch_emulated")
    emulated_run = _by_name(result, "streaming-prefetch-emulated", c.cap)
    if emulated and emulated_run and _same_flash_attn([emulated_run, *c.paired_runs]):
        traced["emulated_vs_cached"] = _ratio(emulated["tok_s"], c.cached_tok_s)
        traced["emulated_vs_cached_bound"] = _cached_share_bound(
            c.ceiling, emulated["bytes_read"], c.cached_tok_s
        )
    return traced


def _prefetch_figures(run: Run | None) -> dict[str, Any] | None:
    """Decode rate, hit rates and the prefetch's accuracy of one capped run."""
    d = decode_figures(run) if run else None
    if not d or "hit_rate" not in d:
        return None
    return {
        "tok_s": d["tok_s_median"],
        "hit_rate": d["hit_rate"],
        "cache_hit_rate": d["cache_hit_rate"],
        "prefetch_hit_rate": d["prefetch_hit_rate"],
        "prefetch_accuracy": d.get("prefetch_accuracy"),
        "bytes_read": d["bytes_read"],
        "per_token_split_s": {k: d[k] for k in ("compute_s", "flash_wait_s", "cache_s")},
    }


def _trace_figures(result: BenchResult, trace: Trace, cap: int, sd: dict[str, Any] | None) -> dict[str, Any]:
    """A trace-routed cap: the prefetch's bounds (the model's router, a lower bound since it
    predicts the model's routing, not the trace's; the trace itself, the upper bound; none), the
    prefetch from past routing between them, the
    cache's hit rate without prefetch against the replay of the same routes at the same budget,
    and the default policy's share of Belady's optimum there."""
    from server.bench.replay import replay_run
    from streaming_ext import Policy

    info = result.model["route_trace"]
    off_run = _by_name(result, "lever-no-prefetch", cap)
    out: dict[str, Any] = {
        "prefetch_router": _prefetch_figures(_median_run(_runs_of(result, "streaming", cap))),
        "prefetch_history": _prefetch_figures(_by_name(result, "streaming-prefetch-history", cap)),
        "prefetch_trace": _prefetch_figures(_by_name(result, "streaming-prefetch-from-trace", cap)),
        "prefetch_emulated": _prefetch_figures(_by_name(result, "streaming-prefetch-emulated", cap)),
        "prefetch_off": _prefetch_figures(off_run),
        "cache_share": sd["cache_s"] / sd["seconds"] if sd and sd["seconds"] else None,
        "replay_cache_hit_rate": None,
        "replay_belady_hit_rate": None,
        "replay_disagreement_points": None,
        "share_of_belady": None,
    }
    off = out["prefetch_off"]
    if off is None or off_run is None or not off_run.report.get("budget_bytes"):
        return out
    replay = replay_run(
        trace,
        decode_steps=len(off_run.report["per_token"]),
        n_batch=int(info["n_batch"]),
        frame_bytes=int(result.model["frame_bytes"]),
        budget_bytes=int(off_run.report["budget_bytes"]),
        policy=Policy[str(info["cache_policy"]).upper()],
    )
    measured = 100.0 * off["cache_hit_rate"]
    out |= {
        "replay_cache_hit_rate": replay.policy / 100.0,
        "replay_belady_hit_rate": replay.belady / 100.0,
        "replay_disagreement_points": abs(measured - replay.policy),
        "share_of_belady": measured / replay.belady if replay.belady else None,
    }
    return out
