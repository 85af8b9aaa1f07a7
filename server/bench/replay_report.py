"""`moeflash bench replay`: cache-policy curves on real routing traces, with the checks.

For each trace: hit rates of the streamer's policies (LAYER, the default, and LRU; the C code
itself) next to LFU, random and Belady's optimum at budgets from 250 MiB to 8 GiB; the published
curves beside the trace (<name>-curve.csv) are reproduced as a check (LRU's and Belady's decode
hit rates must match); and the default policy's targets: never below LRU, no 0% cliff, and its
share of Belady's hit rate. The same policies also replay the trace as a run serves it (the
prompt in micro-batches), where the default must never read more bytes than LRU. Across shapes,
every trace replays at budgets of some token working sets, where a trace the policy was not tuned
on (a holdout) must see the default keep its share of the `rates` reference.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from server.bench.derived import derivations
from server.bench.replay import (
    BUDGETS_MIB,
    PREDICTORS,
    SERVED_N_BATCH,
    PrefetchResult,
    ReplayResult,
    WorkingSetResult,
    replay_all,
    replay_prefetch,
    replay_served,
    replay_working_sets,
    token_working_set,
)
from server.bench.systems import EMULATED_PREDICTOR_ERROR
from server.bench.targets import POLICY_TUNED_ON, REPLAY_SHARE_OF_BELADY
from server.errors import ConfigError
from server.loading.route_trace import Trace, load_trace
from streaming_ext import RateClass

# published hit rates beside a trace: (budget MiB, policy) -> column -> value
Curves = dict[tuple[int, str], dict[str, float]]


def _published(trace_path: Path) -> Curves:
    """The published curves beside a trace (<name>-curve.csv), {} when there are none."""
    curve = trace_path.with_name(trace_path.name.split(".")[0] + "-curve.csv")
    if not curve.exists():
        return {}
    try:
        with curve.open() as fh:
            return {
                (int(r["budget_mib"]), r["policy"]): {k: float(v) for k, v in r.items() if k != "policy"}
                for r in csv.DictReader(fh)
            }
    except (OSError, UnicodeDecodeError, KeyError, TypeError, ValueError) as exc:
        raise ConfigError(
            f"{curve}: not a published curve (budget_mib,policy,hit_pct_cum,hit_pct_decode,...): {exc!r}"
        ) from exc


# how close a reference policy's decode hit rate must come to the published one (points)
_REPRODUCED_WITHIN = 0.5


def summarize(results: list[ReplayResult], published: Curves) -> dict[str, Any]:
    """The checks: default vs LRU and Belady per budget; published LRU and Belady reproduced."""
    by = {(r.budget_mib, r.policy): r for r in results}
    budgets = sorted({r.budget_mib for r in results})
    rows = []
    for b in budgets:
        layer, lru, belady = by[(b, "layer")], by[(b, "lru")], by[(b, "belady")]
        row: dict[str, Any] = {
            "budget_mib": b,
            "default_decode": layer.hit_pct_decode,
            "lru_decode": lru.hit_pct_decode,
            "belady_decode": belady.hit_pct_decode,
            "default_over_belady": (
                layer.hit_pct_decode / belady.hit_pct_decode if belady.hit_pct_decode else None
            ),
            "default_minus_lru": layer.hit_pct_decode - lru.hit_pct_decode,
        }
        for ours in (lru, belady):
            pub = published.get((b, ours.policy))
            row[f"published_{ours.policy}_decode"] = pub["hit_pct_decode"] if pub else None
            row[f"{ours.policy}_reproduced"] = (
                abs(pub["hit_pct_decode"] - ours.hit_pct_decode) < _REPRODUCED_WITHIN if pub else None
            )
        rows.append(row)
    layer_rows = [by[(b, "layer")] for b in budgets]
    lru_rows = [by[(b, "lru")] for b in budgets]
    return {
        "never_below_lru": all(
            a.hit_pct_decode >= b.hit_pct_decode - 1e-9 for a, b in zip(layer_rows, lru_rows, strict=True)
        ),
        "no_zero_cliff": all(r.hit_pct_decode > 0 for r in layer_rows),
        "share_of_belady_at_2000": next(
            (r["default_over_belady"] for r in rows if r["budget_mib"] == 2000), None
        ),
        "published_lru_reproduced": all(r["lru_reproduced"] is not False for r in rows),
        "published_belady_reproduced": all(r["belady_reproduced"] is not False for r in rows),
        "rows": rows,
    }


def _markdown(name: str, results: list[ReplayResult], summary: dict[str, Any], command: str) -> str:
    policies = ["layer", "lru", "lfu", "random", "belady"]
    by = {(r.budget_mib, r.policy): r for r in results}
    lines = [
        f"## {name}",
        "",
        "Decode hit rate % (cumulative incl. prompt in brackets); `layer` is the streamer's default policy.",
        "Every policy holds what fits the byte budget (experts of different layers differ in size).",
        "",
        "| budget MiB | " + " | ".join(policies) + " | layer / belady | published lru | published belady |",
        "|---" * (len(policies) + 4) + "|",
    ]
    for row in summary["rows"]:
        b = row["budget_mib"]
        cells = [f"{by[(b, p)].hit_pct_decode:.1f} ({by[(b, p)].hit_pct_cum:.1f})" for p in policies]
        pub = [row["published_lru_decode"], row["published_belady_decode"]]
        lines.append(
            f"| {b} | "
            + " | ".join(cells)
            + f" | {row['default_over_belady']:.2f} | "
            + " | ".join("n/a" if p is None else f"{p:.1f}" for p in pub)
            + " |"
        )
    lines += [
        "",
        f"- default never below LRU: {summary['never_below_lru']}; no 0% cliff: {summary['no_zero_cliff']}; "
        f"share of Belady at 2000 MiB: {summary['share_of_belady_at_2000']:.2f} "
        f"(target {REPLAY_SHARE_OF_BELADY:.2f} on Qwen's trace); "
        f"published decode curves reproduced (within {_REPRODUCED_WITHIN} points): "
        f"LRU {summary['published_lru_reproduced']}, Belady {summary['published_belady_reproduced']}",
        "",
    ]
    return "\n".join(lines)


def summarize_served(results: list[ReplayResult]) -> dict[str, Any]:
    """The trace as served: the default policy against LRU in bytes read over prompt and decode,
    and its share of Belady's decode hit rate, per budget."""
    by = {(r.budget_mib, r.policy): r for r in results}
    rows: list[dict[str, Any]] = [
        {
            "budget_mib": b,
            "default_decode": by[(b, "layer")].hit_pct_decode,
            "lru_decode": by[(b, "lru")].hit_pct_decode,
            "belady_decode": by[(b, "belady")].hit_pct_decode,
            "default_read_mib": by[(b, "layer")].read_mib,
            "lru_read_mib": by[(b, "lru")].read_mib,
            "belady_read_mib": by[(b, "belady")].read_mib,
        }
        for b in sorted({r.budget_mib for r in results})
    ]
    for row in rows:
        row["default_over_belady"] = (
            row["default_decode"] / row["belady_decode"] if row["belady_decode"] else None
        )
    return {
        "n_batch": SERVED_N_BATCH,
        "never_reads_more_than_lru": all(r["default_read_mib"] <= r["lru_read_mib"] for r in rows),
        "share_of_belady_at_2000": next(
            (r["default_over_belady"] for r in rows if r["budget_mib"] == 2000), None
        ),
        "rows": rows,
    }


