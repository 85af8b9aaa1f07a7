"""Writing a benchmark's report: JSON (every figure), Markdown (tables) and a PNG chart."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from server.bench.charts import chart
from server.bench.ratios import decode_figures
from server.bench.results import BenchResult, Run
from server.bench.systems import EMULATED_PREDICTOR_ERROR
from server.units import SizeUnit, format_size


def _routing_lines(model: dict[str, Any]) -> list[str]:
    trace = model.get("route_trace")
    if not trace:
        return []
    return [
        f"Routing: **replayed from {trace['path']}** ({trace['prompt_steps']} prompt and "
        f"{trace['decode_steps']} decode steps) for every system, stock mmap included: lossy, the "
        "text is not the model's own; the short prompt has the trace's prompt length."
    ]


def _fmt(value: float | None, spec: str = ".2f", unit: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{unit}"


def _series(values: list[float | None]) -> str:
    return ", ".join(_fmt(x, ".1f", "x") for x in values)


def _name(run: Run, result: BenchResult) -> str:
    """The system's name, with the run's number where the system ran more than once."""
    n = sum(r.system == run.system and r.cap_bytes == run.cap_bytes for r in result.runs)
    return f"{run.system} #{run.repeat + 1}" if n > 1 else run.system


def _cap(run: Run) -> str:
    if run.cap_bytes is None:
        return "none"
    cap = format_size(run.cap_bytes, unit="GiB", digits=2)
    if run.cgroup_peak_bytes is None and run.ok:
        return f"none (in the {cap} rounds)"  # a reference, uncapped
    return cap


def markdown(result: BenchResult, command: str) -> str:
    """The report as Markdown: model, environment, ceiling, one row per run, the ratios."""
    lines = _header(result, command)
    lines += _ceiling(result.ceiling)
    lines += _systems(result)
    ra = result.ratios
    lines += _ratios(ra)
    lines += _caps(ra)
    lines += _vs_cached(ra)
    lines += _prefill(ra)
    lines += _traced(ra)
    lines += _targets(ra.get("targets") or [])
    return "\n".join(lines) + "\n"


def _header(result: BenchResult, command: str) -> list[str]:
    """The title, the command, and what ran: the model, the machine, the code, the routing."""
    m = result.model
    env = result.environment
    return [
        f"# moeflash bench: {m['name']}",
        "",
        f"Produced by `{command}`.",
        "",
        f"Model: {m['path']} ({format_size(m['file_bytes'], unit='GB', digits=2)}; "
        f"{format_size(m['bytes_per_expert'], unit='MiB', digits=2)} per expert, "
        f"{format_size(m['routed_bytes_per_token'], unit='MiB', digits=0)} routed per token, "
        # the file's non-expert bytes; a streaming run's "dense" (RAM) excludes mapped embeddings
        f"non-expert weights {format_size(m['dense_bytes'], unit='MiB', digits=0)}; "
        f"sha256 {m.get('sha256', 'n/a')}).",
        f"Machine: {env.get('cpu_model', '?')}, {env.get('cpus')} cores, "
        f"{format_size(env.get('mem_total_bytes', 0), unit='GiB', digits=1)}; read_ahead_kb "
        f"{env.get('read_ahead_kb')}; {result.cgroup}; page cache {result.page_cache}.",
        f"Code: moeflash {env.get('moeflash', '?')}, commit "
        f"{env.get('commit') or 'unknown (not a git checkout)'}.",
        *_routing_lines(m),
    ]


def _ceiling(ceiling: list[dict[str, Any]]) -> list[str]:
    """The disk ceiling's probes, one row each."""
    lines = [
        "",
        "## Disk ceiling (same file)",
        "",
        "Probed before the uncapped runs, before each cap's runs and after the last ones; each cap is"
        " judged against the best random-read rate of the probes just before and after its runs.",
        "",
        "| probe | pattern | readers | read size | MB/s | O_DIRECT |",
        "|---|---|---|---|---|---|",
    ]
    for c in ceiling:
        lines.append(
            f"| {c.get('probe', 0) + 1}: {c.get('label', '')} | {c['pattern']} | {c['readers']} | "
            f"{format_size(c['read_bytes'], unit='MiB', digits=2)} | {c['bytes_per_s'] / 1e6:.0f} | "
            f"{'yes' if c['direct_io'] else 'no'} |"
        )
    return lines


