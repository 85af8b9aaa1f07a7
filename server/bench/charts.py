"""The benchmark's chart (<report>.png): one panel per question, each bar labelled with its value.

- How fast does each system decode, at each cap? Systems grouped by cap.
- Where does a decoded token's time go? One stacked bar (compute / flash wait / cache) per
  system and cap.
- What does each lever cost or gain, alone, at each cap? Decode tok/s over the default's.
- How fast is a long prompt read? Prefill tok/s by cap.

A system measured in several rounds is drawn once, by its median round (ratios.system_run), as
the report's ratios read it. Panels without data (no levers, no prefill runs) are left out.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from server.bench.ratios import decode_figures, system_run
from server.units import format_size

if TYPE_CHECKING:
    from server.bench.results import BenchResult, Run

# (system, its label) per panel, in drawing order; a system absent from the run is skipped
DECODE = (
    ("resident", "stock, in RAM"),
    ("streaming-all-cached", "moeflash, all cached"),
    ("mmap-capped", "stock mmap"),
    ("streaming", "moeflash"),
    # uncapped, in the cap's rounds with the default's flash attention: what the cap's decode
    # is a share of
    ("streaming-all-cached-paired", "moeflash, all cached (the cap's rounds)"),
)
PREFILL = (
    ("resident-prefill-512", "stock, in RAM"),
    ("streaming-all-cached-prefill-512", "moeflash, all cached"),
    ("mmap-capped-prefill-512", "stock mmap"),
    ("streaming-prefill-512", "moeflash"),
)
SPLIT = (
    ("compute_s", "compute", "#4caf50"),
    ("flash_wait_s", "flash wait", "#f44336"),
    ("cache_s", "cache", "#ff9800"),
)
COLORS = ("#9e9e9e", "#90caf9", "#bdbdbd", "#1e88e5", "#64b5f6")


def _cap_label(result: BenchResult, cap: int | None) -> str:
    if cap is None:
        return "no cap"
    size = float(result.model.get("file_bytes") or 0)
    share = f"{cap / size:.0%} " if size else ""
    return f"{share}cap\n{format_size(cap, unit='GiB', digits=2)}"


def _caps(result: BenchResult) -> list[int | None]:
    capped = sorted({r.cap_bytes for r in result.runs if r.cap_bytes is not None})
    return [None, *capped]


def _tok_s(run: Run | None) -> float | None:
    d = decode_figures(run) if run is not None else None
    return d["tok_s_median"] if d else None


def _prefill_tok_s(run: Run | None) -> float | None:
    if run is None or not run.ok or not run.report.get("prompt_s"):
        return None
    return float(run.report["prompt_tokens"]) / float(run.report["prompt_s"])


def _label_bars(ax: Any, bars: Any, values: list[float | None], spec: str) -> None:
    for bar, value in zip(bars, values, strict=True):
        if value is not None:
            ax.annotate(
                format(value, spec),
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                ha="center",
                va="bottom",
                fontsize=7,
                xytext=(0, 2),
                textcoords="offset points",
            )


def _grouped(
    ax: Any, result: BenchResult, systems: tuple[tuple[str, str], ...], value: Any, ylabel: str, log: bool
) -> bool:
    """Bars of `value(run)` per system, grouped by cap (each group centred on the systems measured
    there, one colour per system); False when nothing was measured."""
    caps = _caps(result)
    width = 0.8 / len(systems)
    labelled: set[str] = set()
    top = 0.0
    for c, cap in enumerate(caps):
        present = [
            (i, label, v)
            for i, (name, label) in enumerate(systems)
            if (v := value(system_run(result, name, cap))) is not None
        ]
        for j, (i, label, v) in enumerate(present):
            x = c + (j - (len(present) - 1) / 2) * width
            bars = ax.bar(
                [x], [v], width, color=COLORS[i % len(COLORS)], label=None if label in labelled else label
            )
            labelled.add(label)
            _label_bars(ax, bars, [v], ".2f")
            top = max(top, v)
    if not labelled:
        return False
    ax.set_xticks(range(len(caps)), [_cap_label(result, c) for c in caps], fontsize=8)
    ax.set_ylabel(ylabel)
    if log:
        ax.set_yscale("log")
        ax.set_ylim(top=top * 8)  # room above the bars for their labels and the legend
    else:
        ax.set_ylim(top=top * 1.3)
    ax.legend(fontsize=7, loc="upper right", ncols=2)
    return True


def _split(ax: Any, result: BenchResult) -> None:
    """One stacked bar of a decoded token's time per streaming system and cap."""
    bars: list[tuple[str, dict[str, float]]] = []
    for cap in _caps(result):
        for name in ("streaming-all-cached", "streaming-all-cached-paired", "streaming", *_levers(result)):
            run = system_run(result, name, cap)
            d = decode_figures(run) if run is not None else None
            if d is not None and run is not None and run.report.get("mode") == "streaming":
                cap_text = "no cap" if cap is None else format_size(cap, unit="GiB", digits=2)
                bars.append((f"{name}\n{cap_text}", d))
    bottom = [0.0] * len(bars)
    for key, label, color in SPLIT:
        values = [d[key] * 1e3 for _, d in bars]
        ax.bar(range(len(bars)), values, bottom=bottom, color=color, label=label)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    for x, total in enumerate(bottom):
        ax.annotate(
            f"{total:.0f}",
            (x, total),
            ha="center",
            va="bottom",
            fontsize=7,
            xytext=(0, 2),
            textcoords="offset points",
        )
    ax.set_xticks(range(len(bars)), [label for label, _ in bars], rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("ms per decoded token")
    ax.margins(y=0.12)
    ax.legend(fontsize=7)


def _levers(result: BenchResult) -> list[str]:
    return sorted({r.system for r in result.runs if r.system.startswith("lever-")})


def _lever_gains(ax: Any, result: BenchResult) -> bool:
    """Decode tok/s of each lever alone over the default's, at each cap (1.0: no change)."""
    levers, caps = _levers(result), [c for c in _caps(result) if c is not None]
    if not levers or not caps:
        return False
    height = 0.8 / len(caps)
    for i, cap in enumerate(caps):
        base = _tok_s(system_run(result, "streaming", cap))
        values = [
            (tok_s / base) if base and (tok_s := _tok_s(system_run(result, lever, cap))) else None
            for lever in levers
        ]
        ys = [y + (i - (len(caps) - 1) / 2) * height for y in range(len(levers))]
        bars = ax.barh(
            ys, [v or 0.0 for v in values], height, label=_cap_label(result, cap).replace("\n", " ")
        )
        for bar, v in zip(bars, values, strict=True):
            if v is not None:
                ax.annotate(
                    f"{v:.2f}x",
                    (bar.get_width(), bar.get_y() + bar.get_height() / 2),
                    va="center",
                    fontsize=7,
                    xytext=(2, 0),
                    textcoords="offset points",
                )
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_yticks(range(len(levers)), [lever.removeprefix("lever-") for lever in levers], fontsize=8)
    ax.set_xlabel("decode tok/s over moeflash's default at the same cap (1.0: no change)")
    ax.margins(x=0.15)
    ax.legend(fontsize=7)
    return True


def chart(result: BenchResult, path: Path) -> None:
    """Write the report's PNG: the panels above that have data."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(14, 10))
    (speed, split), (levers, prefill) = axes
    _grouped(speed, result, DECODE, _tok_s, "decode tok/s (median token; log scale)", log=True)
    speed.set_title("Decode speed by memory cap")
    _split(split, result)
    split.set_title("Where a decoded token's time goes (ms)")
    if _lever_gains(levers, result):
        levers.set_title("Each lever alone, against the default")
    else:
        levers.set_axis_off()
    if _grouped(prefill, result, PREFILL, _prefill_tok_s, "prompt tok/s", log=False):
        prefill.set_title("Prefill speed (512-token prompt) by memory cap")
    else:
        prefill.set_axis_off()
    fig.suptitle(f"moeflash bench: {result.model['name']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