def _served_markdown(summary: dict[str, Any]) -> list[str]:
    lines = [
        f"As served: the prompt in micro-batches of {summary['n_batch']} tokens, each layer of a batch"
        " routing the union of its tokens' experts (the last layer only the last token's), then every"
        " decode step, as the cache of a run sees them; the default policy learns from each token's own"
        " routing. Budgets from one layer's experts (the streamer's floor) up.",
        "",
        "| budget MiB | decode hits layer / lru / belady | layer / belady | MiB read layer / lru / belady |",
        "|---|---|---|---|",
    ]
    for r in summary["rows"]:
        ratio = "n/a" if r["default_over_belady"] is None else f"{r['default_over_belady']:.2f}"
        hits = " / ".join(f"{r[f'{p}_decode']:.1f}" for p in ("default", "lru", "belady"))
        read = " / ".join(f"{r[f'{p}_read_mib']:.0f}" for p in ("default", "lru", "belady"))
        lines.append(f"| {r['budget_mib']} | {hits} | {ratio} | {read} |")
    lines += [
        "",
        f"- as served, the default never reads more than LRU: {summary['never_reads_more_than_lru']}",
        "",
    ]
    return lines


# budgets of the derived traces' table: where the default policy hits 30-90% of their routes
DERIVED_BUDGETS_MIB = (1000, 2000, 3000)


