"""PNG plots of a run (matplotlib, Agg backend): latency percentiles vs offered load per mode,
latency CDF per mode at one load, producer commits/s per trigger variant."""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt

from bench.hist import Histogram

__all__ = ["bar_figure", "make_plots", "mode_colors", "plt", "save_bar_chart"]

_STYLES = {"p50": "-", "p99": "--", "p99.9": ":"}


def bar_figure(width: float, height: float = 4.5) -> tuple[Any, Any]:
    """A new figure with one axes, for a bar chart finished by ``save_bar_chart``."""
    return plt.subplots(figsize=(width, height))


def save_bar_chart(fig: Any, ax: Any, path: Path) -> bool:
    """Finish a bar chart the bench's way (legend, horizontal grid), write it, close it."""
    ax.legend(fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def mode_colors(modes: list[str]) -> dict[str, Any]:
    cmap = plt.get_cmap("tab10")
    return {m: cmap(i % 10) for i, m in enumerate(modes)}


def _ok(v: Any) -> bool:
    return v is not None and not (isinstance(v, float) and math.isnan(v)) and v > 0


def _latency_vs_load(summary: dict[str, Any], modes: list[str], path: Path) -> None:
    colors = mode_colors(modes)
    fig, axes = plt.subplots(1, 2, figsize=(15, 5.4), sharey=True)
    for ax, metric, title in (
        (axes[0], "e2e", "scheduled send -> consumer receive"),
        (axes[1], "ack_to_recv", "commit ack -> consumer receive"),
    ):
        for mode in modes:
            rows = [
                r
                for r in summary["latency"]
                if r["mode"] == mode and r["arrival"] == "constant" and r["producer"] == "sql"
            ]
            rows.sort(key=lambda r: r["load"])
            if not rows:
                continue
            for pct, style in _STYLES.items():
                pts = [(r["load"], r[metric][pct]) for r in rows if _ok(r[metric][pct])]
                if not pts:
                    continue
                ax.plot(
                    [p[0] for p in pts],
                    [p[1] for p in pts],
                    style,
                    marker="o",
                    markersize=3,
                    color=colors[mode],
                    label=f"{mode} {pct}",
                )
            bad = [r for r in rows if not r["keeps_up"] and _ok(r[metric]["p99"])]
            ax.scatter(
                [r["load"] for r in bad],
                [r[metric]["p99"] for r in bad],
                marker="x",
                s=60,
                color=colors[mode],
            )
        ax.axhline(100, color="grey", linewidth=0.8, alpha=0.6)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("offered load (events/s)")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("latency (ms), median of repetitions")
    handles, labels = axes[1].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, fontsize=8, loc="center right")
    fig.suptitle("Latency percentiles vs offered load (x: not keeping up; grey: 100 ms)")
    fig.tight_layout(rect=(0, 0, 0.84, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _cdf(
    result: dict[str, Any], summary: dict[str, Any], modes: list[str], load: float, path: Path
) -> bool:
    pooled: dict[str, Histogram] = defaultdict(Histogram)
    final = set(summary["final_cells"])
    for c in result["latency_cells"]:
        main = c["arrival"] == "constant" and c["producer"] == "sql"
        if main and c["cell"] in final and c["load"] == load:
            pooled[c["mode"]].merge(Histogram.from_json(c["hist"]["ack_to_recv"]))
    if not pooled:
        return False
    colors = mode_colors(modes)
    fig, ax = plt.subplots(figsize=(8, 5))
    left = math.inf
    for mode in modes:
        h = pooled.get(mode)
        if h is None or h.count == 0:
            continue
        xs, ys = h.cdf()
        ax.step([max(x, 0.01) for x in xs], ys, where="post", color=colors[mode], label=mode)
        left = min(left, h.value_at(0.1) / 1000.0)
    ax.set_xscale("log")
    if math.isfinite(left):
        ax.set_xlim(left=max(0.05, left * 0.7))
    ax.set_xlabel("commit ack -> consumer receive (ms)")
    ax.set_ylabel("fraction of events")
    ax.set_title(f"Latency CDF at {load:g} events/s (all repetitions pooled)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _producer(summary: dict[str, Any], path: Path) -> bool:
    rows = summary["producer"]
    if not rows:
        return False
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    writers = sorted({r["writers"] for r in rows})
    by = {(r["variant"], r["writers"]): r["commits_per_s"] for r in rows}
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / max(1, len(variants))
    for i, v in enumerate(variants):
        xs = [j + i * width for j in range(len(writers))]
        ax.bar(xs, [by.get((v, w), 0) for w in writers], width, label=v)
    ax.set_xticks([j + width * (len(variants) - 1) / 2 for j in range(len(writers))])
    ax.set_xticklabels([f"{w} writer(s)" for w in writers])
    ax.set_ylabel("commits/s (median)")
    ax.set_title("Producer commit throughput by trigger variant")
    return save_bar_chart(fig, ax, path)


def make_plots(
    result: dict[str, Any], summary: dict[str, Any], out_dir: Path, stem: str
) -> list[Path]:
    """Write the PNGs next to the JSON; returns their paths."""
    modes = list(result["config"]["modes"])
    out: list[Path] = []
    p = out_dir / f"{stem}-latency-vs-load.png"
    _latency_vs_load(summary, modes, p)
    out.append(p)
    loads = {c["load"] for c in result["latency_cells"]}
    cdf_load = 1000.0 if 1000.0 in loads else min(loads, default=None)
    if cdf_load is not None:
        p = out_dir / f"{stem}-cdf-{cdf_load:g}.png"
        if _cdf(result, summary, modes, cdf_load, p):
            out.append(p)
    p = out_dir / f"{stem}-producer.png"
    if _producer(summary, p):
        out.append(p)
    return out
