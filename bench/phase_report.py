"""Markdown tables and PNG plots of the backlog-drain and outage-recovery results
(``python -m bench report drain-<ts>.json`` regenerates them)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.drain import drain_problems, summarize_drain
from bench.recovery import recovery_problems, summarize_recovery
from bench.report import _f, _table, environment_lines

__all__ = ["write_phase_report"]


def _rate(v: float | None) -> str:
    return "-" if v is None else f"{v:,.0f}"


def _drain_markdown(result: dict[str, Any], summary: dict[str, Any], plots: list[str]) -> str:
    cfg = result["config"]
    lines = [f"# notify-outbox backlog drain {result['run_id']}", ""]
    lines += environment_lines(result)
    env_bits = ", ".join(f"{k}={v}" for k, v in cfg.get("relay_env", {}).items())
    lines += [
        f"- {cfg['rows']:,} committed rows per cell (~200-byte JSON payloads), inserted with "
        "the mode stopped, then `VACUUM ANALYZE`; a fresh database and a 3-partition topic per "
        f"cell; {cfg['repeat']} round(s), modes interleaved per round, medians over rounds"
        + (f"; relay settings: {env_bits}" if env_bits else ""),
        "",
        "Events/s from the consumer's first arrival to its last (the drain rate), from the "
        "mode's start, and seconds from the start to the first arrival.",
        "",
        "## Drain rate (events/s, first -> last arrival, median)",
        "",
    ]
    modes = list(cfg["modes"])
    by = {(r["mix"], r["mode"]): r for r in summary["rows"]}
    lines += _table(
        ["key mix", *modes],
        [
            [
                mix,
                *(_rate(by[(mix, m)]["rate_first_last"]) if (mix, m) in by else "-" for m in modes),
            ]
            for mix in cfg["mixes"]
        ],
    )
    if summary["targets"]:
        lines += ["", "## Targets (issue 10; ratios within this run)", ""]
        lines += _table(
            ["target", "ratio", "verdict"],
            [[t["target"], f"{t['ratio']:.2f}x", t["verdict"]] for t in summary["targets"]],
        )
    lines += ["", "## Every mix and mode", ""]
    lines += _table(
        [
            "mix",
            "mode",
            "rounds complete",
            "ev/s first->last",
            "ev/s from start",
            "first arrival after start (s)",
            "lost",
            "duplicates",
            "order violations",
            "pending after",
            "mode CPU µs/event",
            "per round (ev/s)",
        ],
        [
            [
                r["mix"],
                r["mode"],
                f"{r['complete']}/{r['rounds']}",
                _rate(r["rate_first_last"]),
                _rate(r["rate_from_start"]),
                _f(r["first_after_start_s"]),
                str(r["lost"]),
                str(r["duplicates"]),
                str(r["order_violations"]),
                str(r["pending_after"]),
                _f(r["mode_cpu_us_per_event"], 0),
                " ".join(_rate(v) for v in r["rates"]),
            ]
            for r in summary["rows"]
        ],
    )
    lines += ["", "## Key mixes and modes", ""]
    lines += [f"- `{m}`: {d}" for m, d in result.get("mixes", {}).items()]
    lines += [f"- `{n}`: {m['description']}" for n, m in result.get("modes", {}).items()]
    return _finish(lines, result, plots, drain_problems(result))


def _recovery_markdown(result: dict[str, Any], summary: dict[str, Any], plots: list[str]) -> str:
    cfg = result["config"]
    lines = [f"# notify-outbox outage recovery {result['run_id']}", ""]
    lines += environment_lines(result)
    ev = result.get("events", {})
    lines += [
        "- one relay process (default settings"
        + (
            ", " + ", ".join(f"{k}={v}" for k, v in cfg["relay_env"].items())
            if cfg["relay_env"]
            else ""
        )
        + f"), writers at {cfg['rate']:g} ev/s over {cfg['keys']} keys the whole run; "
        f"{cfg['repeat']} restart(s) per service, {cfg['pause']:g} s between stop and start, "
        f"{cfg['settle']:g} s of steady traffic between restarts",
        f"- events: {ev.get('acked', '-')} committed, {ev.get('received', '-')} received, "
        f"**{ev.get('missing', '-')} missing**; relay exit code {result.get('relay_exit')}, "
        f"{result.get('relay_log_lines', '-')} log lines in all",
        "",
        "**Recovery** is the time from the service accepting connections again (Kafka: its "
        "port takes a TCP connection; PostgreSQL: a login and `SELECT 1` work) to the consumer "
        "receiving the first event committed after the outage began (Kafka: INSERT begun after "
        "the SIGTERM; PostgreSQL: after it accepted connections again). Max latency is commit "
        "ack -> receive over the events committed from 1 s before the stop to 1 s before the "
        "next one. Log lines are the relay's, from the stop to that first delivery.",
        "",
        "## Per service (medians over restarts)",
        "",
    ]
    lines += _table(
        [
            "service",
            "restarts",
            "accepting connections after the stop (s)",
            "recovery median (s)",
            "recovery max (s)",
            "max latency (ms)",
            "log lines/s median",
            "max",
        ],
        [
            [
                s,
                str(r["restarts"]),
                _f(r["up_after_stop_median_s"]),
                _f(r["recovery_median_s"]),
                _f(r["recovery_max_s"]),
                _f(r["max_latency_ms"], 0),
                _f(r["log_lines_per_s_median"], 1),
                _f(r["log_lines_per_s_max"], 1),
            ]
            for s, r in summary["services"].items()
        ],
    )
    if summary["targets"]:
        lines += ["", "## Targets (issue 10)", ""]
        lines += _table(
            ["target", "measured", "verdict"],
            [[t["target"], t["measured"], t["verdict"]] for t in summary["targets"]],
        )
    lines += ["", "## Every restart", ""]
    lines += _table(
        [
            "service",
            "#",
            "stop took (s)",
            "accepting after stop (s)",
            "first delivery after accepting (s)",
            "after stop (s)",
            "max latency (ms)",
            "missing",
            "log lines",
            "lines/s",
        ],
        [
            [
                r["service"],
                str(r["n"]),
                _f(r["stop_s"]),
                _f(r["up_after_stop_s"]),
                _f(r.get("first_delivery_after_up_s")),
                _f(r.get("first_delivery_after_stop_s")),
                _f(r.get("max_latency_ms"), 0),
                str(r.get("missing_in_slot", "-")),
                str(r.get("log_lines", "-")),
                _f(r.get("log_lines_per_s"), 1),
            ]
            for r in result.get("restarts", [])
        ],
    )
    kinds = [
        (r["service"], r["n"], k)
        for r in result.get("restarts", [])
        for k in (r.get("log_kinds") or [])[:3]
    ]
    if kinds:
        lines += ["", "Most frequent relay log lines during each outage (digits as N):", ""]
        lines += [f"- {s} #{n}: {c} x `{text}`" for s, n, (text, c) in kinds]
    return _finish(lines, result, plots, recovery_problems(result))


def _finish(lines: list[str], result: dict[str, Any], plots: list[str], problems: list[str]) -> str:
    if plots:
        lines += ["", "## Plots", ""] + [f"![{p}]({p})" for p in plots]
    notes = (
        list(result.get("notes", []))
        + [f"CHECK FAILED: {p}" for p in problems]
        + [f"ERROR: {e}" for e in result.get("errors", [])]
    )
    if notes:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def _plot_drain(result: dict[str, Any], summary: dict[str, Any], path: Path) -> bool:
    from bench.plots import bar_figure, save_bar_chart  # matplotlib only when plotting

    mixes, modes = list(result["config"]["mixes"]), list(result["config"]["modes"])
    by = {(r["mix"], r["mode"]): r["rate_first_last"] for r in summary["rows"]}
    if not any(v for v in by.values()):
        return False
    fig, ax = bar_figure(max(6.0, 1.6 * len(mixes) * max(1, len(modes)) / 3))
    width = 0.8 / max(1, len(modes))
    for i, mode in enumerate(modes):
        xs = [j + i * width for j in range(len(mixes))]
        ax.bar(xs, [by.get((mix, mode)) or 0 for mix in mixes], width, label=mode)
    ax.set_xticks([j + width * (len(modes) - 1) / 2 for j in range(len(mixes))])
    ax.set_xticklabels(mixes)
    ax.set_ylabel("events/s, first -> last arrival (median)")
    ax.set_title(f"Backlog drain of {result['config']['rows']:,} rows")
    return save_bar_chart(fig, ax, path)


def _plot_recovery(result: dict[str, Any], path: Path) -> bool:
    from bench.plots import bar_figure, save_bar_chart  # matplotlib only when plotting

    rs = result.get("restarts", [])
    if not rs:
        return False
    fig, ax = bar_figure(max(6.0, 0.7 * len(rs)))
    labels = [f"{r['service']} {r['n']}" for r in rs]
    up = [r["up_after_stop_s"] for r in rs]
    rec = [r.get("first_delivery_after_up_s") or 0 for r in rs]
    ax.bar(labels, up, label="stop -> accepting connections", color="lightgrey")
    ax.bar(labels, rec, bottom=up, label="accepting -> first delivery (recovery)")
    ax.axhline(0, color="black", linewidth=0.5)
    ax.set_ylabel("seconds after the stop")
    ax.set_title("Outage recovery per restart")
    return save_bar_chart(fig, ax, path)


def write_phase_report(json_path: Path, *, plots: bool = True) -> Path:
    """Write ``<stem>.md`` (and a PNG) next to a drain or recovery result JSON."""
    result = json.loads(json_path.read_text())
    phase = result["phase"]
    names: list[str] = []
    png = json_path.with_suffix(".png")
    if phase == "drain":
        summary = summarize_drain(result)
        if plots and _try_plot(lambda: _plot_drain(result, summary, png), result):
            names.append(png.name)
        text = _drain_markdown(result, summary, names)
    elif phase == "recovery":
        summary = summarize_recovery(result)
        if plots and _try_plot(lambda: _plot_recovery(result, png), result):
            names.append(png.name)
        text = _recovery_markdown(result, summary, names)
    else:
        raise ValueError(f"{json_path}: unknown phase {phase!r}")
    md = json_path.with_suffix(".md")
    md.write_text(text)
    return md


def _try_plot(draw: Callable[[], bool], result: dict[str, Any]) -> bool:
    try:
        return bool(draw())
    except ImportError as e:  # matplotlib is optional: the tables do not need it
        result.setdefault("notes", []).append(f"plot skipped: {e}")
        return False