def replay_derived(trace: Trace) -> list[dict[str, Any]]:
    """The default policy against LRU and Belady on each trace derived from this one
    (server/bench/derived.py), as served, at DERIVED_BUDGETS_MIB."""
    rows = []
    for derived in derivations(trace):
        summary = summarize_served(replay_served(derived, DERIVED_BUDGETS_MIB))
        rows.append(
            {
                "trace": derived.name,
                "k": derived.k,
                "prompt_tokens": len(derived.steps(decode=False)),
                "decode_tokens": len(derived.steps(decode=True)),
                **summary,
            }
        )
    return rows


def _derived_markdown(rows: list[dict[str, Any]]) -> list[str]:
    budgets = " | ".join(f"{b} MiB" for b in DERIVED_BUDGETS_MIB)
    lines = [
        "Derived traces (not real routing: this trace with one property changed, server/bench/derived.py),"
        " as served. Per budget: the default's share of Belady's decode hit rate, and its bytes read over"
        " prompt and decode as a share of LRU's.",
        "",
        f"| derived trace | k | prompt / decode tokens | {budgets} |",
        "|---|---|---|" + "---|" * len(DERIVED_BUDGETS_MIB),
    ]
    for d in rows:
        by = {r["budget_mib"]: r for r in d["rows"]}
        cells = []
        for b in DERIVED_BUDGETS_MIB:
            r = by.get(b)
            if r is None:
                cells.append("below the floor")
            else:
                ratio = "n/a" if r["default_over_belady"] is None else f"{r['default_over_belady']:.2f}"
                cells.append(
                    f"{ratio} of Belady, {r['default_read_mib'] / r['lru_read_mib']:.2f} of LRU's bytes"
                )
        lines.append(
            f"| {d['trace']} | {d['k']} | {d['prompt_tokens']} / {d['decode_tokens']} | "
            + " | ".join(cells)
            + " |"
        )
    never = all(d["never_reads_more_than_lru"] for d in rows)
    return [*lines, "", f"- on every derived trace the default never reads more than LRU: {never}", ""]


# budgets of the prefetch table: where the default policy hits 45-80% on both traces
PREFETCH_BUDGETS_MIB = (1000, 2000, 3000)