def _systems(result: BenchResult) -> list[str]:
    """One row per run, in the order they ran."""
    lines = [
        "",
        "## Systems",
        "",
        "| system | cap | load s | TTFT s | prompt tok/s | decode tok/s (median / mean) | "
        "peak RSS MiB | cgroup peak MiB | major faults | read MB/token | hit rate (cache + prefetch) | "
        "compute / flash wait / cache ms per token |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    return lines + [_run_row(run, result) for run in result.runs]


def _run_row(run: Run, result: BenchResult) -> str:
    """A run's row: its times, rates, memory and reads, or why it failed."""
    if not run.ok:
        return f"| {_name(run, result)} | {_cap(run)} | failed: {(run.error or '').splitlines()[-1][:120]} |"
    r = run.report
    d = decode_figures(run)
    n_dec = max(1, r.get("decode_tokens", 1))
    # per decoded token; a run without decode records spreads the whole run's reads (load
    # and prompt too) over every token
    spread = r.get("storage_read_bytes", 0) / (r["prompt_tokens"] + n_dec)
    read_per_tok = d["bytes_read"] if d else spread
    cgroup_peak = _bytes(run.cgroup_peak_bytes or None, "MiB", 0)
    split = (
        f"{d['compute_s'] * 1e3:.0f} / {d['flash_wait_s'] * 1e3:.0f} / {d['cache_s'] * 1e3:.0f}"
        if d and r.get("mode") == "streaming"
        else "n/a"
    )
    return (
        f"| {_name(run, result)} | {_cap(run)} | {r['load_s']:.2f} | {r['ttft_s']:.2f} | "
        f"{r['prompt_tokens'] / r['prompt_s'] if r['prompt_s'] else 0:.1f} | "
        f"{_fmt(d['tok_s_median'] if d else None)} / {_fmt(d['tok_s_mean'] if d else None)} | "
        f"{_bytes(r['peak_rss_bytes'], 'MiB', 0)} | {cgroup_peak} | "
        f"{r.get('major_faults', 'n/a')} | {_bytes(read_per_tok, 'MB', 1)} | "
        f"{_hits(d) if d and r.get('mode') == 'streaming' else 'n/a'} | {split} |"
    )


def _ratios(ra: dict[str, Any]) -> list[str]:
    """The uncapped ratios: the disk ceiling, the compute bound, prefill and residency."""
    ceiling_mb = ra["disk_ceiling_bytes_per_s"] / 1e6 if ra.get("disk_ceiling_bytes_per_s") else None
    return [
        "",
        "## Ratios (docs/benchmarks.md)",
        "",
        f"- disk ceiling (best O_DIRECT random-read rate of any probe): {_fmt(ceiling_mb, '.0f')} MB/s; "
        "probe by probe: "
        + ", ".join(_mb(x) for x in ra.get("disk_ceiling_probes_bytes_per_s") or [])
        + " MB/s",
        f"- compute-bound tok/s (streaming, every expert cached): {_fmt(ra.get('compute_bound_tok_s'))}",
        "- prefill of a 512-token prompt, tok/s: every expert cached "
        + _fmt(ra.get("prefill_512_compute_bound_tok_s"))
        + ", resident "
        + _fmt(ra.get("resident_prefill_512_tok_s"))
        + f" (ratio {_fmt(ra.get('prefill_512_residency'), '.2f')})",
        f"- residency overhead (all-cached / resident, the median over rounds of adjacent runs): "
        f"{_fmt(ra.get('residency_overhead'), '.3f')}"
        + (
            f"; round by round: {', '.join(_fmt(x, '.3f') for x in ra['residency_overhead_rounds'])}"
            f"; the faster run of each: {_fmt(ra.get('residency_overhead_fastest'), '.3f')}"
            if len(ra.get("residency_overhead_rounds") or []) > 1
            else ""
        ),
    ]


def _caps(ra: dict[str, Any]) -> list[str]:
    """Decode per cap: moeflash against stock mmap and against its rooflines, and the speedup's
    rounds where there were several."""
    lines = [
        "",
        "Ceiling = the cap's own (the probes around its runs). I/O-bound tok/s = ceiling / bytes read"
        " per token (prefetched experts are read too);"
        " I/O eff. = docs/benchmarks.md's bytes read during flash wait / wait / ceiling, of the serial lever"
        " (overlap off: every read is waited for); disk use = bytes read per token x tok/s / ceiling"
        " (with prefetch and overlap, most reads happen while layers compute).",
        "",
        "| cap | ceiling MB/s | streaming tok/s | mmap tok/s | speedup | I/O-bound tok/s | roofline eff. | "
        "serial lever tok/s (I/O eff.) | disk use | overlap eff. | memory discipline | "
        "hit rate (cache + prefetch) | TTFT 20 tok (mmap) s | read at load MB (mmap) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for cap in ra.get("per_cap", {}).values():
        lines.append(
            f"| {format_size(cap['cap_bytes'], unit='GiB', digits=2)} | "
            f"{_mb(cap.get('disk_ceiling_bytes_per_s'))} | {_fmt(cap['streaming_tok_s'])} | "
            f"{_fmt(cap['mmap_tok_s'], '.3f')} | "
            f"{_fmt(cap['speedup_vs_mmap'], '.1f', 'x')} | {_fmt(cap['io_bound_tok_s'])} | "
            f"{_fmt(cap['roofline_efficiency'], '.2f')} | "
            f"{_fmt(cap.get('serial_lever_tok_s'))} ({_fmt(cap.get('io_efficiency'), '.2f')}) | "
            f"{_fmt(cap.get('disk_utilisation'), '.2f')} | "
            f"{_fmt(cap['overlap_efficiency'], '.2f')} | "
            f"{_fmt(cap['memory_discipline'], '.2f')} | {_fmt(cap.get('cache_hit_rate'), '.1%')} + "
            f"{_fmt(cap.get('prefetch_hit_rate'), '.1%')} | "
            f"{_fmt(cap['ttft_20_s'], '.1f')} ({_fmt(cap['mmap_ttft_20_s'], '.1f')}) | "
            f"{_bytes(cap.get('load_bytes_read'), 'MB', 0)} "
            f"({_bytes(cap.get('mmap_load_bytes_read'), 'MB', 0)}) |"
        )
    rounds = {c["cap_bytes"]: c.get("speedup_vs_mmap_rounds") or [] for c in ra.get("per_cap", {}).values()}
    if any(len(r) > 1 for r in rounds.values()):
        lines += [
            "",
            "Stock mmap and the default ran in alternated rounds under each cap; the speedup is the median"
            " of the rounds' ratios, the other figures of a cap are those of each system's median run."
            " Speedup by round: "
            + "; ".join(f"{format_size(cap, unit='GiB', digits=2)} {_series(r)}" for cap, r in rounds.items())
            + ".",
        ]
    return lines


def _prefill(ra: dict[str, Any]) -> list[str]:
    """The 512-token prompt per cap: moeflash against stock mmap, and against its rooflines."""
    out = [
        "",
        "### Prefill, 512-token prompt",
        "",
        "I/O-bound tok/s = 512 x ceiling / bytes the prompt read; I/O eff. = tok/s / that bound;"
        " roofline eff. = tok/s / the lower of that bound and the same prompt with every expert"
        " cached. TTFT is from the start of the prompt to the first token (load excluded).",
        "",
        "| cap | streaming tok/s | mmap tok/s | speedup | TTFT s (mmap) | I/O-bound tok/s | I/O eff. "
        "| roofline eff. |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for cap in ra.get("per_cap", {}).values():
        out.append(
            f"| {format_size(cap['cap_bytes'], unit='GiB', digits=2)} | "
            f"{_fmt(cap['prefill_512_tok_s'], '.1f')} | {_fmt(cap.get('mmap_prefill_512_tok_s'), '.1f')} | "
            f"{_fmt(cap.get('prefill_512_speedup_vs_mmap'), '.1f', 'x')} | "
            f"{_fmt(cap.get('ttft_512_s'), '.1f')} ({_fmt(cap.get('mmap_ttft_512_s'), '.1f')}) | "
            f"{_fmt(cap.get('prefill_512_io_bound_tok_s'), '.1f')} | "
            f"{_fmt(cap['prefill_512_efficiency'], '.2f')} | "
            f"{_fmt(cap.get('prefill_512_roofline_efficiency'), '.2f')} |"
        )
    return out


def _traced(ra: dict[str, Any]) -> list[str]:
    """Under trace routing, per cap: the prefetch's bounds and the cache against the replay."""
    caps = [c for c in ra.get("per_cap", {}).values() if c.get("trace")]
    if not caps:
        return []
    out = [
        "",
        "### Trace routing: prefetch bounds and the cache against the replay",
        "",
        "Prefetch predicts the next layer's experts. The model's router (the default) predicts the"
        " model's own routing, not the trace's: a lower bound. Reading what the trace routes next"
        " (`--prefetch-from-trace`) is the upper bound; the emulated predictor reads the trace's"
        f" next layer with {EMULATED_PREDICTOR_ERROR:.0%} of each token's experts replaced at random"
        f" (`--prefetch-trace-error {EMULATED_PREDICTOR_ERROR}`), the accuracy measured of"
        " next-layer predictors on real models; prefetch off is the floor. Past routing"
        " (`--prefetch history`) predicts which experts follow the layer's from earlier tokens, as"
        " honest under a trace as on the model's own routing. Hit rate = cached +"
        " prefetched; accuracy = the share of prefetched experts their layer routed. Without"
        " prefetch the hit rate is the cache policy's alone: the replay runs the same routes (the"
        " prompt's batch unions, then each decode token) through the same policy code at the run's"
        " budget, every expert counted at the frame size as the streamer counts it, next to"
        " Belady's optimum there.",
        "",
        "| cap | prefetch | tok/s | hit rate | accuracy | read/token MB | compute / flash wait / cache ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for cap in caps:
        for key, label in (
            ("prefetch_router", "model's router"),
            ("prefetch_history", "past routing"),
            ("prefetch_trace", "trace (oracle)"),
            ("prefetch_emulated", f"emulated predictor (trace, {EMULATED_PREDICTOR_ERROR:.0%} replaced)"),
            ("prefetch_off", "off"),
        ):
            f = cap["trace"].get(key)
            if f is None:
                out.append(
                    f"| {format_size(cap['cap_bytes'], unit='GiB', digits=2)} | {label} | n/a | | | | |"
                )
                continue
            split = " / ".join(
                f"{f['per_token_split_s'][k] * 1e3:.0f}" for k in ("compute_s", "flash_wait_s", "cache_s")
            )
            out.append(
                f"| {format_size(cap['cap_bytes'], unit='GiB', digits=2)} | {label} | {_fmt(f['tok_s'])} | "
                f"{f['cache_hit_rate']:.1%} + {f['prefetch_hit_rate']:.1%} | "
                f"{_fmt(f['prefetch_accuracy'], '.1%')} | "
                f"{_bytes(f['bytes_read'], 'MB', 0)} | {split} |"
            )
    out += [
        "",
        "| cap | hit rate, prefetch off | replay, same policy and budget | off by (points) | Belady "
        "| share of Belady | cache management / token |",
        "|---|---|---|---|---|---|---|",
    ]
    for cap in caps:
        t = cap["trace"]
        off = t.get("prefetch_off") or {}
        out.append(
            f"| {format_size(cap['cap_bytes'], unit='GiB', digits=2)} | "
            f"{_fmt(off.get('cache_hit_rate'), '.1%')} | {_fmt(t.get('replay_cache_hit_rate'), '.1%')} | "
            f"{_fmt(t.get('replay_disagreement_points'), '.2f')} | "
            f"{_fmt(t.get('replay_belady_hit_rate'), '.1%')} | {_fmt(t.get('share_of_belady'), '.2f')} | "
            f"{_fmt(t.get('cache_share'), '.1%')} |"
        )
    return out


def _vs_cached(ra: dict[str, Any]) -> list[str]:
    """Per cap: decode over every expert cached, the two run in the cap's rounds."""
    caps = [c for c in ra.get("per_cap", {}).values() if c.get("cached_tok_s")]
    if not caps:
        return []
    out = [
        "",
        "### Decode over every expert cached",
        "",
        "Every expert cached (`--budget all --preload`, uncapped) ran in each cap's rounds next to"
        " the default, with the flash attention the default's run computed with; the share"
        " is the median of the rounds' ratios. The bound is the most the disk allows: the lower of 1"
        " and ceiling / bytes read per token / cached tok/s.",
        "",
        "| cap | cached tok/s | share of it | rounds | bound | share of the bound |",
        "|---|---|---|---|---|---|",
    ]
    for cap in caps:
        note = "" if cap.get("vs_cached_same_flash_attn") else " (flash attention differs: no share)"
        rounds = ", ".join(_fmt(x, ".2f") for x in cap.get("vs_cached_rounds") or [])
        out.append(
            f"| {format_size(cap['cap_bytes'], unit='GiB', digits=2)} | {_fmt(cap['cached_tok_s'])} | "
            f"{_fmt(cap.get('vs_cached'), '.2f')}{note} | {rounds} | "
            f"{_fmt(cap.get('vs_cached_bound'), '.2f')} | "
            f"{_fmt(_share(cap.get('vs_cached'), cap.get('vs_cached_bound')), '.2f')} |"
        )
    return out


def _share(value: float | None, bound: float | None) -> float | None:
    return value / bound if value is not None and bound else None


def _targets(targets: list[dict[str, Any]]) -> list[str]:
    """The targets table (server/bench/targets.py): value, threshold, met or not."""
    if not targets:
        return []
    out = [
        "",
        "## Targets",
        "",
        "Set for qwen30b-shape on a 2-core machine (server/bench/targets.py). On a smaller model the"
        " fixed overheads weigh more (memory discipline), and a small file's ceiling probe can read"
        " from a virtual disk's host cache.",
        "",
        "A bound is the most the run's own figures allow the value: for a share of the cached speed,"
        " the lower of 1 and the cap's disk ceiling / the bytes read per token / the cached tok/s"
        " (a token cannot be read faster than the disk reads its bytes).",
        "",
        "| target | scope | value | bound | target | met |",
        "|---|---|---|---|---|---|",
    ]
    for t in targets:
        met = {True: "yes", False: "**no**", None: "n/a (no figure)"}[t["met"]]
        out.append(
            f"| {t['name']} | {t['scope']} | {_fmt(t['value'])} | {_fmt(t.get('bound'), '.2f')} | "
            f"{'>=' if t['at_least'] else '<='} {t['threshold']:g} | {met} |"
        )
    return out


def _mb(n: float | None) -> str:
    """A rate in decimal MB/s, as the disk's are written (a rate, not an amount of bytes)."""
    return _fmt(n / 1e6 if n is not None else None, ".0f")


def _bytes(n: float | None, unit: SizeUnit, digits: int) -> str:
    """Bytes as a number of `unit`, in a column whose header names the unit."""
    return "n/a" if n is None else format_size(n, unit=unit, digits=digits, bare=True)


def _hits(d: dict[str, float]) -> str:
    """Routed experts found resident: by the cache's own keeping + by a prefetch."""
    if "hit_rate" not in d:
        return "all resident"  # the streamer stops watching routing once it holds every expert
    return f"{d['cache_hit_rate']:.1%} + {d['prefetch_hit_rate']:.1%}"


def write_reports(result: BenchResult, out: Path, command: str) -> list[Path]:
    """<out>.json, <out>.md and <out>.png; returns their paths."""
    out.parent.mkdir(parents=True, exist_ok=True)
    paths = [out.with_suffix(".json"), out.with_suffix(".md"), out.with_suffix(".png")]
    data: dict[str, Any] = {"command": command, **result.to_json()}
    paths[0].write_text(json.dumps(data, indent=1) + "\n")
    paths[1].write_text(markdown(result, command))
    chart(result, paths[2])
    return paths