def _prefetch_markdown(results: list[PrefetchResult]) -> list[str]:
    lines = [
        "Prefetch by predictor (decode tokens; the prompt warms the cache and the predictors): each"
        " layer's successor predicted as the layer routes and admitted by the streamer's own"
        " prefetch code (mf_cache_prefetch), as in a run. `previous token` and `co-occurrence` use"
        " past routing only (`co-occurrence` is `--prefetch history`); `emulated` is the trace's"
        f" next layer with {EMULATED_PREDICTOR_ERROR:.0%} of its experts replaced (`make bench`'s"
        " emulated predictor); `trace` knows the next layer (the upper bound). Slots: routed experts"
        " the predictor named; useful: prefetched experts then routed; read: demand misses plus"
        " prefetches per token.",
        "",
        "| budget MiB | predictor | decode hit rate | slots named | useful | read MiB/token |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r.budget_mib} | {r.predictor} | {r.hit_pct_decode:.1f}% | {r.slot_pct:.1f}% | "
            f"{r.useful_pct:.1f}% | {r.read_mib_per_token:.1f} |"
        )
    classes = " | ".join(c.text for c in RateClass)
    lines += [
        "",
        "The emulated predictor's read-aheads by their expert's recent rate in its layer (routes per"
        " visit, decayed with the cache policy's half-life of 16 visits) over a uniform router's"
        " k / n_expert, known before a guess is read: the classes the prefetch gate judges guesses by"
        " (enum mf_rate_class, read from the cache policy). Per class, the share of the entries read"
        " and, in brackets, the share of them their layer then routed.",
        "",
        f"| budget MiB | {classes} |",
        "|---|" + "---|" * len(RateClass),
    ]
    for r in results:
        if r.predictor != "emulated":
            continue
        read = sum(n for n, _ in r.by_rate)
        cells = [
            f"{100.0 * n / read:.0f}% ({100.0 * right / n:.0f}% routed)" if n else "-"
            for n, right in r.by_rate
        ]
        lines.append(f"| {r.budget_mib} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def summarize_working_sets(by_trace: dict[str, list[WorkingSetResult]]) -> dict[str, Any]:
    """Per trace and budget in token working sets, the default's shares of Belady and of the
    `rates` reference; on each holdout (a trace not in POLICY_TUNED_ON), whether the default keeps
    at every budget the lowest share of `rates` it reaches on the tuned traces replayed with it."""
    rows = {
        name: [
            {
                **asdict(r),
                "default_over_belady": r.default / r.belady if r.belady else None,
                "default_over_rates": r.default / r.rates if r.rates else None,
            }
            for r in results
        ]
        for name, results in by_trace.items()
    }
    floor: dict[float, float] = {}
    for name in POLICY_TUNED_ON:
        for r in rows.get(name, []):
            if r["default_over_rates"] is not None:
                ws = r["working_sets"]
                floor[ws] = min(floor.get(ws, r["default_over_rates"]), r["default_over_rates"])
    holdouts: dict[str, bool | None] = {}
    for name, trace_rows in rows.items():
        if name in POLICY_TUNED_ON:
            continue
        verdicts = [
            r["default_over_rates"] >= floor[r["working_sets"]] - 1e-9
            for r in trace_rows
            if r["working_sets"] in floor and r["default_over_rates"] is not None
        ]
        holdouts[name] = all(verdicts) if verdicts else None
    return {
        "tuned_on": list(POLICY_TUNED_ON),
        "tuned_floor_over_rates": {str(k): v for k, v in sorted(floor.items())},
        "holdout_keeps_share_of_rates": holdouts,
        "never_below_lru": all(r["default"] >= r["lru"] - 1e-9 for t in rows.values() for r in t),
        "rows": rows,
    }


def _working_sets_markdown(summary: dict[str, Any], shapes: dict[str, str]) -> list[str]:
    lines = [
        "## Across shapes: budgets in token working sets",
        "",
        "Every trace as served, at budgets of some token working sets (one token's routed experts over"
        " every layer: the scale on which models of different shapes compare; budgets that hold every"
        " expert are left out). Decode hit rate %; `rates` knows every entry's decode rate over the"
        " whole trace in advance, not the order (what frequencies alone buy, known rather than learned);"
        f" the default was tuned on {' and '.join(summary['tuned_on'])}, every other trace is a holdout.",
        "",
        "| trace | shape | working sets | MiB | default / lru / rates / belady"
        " | default / rates | default / belady |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, trace_rows in summary["rows"].items():
        for r in trace_rows:
            hits = " / ".join(f"{r[p]:.1f}" for p in ("default", "lru", "rates", "belady"))
            over = [r["default_over_rates"], r["default_over_belady"]]
            lines.append(
                f"| {name} | {shapes[name]} | {r['working_sets']:g} | {r['budget_mib']:.1f} | {hits} | "
                + " | ".join("n/a" if v is None else f"{v:.2f}" for v in over)
                + " |"
            )
    lines += ["", f"- the default never below LRU: {summary['never_below_lru']}"]
    for name, kept in summary["holdout_keeps_share_of_rates"].items():
        verdict = "n/a (no tuned trace replayed beside it)" if kept is None else str(kept)
        lines.append(
            f"- holdout {name}: the default keeps, at every budget, the lowest share of `rates` it"
            f" reaches on {' and '.join(summary['tuned_on'])}: {verdict}"
        )
    return [*lines, ""]


def _chart(by_trace: dict[str, list[WorkingSetResult]], path: Path) -> None:
    """One panel per trace: decode hit rate by budget in token working sets, per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = {name: results for name, results in by_trace.items() if results}
    if not shown:  # every budget held a trace's every expert or not its largest route
        fig, ax = plt.subplots(figsize=(6, 2))
        ax.text(0.5, 0.5, "no budget in token working sets to replay", ha="center", va="center")
        ax.set_axis_off()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return
    fig, axes = plt.subplots(1, len(shown), figsize=(5.5 * len(shown), 4.5), squeeze=False, sharey=True)
    for ax, (name, results) in zip(axes[0], shown.items(), strict=True):
        ws = [r.working_sets for r in results]
        for field, label, style in (
            ("default", "default (layer)", "-o"),
            ("lru", "lru", "-s"),
            ("rates", "rates known", "--"),
            ("belady", "belady", "-^"),
        ):
            ax.plot(ws, [getattr(r, field) for r in results], style, label=label)
        holdout = "" if name in POLICY_TUNED_ON else " (holdout)"
        ax.set_title(f"{name}{holdout}")
        ax.set_xlabel("budget (token working sets)")
        ax.set_ylim(0, 100)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
    axes[0][0].set_ylabel("decode hit rate (%)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_replay(traces: list[Path], out: Path | None, command: str, progress: Callable[[str], None]) -> int:
    """Replay every trace; write <out>.json/.md/.png (default bench/reports/trace-replay)."""
    out = out or Path("bench/reports/trace-replay")
    # every trace (and published curve beside it) is read and checked before anything is
    # replayed or written
    loaded: dict[str, tuple[Path, Trace, Curves]] = {}
    for path in traces:
        trace = load_trace(path)
        if trace.name in loaded:
            raise ConfigError(f"two traces are named {trace.name!r}: {loaded[trace.name][0]} and {path}")
        loaded[trace.name] = (path, trace, _published(path))
    out.parent.mkdir(parents=True, exist_ok=True)
    by_ws: dict[str, list[WorkingSetResult]] = {}
    shapes: dict[str, str] = {}
    data: dict[str, Any] = {"command": command, "budgets_mib": list(BUDGETS_MIB), "traces": {}}
    md = [f"# Trace replay\n\nProduced by `{command}`.\n"]
    for path, trace, published in loaded.values():
        progress(f"replaying {path}")
        by_ws[trace.name] = replay_working_sets(trace)
        shapes[trace.name] = f"{trace.n_layer} x {trace.n_expert} ({trace.k})"
        entry: dict[str, Any] = {
            "path": str(path),
            "n_layer": trace.n_layer,
            "n_expert": trace.n_expert,
            "k": trace.k,
            "token_working_set_mib": token_working_set(trace) / 2**20,
            "routes": len(trace.routes),
        }
        data["traces"][trace.name] = entry
        if trace.n_expert * sum(trace.entry_bytes) <= min(BUDGETS_MIB) * 2**20:
            # a small model: every expert fits the smallest MiB budget, so only the working sets say anything
            md.append(f"## {trace.name}\n\nEvery expert fits {min(BUDGETS_MIB)} MiB: see Across shapes.\n")
            continue
        results = replay_all(trace)
        summary = summarize(results, published)
        as_served = summarize_served(replay_served(trace))
        derived = replay_derived(trace)
        prefetch = [replay_prefetch(trace, b, p) for b in PREFETCH_BUDGETS_MIB for p in PREDICTORS]
        entry.update(
            results=[asdict(r) for r in results],
            prefetch=[asdict(r) for r in prefetch],
            summary=summary,
            served=as_served,
            derived=derived,
        )
        md.append(_markdown(trace.name, results, summary, command))
        md += _served_markdown(as_served)
        md += _derived_markdown(derived)
        md += _prefetch_markdown(prefetch)
    data["working_sets"] = summarize_working_sets(by_ws)
    md += _working_sets_markdown(data["working_sets"], shapes)
    out.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
    out.with_suffix(".md").write_text("\n".join(md))
    _chart(by_ws, out.with_suffix(".png"))
    for suffix in (".json", ".md", ".png"):
        print(out.with_suffix(suffix))
    return 0
