"""Markdown tables and PNG plots of the backlog-drain, outage-recovery, held-snapshot,
failing-head and stalled-relay results (``python -m bench report drain-<ts>.json``
regenerates them)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.drain import drain_problems, summarize_drain
from bench.failing_head import failing_head_problems, summarize_failing_head
from bench.fmt import (
    environment_lines,
    finish,
    mode_bullets,
    modes_section,
    num,
    percent,
    profile_lines,
    share,
    table,
    tables_under,
    targets_section,
    whole,
)
from bench.held_snapshot import held_snapshot_problems, summarize_held_snapshot, window_table
from bench.recovery import recovery_problems, summarize_recovery
from bench.stalled_relay import stalled_relay_problems, summarize_stalled_relay

__all__ = ["compact_table", "write_phase_report"]


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
    lines += table(
        ["key mix", *modes],
        [
            [
                mix,
                *(whole(by[(mix, m)]["rate_first_last"]) if (mix, m) in by else "-" for m in modes),
            ]
            for mix in cfg["mixes"]
        ],
    )
    if summary["targets"]:
        lines += ["", "## Targets (issue 10; ratios within this run)", ""]
        lines += table(
            ["target", "ratio", "verdict"],
            [[t["target"], f"{t['ratio']:.2f}x", t["verdict"]] for t in summary["targets"]],
        )
    lines += ["", "## Every mix and mode", ""]
    lines += table(
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
            "of it while draining",
            "per round (ev/s)",
        ],
        [
            [
                r["mix"],
                r["mode"],
                f"{r['complete']}/{r['rounds']}",
                whole(r["rate_first_last"]),
                whole(r["rate_from_start"]),
                num(r["first_after_start_s"]),
                str(r["lost"]),
                str(r["duplicates"]),
                str(r["order_violations"]),
                str(r["pending_after"]),
                num(r["mode_cpu_us_per_event"], 0),
                num(r.get("mode_cpu_drain_us_per_event"), 1),
                " ".join(whole(v) for v in r["rates"]),
            ]
            for r in summary["rows"]
        ],
    )
    lines += _profile_lines(result)
    lines += ["", "## Key mixes and modes", ""]
    lines += [f"- `{m}`: {d}" for m, d in result.get("mixes", {}).items()]
    lines += mode_bullets(result)
    return finish(lines, result, plots, drain_problems(result))


def _profile_lines(result: dict[str, Any]) -> list[str]:
    """Per profiled cell (``--profile``), the functions with the most own time."""
    lines: list[str] = []
    for c in result.get("cells", []):
        if c.get("profile"):
            lines += profile_lines(f"{c['mix']}, {c['mode']}", c["profile"])
    return lines


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
    lines += table(
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
                num(r["up_after_stop_median_s"]),
                num(r["recovery_median_s"]),
                num(r["recovery_max_s"]),
                num(r["max_latency_ms"], 0),
                num(r["log_lines_per_s_median"], 1),
                num(r["log_lines_per_s_max"], 1),
            ]
            for s, r in summary["services"].items()
        ],
    )
    lines += targets_section(summary, "issue 10")
    lines += ["", "## Every restart", ""]
    lines += table(
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
                num(r["stop_s"]),
                num(r["up_after_stop_s"]),
                num(r.get("first_delivery_after_up_s")),
                num(r.get("first_delivery_after_stop_s")),
                num(r.get("max_latency_ms"), 0),
                str(r.get("missing_in_slot", "-")),
                str(r.get("log_lines", "-")),
                num(r.get("log_lines_per_s"), 1),
            ]
            for r in result.get("restarts", [])
        ],
    )
    lines += _xact_lines(result, summary)
    kinds = [
        (r["service"], r["n"], k)
        for r in result.get("restarts", [])
        for k in (r.get("log_kinds") or [])[:3]
    ]
    if kinds:
        lines += ["", "Most frequent relay log lines during each outage (digits as N):", ""]
        lines += [f"- {s} #{n}: {c} x `{text}`" for s, n, (text, c) in kinds]
    return finish(lines, result, plots, recovery_problems(result))


def _xact_lines(result: dict[str, Any], summary: dict[str, Any]) -> list[str]:
    """The relay's transactions while Kafka was down (restarts that sampled them)."""
    rs = [r for r in result.get("restarts", []) if r.get("xact")]
    if not rs:
        return []
    lines = [
        "",
        "## Relay transactions during the Kafka outages",
        "",
        "`pg_stat_activity` every 50 ms from just before the stop: the relay's worker sessions "
        "(`notify-outbox-worker`) in a transaction. **Oldest while down** is the age of the "
        "longest-open transaction seen from the stop until Kafka accepted connections, **xid** "
        "whether any of them held a transaction id (then it holds the database's horizon: "
        "vacuum keeps every tuple that dies meanwhile); **longest** how long the longest "
        "transaction begun before Kafka came back stayed open in all; **none open** the first "
        "look from which no such transaction was open any more, after the stop and after "
        "accepting connections (negative: before). PostgreSQL restarts are not sampled: the "
        "stop ends every session.",
        "",
    ]
    for service, row in summary["services"].items():
        x = row.get("xact")
        if x is not None:
            left = x["never_clear"]
            lines.append(
                f"- {service}: oldest while down max {num(x['max_age_down_s'])} s, longest "
                f"{num(x['longest_outage_xact_s'])} s, an xid held in {x['xid_restarts']} of "
                f"{row['restarts']} outages; none open {num(x['clear_after_stop_median_s'])} s "
                f"after the stop (median; max {num(x['clear_after_stop_max_s'])} s)"
                + (f"; one still open at the end of the looks in {left}" if left else "")
            )
    lines.append("")
    lines += table(
        [
            "service",
            "#",
            "open at the stop (oldest, s)",
            "oldest while down (s)",
            "xid",
            "looks with one open %",
            "longest (s)",
            "none open, s after stop",
            "after accepting",
            "looks",
        ],
        [
            [
                r["service"],
                str(r["n"]),
                f"{x['open_at_stop']} ({num(x['oldest_at_stop_s'])})",
                num(x["max_age_down_s"]),
                "yes" if x["xid_down"] else "no",
                num(percent(x["open_share_down"]), 0),
                num(x["longest_outage_xact_s"]),
                num(x["clear_after_stop_s"]),
                num(x["clear_after_up_s"]),
                str(x["samples"]) + (f" ({len(x['errors'])} errors)" if x["errors"] else ""),
            ]
            for r in rs
            for x in [r["xact"]]
        ],
    )
    return lines


def _held_markdown(result: dict[str, Any], summary: dict[str, Any], plots: list[str]) -> str:
    cfg = result["config"]
    lines = [f"# notify-outbox held snapshot {result['run_id']}", ""]
    lines += environment_lines(result)
    lines += [
        f"- writers: {cfg['rate']:g} ev/s, open loop, single-row transactions, {cfg['keys']} "
        f"keys; {cfg['baseline']:g} s baseline, then a REPEATABLE READ transaction (`SELECT "
        f"count(*) FROM outbox`) held open for {cfg['hold']:g} s, then {cfg['recovery']:g} s "
        f"of recovery; {cfg['repeat']} round(s), modes one after the other per round on fresh "
        "databases and topics, medians over rounds",
        "- warm-up: "
        + (
            f"{cfg['warmup']:g} s at the same rate through the relay before the first cell, not "
            "measured (a fresh stack is slow for its first minute under load)"
            if cfg.get("warmup")
            else "none: the first cell met a cold stack"
        ),
        "",
        "Events go into windows by their commit ack. **p50/p99** is commit ack -> consumer "
        "receipt (ms); **rate %** the commits in the window as a share of the offered rate; "
        "**mode µs/ev** the mode process's CPU (user + system) per event delivered in the "
        "window; **db µs/ev** the CPU of every process of the PostgreSQL cluster per event "
        "committed in the window; **dead tuples** the outbox's `n_dead_tup` at the window's end.",
    ]
    lines += targets_section(summary, "design/benchmarks.md")
    lines += ["", "## Per phase (all events of a phase pooled; medians over rounds)", ""]
    lines += table(
        [
            "mode",
            "baseline p50 / p99 / max (ms)",
            "hold",
            "recovery",
            "worst hold window p99",
            "lowest hold rate %",
            "dead tuples at release",
            "missing",
        ],
        [
            [
                mode,
                *(
                    " / ".join(num(m["phases"][p][k], 1) for k in ("p50", "p99", "max"))
                    for p in ("baseline", "hold", "recovery")
                ),
                num(m["worst_hold_p99"], 1),
                num(percent(m["lowest_hold_share"]), 1),
                whole(m["dead_tuples_at_release"]),
                str(m["missing"]),
            ]
            for mode, m in summary["modes"].items()
        ],
    )
    if summary["modes"]:
        lines += ["", "## Per window (medians over rounds)", ""]
        lines += window_table({mode: m["windows"] for mode, m in summary["modes"].items()})
        lines += [
            "",
            "More per window: committed ev/s, e2e p99 (from the schedule, ms), mode "
            "and database CPU %, outbox size with its indexes (MB).",
            "",
        ]
        lines += table(
            ["window", "mode", "committed ev/s", "e2e p99", "mode CPU %", "db CPU %", "outbox MB"],
            [
                [
                    f"{w['start_s']:.0f} s ({w['phase']})",
                    mode,
                    whole(w["rate"]),
                    num(w["e2e_p99"], 1),
                    num(w["mode_cpu_percent"], 1),
                    num(w["db_cpu_percent"], 1),
                    num(w["total_bytes"] / 2**20 if w["total_bytes"] is not None else None, 1),
                ]
                for mode, m in summary["modes"].items()
                for w in m["windows"]
            ],
        )
    lines += modes_section(result)
    return finish(lines, result, plots, held_snapshot_problems(result))


def _failing_markdown(result: dict[str, Any], summary: dict[str, Any], plots: list[str]) -> str:
    cfg = result["config"]
    lines = [f"# notify-outbox failing head {result['run_id']}", ""]
    lines += environment_lines(result)
    auto = result.get("environment", {}).get("kafka", {}).get("broker_configs", {})
    lines += [
        f"- {' and '.join(f'{n:,}' for n in cfg['failing_rows'])} rows of "
        f"{cfg['failing_keys']} keys to a topic that does not exist (broker "
        f"auto.create.topics.enable={auto.get('auto.create.topics.enable', 'unknown')}), "
        "inserted with the mode stopped; the mode starts and tries them; then "
        f"{cfg['healthy_rows']} rows of {cfg['healthy_keys']} other keys to a healthy topic at "
        f"{cfg['healthy_rate']:g} ev/s, each timed from its commit ack to the consumer (up to "
        f"{cfg['healthy_timeout']:g} s); then a {cfg['quiet']:g} s quiet window with no new "
        f"rows; {cfg['repeat']} round(s), fresh database and topic per cell, medians over rounds",
    ]
    lines += targets_section(summary, "design/benchmarks.md")
    t = f"{cfg['healthy_timeout']:g}"
    lines += ["", "## Healthy rows behind the failing head (medians over rounds)", ""]
    lines += table(
        [
            "failing rows",
            "mode",
            "within 1 s",
            f"within {t} s",
            "p50 (ms)",
            "p99 (ms)",
            "max (ms)",
            "all arrived, s after the last commit",
            "mode tried the failing rows, s after ready",
        ],
        [
            [
                f"{r['failing_rows']:,}",
                r["mode"],
                f"{whole(r['within_1s'])} of {whole(r['healthy_rows'])}",
                f"{whole(r['within_timeout'])} of {whole(r['healthy_rows'])}",
                num(r["p50"], 1),
                num(r["p99"], 1),
                num(r["max"], 1),
                num(r["all_arrived_after_last_commit_s"])
                + (
                    ""
                    if r["all_arrived_rounds"] == r["rounds"]
                    else f" (not all within {t} s in {r['rounds'] - r['all_arrived_rounds']} "
                    "round(s))"
                ),
                num(r["tried_after_ready_s"])
                + ("" if r["tried_rounds"] == r["rounds"] else " (not in every round)"),
            ]
            for r in summary["rows"]
        ],
    )
    lines += [
        "",
        f"## Quiet window ({cfg['quiet']:g} s, no new rows, the failing rows waiting)",
        "",
        "Commits/s from `pg_stat_database` (PostgreSQL 15 reports a backend's counts up to a "
        "second late, or ten for a backend that went idle: the window starts "
        f"{cfg.get('quiet_settle', 0):g} s after the healthy rows arrived or timed out), "
        "statements/s and claims/s (calls of the mode's claim statement) from "
        "`pg_stat_statements` (counted at once), of the mode's own database; CPU of the mode's "
        "process and of the whole PostgreSQL cluster.",
        "",
    ]
    lines += table(
        [
            "failing rows",
            "mode",
            "commits/s",
            "transactions/s (with rollbacks)",
            "statements/s",
            "claims/s",
            "mode CPU %",
            "db CPU %",
            "mode log lines",
        ],
        [
            [
                f"{r['failing_rows']:,}",
                r["mode"],
                num(r["commits_per_s"], 1),
                num(r["xacts_per_s"], 1),
                num(r["statements_per_s"], 1),
                num(r["claims_per_s"], 1),
                num(r["mode_cpu_percent"], 1),
                num(r["db_cpu_percent"], 1),
                whole(r["mode_log_lines"]),
            ]
            for r in summary["rows"]
        ],
    )
    tops = [c for c in result.get("cells", []) if c.get("round") == 0 and "quiet" in c]
    if tops:
        lines += ["", "Statements run most in the quiet window (first round; calls, rows):", ""]
        for c in tops:
            lines.append(f"- {c['failing_rows']:,} failing, {c['mode']}:")
            lines += [
                f"  - {s['calls']} x, {s['rows']} rows: `{s['query']}`"
                for s in c["quiet"]["top_statements"][:3]
            ]
    lines += modes_section(result)
    return finish(lines, result, plots, failing_head_problems(result))


def _stalled_markdown(result: dict[str, Any], summary: dict[str, Any], plots: list[str]) -> str:
    cfg = result["config"]
    lines = [f"# notify-outbox stalled relay {result['run_id']}", ""]
    lines += environment_lines(result)
    env_bits = ", ".join(f"{k}={v}" for k, v in cfg.get("relay_env", {}).items())
    lines += [
        f"- {cfg['relays']} relay processes (default settings"
        + (f", {env_bits}" if env_bits else "")
        + f") on one database and topic; writers at {cfg['rate']:g} ev/s, open loop, "
        f"single-row transactions; {cfg.get('warmup', 0):g} s warm-up (in no phase), "
        f"{cfg['baseline']:g} s baseline, then {cfg['freezes']} "
        f"times one relay frozen with SIGSTOP for {cfg['freeze']:g} s and continued, "
        f"{cfg['gap']:g} s apart, then {cfg['recovery']:g} s of recovery; the relay frozen: "
        + (
            "the one holding the awake marker's current epoch (else its latest), else in turn"
            if cfg["pick"] == "marker"
            else "in turn"
        )
        + f"; {cfg['repeat']} round(s), fresh database and topic per cell, medians over rounds",
        "",
        "Events go into phases by their commit ack: **baseline** (from the end of the warm-up "
        "to 1 s before the first freeze: an event committed just before a SIGSTOP may be in the "
        "claim it freezes), **freezes** (from the SIGSTOP to the SIGCONT), **between** freezes, "
        "**recovery** (after the last). Latency is commit ack -> consumer receipt (ms). "
        "**Keys held** are the keys whose claim bucket the frozen relay held in an open claim "
        "transaction (`pg_locks`, looked at 0.08 s after the SIGSTOP): per-key order makes them "
        "wait for it, until the other relay's pulse ends the claim (frozen_relay_timeout, 0.15 s) "
        "or PostgreSQL does (claim_idle_timeout, 2 s); "
        "**keys free** are the others. **Rate %** is the producers' commits as a share of the "
        "offered rate.",
    ]
    lines += targets_section(summary, "the stalled-relay issue: p99 <= 100 ms during the freezes")
    lines += ["", "## Latency per phase (medians over rounds)", ""]
    lines += table(
        [
            "notify mode",
            "keys",
            "rounds",
            "baseline p50 / p99 / max",
            "freezes p50 / p99 / max",
            "freezes, keys free p99 / max",
            "freezes, keys held p99 (share of events %)",
            "between p99",
            "recovery p99",
            "rate % baseline / freezes / all",
            "lost",
        ],
        [
            [
                r["notify_mode"],
                f"{r['keys']:,}",
                str(r["rounds"]),
                " / ".join(num(r[f"baseline_{k}"], 1) for k in ("p50", "p99", "max")),
                " / ".join(num(r[f"freeze_{k}"], 1) for k in ("p50", "p99", "max")),
                f"{num(r['freeze_free_p99'], 1)} / {num(r['freeze_free_max'], 1)}",
                f"{num(r['freeze_held_p99'], 1)} ({num(percent(r['freeze_held_share']), 1)})",
                num(r["between_p99"], 1),
                num(r["recovery_p99"], 1),
                " / ".join(
                    share(r[k]) for k in ("baseline_rate_share", "freeze_rate_share", "rate_share")
                ),
                str(r["lost"]),
            ]
            for r in summary["rows"]
        ],
    )
    lines += [
        "",
        "## The frozen relay and the awake marker",
        "",
        "Who held the current epoch's awake marker (migration 0006), from a look at `pg_locks` "
        "every 0.1 s, as a share of the looks during the freezes (medians over freezes): the "
        "frozen relay, the other relay, nobody (producers notify). **Kept** is the latest look "
        "at which the frozen relay still held it, after the SIGSTOP (max over freezes, and in "
        "how many freezes it held it at all). **Claim open** counts the freezes in which the "
        "frozen relay was stopped inside a transaction; **held keys** is the median number of "
        "the writers' keys in the claim buckets it held.",
        "",
    ]
    lines += table(
        [
            "notify mode",
            "keys",
            "picked by",
            "marker: frozen / other / nobody %",
            "kept (s), freezes",
            "baseline: marker held %",
            "claim open",
            "held keys",
        ],
        [
            [
                r["notify_mode"],
                f"{r['keys']:,}",
                ", ".join(f"{k} x{v}" for k, v in r["picked_by"].items()),
                " / ".join(share(r[f"marker_{k}"]) for k in ("frozen", "other", "nobody")),
                f"{num(r['marker_kept_max_s'])}, {r['marker_kept_freezes']} of {r['freezes']}",
                share(r["baseline_awake"]),
                f"{r['claim_open']} of {r['freezes']}",
                num(r["held_keys_median"], 0),
            ]
            for r in summary["rows"]
        ],
    )
    freezes = [(c, f) for c in result.get("cells", []) if "phases" in c for f in c["freezes"]]
    if freezes:
        lines += ["", "## Every freeze", ""]
        lines += table(
            [
                "mode",
                "keys",
                "round",
                "#",
                "relay",
                "picked by",
                "p50 / p99 / max",
                "keys free p99",
                "keys held (events)",
                "rate %",
                "in transaction (oldest, s)",
                "buckets held",
                "marker kept (s)",
            ],
            [
                [
                    c["notify_mode"],
                    f"{c['keys']:,}",
                    str(c["round"] + 1),
                    str(f["n"]),
                    str(f["relay"] + 1),
                    f["picked_by"],
                    " / ".join(num(f["latency"][k], 1) for k in ("p50", "p99", "max")),
                    num(f["free_keys_latency"]["p99"], 1),
                    f"{len(f['frozen'].get('held_keys', []))} ({f['held_keys_latency']['count']})",
                    share(f["rate_share"]),
                    f"{f['frozen'].get('in_transaction', '-')} "
                    f"({num(f['frozen'].get('oldest_xact_s'))})",
                    str(len(f["frozen"].get("claim_buckets", []))),
                    num(f["marker"].get("frozen_held_until_s"), 3),
                ]
                for c, f in freezes
            ],
        )
    lines += modes_section(result)
    return finish(lines, result, plots, stalled_relay_problems(result))


def compact_table(result: dict[str, Any]) -> list[str]:
    """The main table and the targets of a held-snapshot, failing-head or stalled-relay
    result, for the terminal at the end of a run."""
    phase = result["phase"]
    if phase == "held-snapshot":
        summary = summarize_held_snapshot(result)
        text = _held_markdown(result, summary, [])
        first = "## Per window"
    elif phase == "stalled-relay":
        summary = summarize_stalled_relay(result)
        text = _stalled_markdown(result, summary, [])
        first = "## Latency per phase"
    else:
        summary = summarize_failing_head(result)
        text = _failing_markdown(result, summary, [])
        first = "## Healthy rows"
    return tables_under(text, ("## Targets", first, "## Quiet window"))


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


def _plot_held(summary: dict[str, Any], result: dict[str, Any], path: Path) -> bool:
    from bench.plots import held_snapshot_figure  # matplotlib only when plotting

    return held_snapshot_figure(summary["modes"], result["config"], path)


def _plot_failing(summary: dict[str, Any], result: dict[str, Any], path: Path) -> bool:
    from bench.plots import failing_head_figure  # matplotlib only when plotting

    return failing_head_figure(summary["rows"], result["config"], path)


def _plot_stalled(summary: dict[str, Any], result: dict[str, Any], path: Path) -> bool:
    from bench.plots import stalled_relay_figure  # matplotlib only when plotting

    return stalled_relay_figure(summary["rows"], result["config"], path)


def write_phase_report(json_path: Path, *, plots: bool = True) -> Path:
    """Write ``<stem>.md`` (and a PNG) next to a drain, recovery, held-snapshot, failing-head
    or stalled-relay result JSON."""
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
    elif phase == "held-snapshot":
        summary = summarize_held_snapshot(result)
        if plots and _try_plot(lambda: _plot_held(summary, result, png), result):
            names.append(png.name)
        text = _held_markdown(result, summary, names)
    elif phase == "failing-head":
        summary = summarize_failing_head(result)
        if plots and _try_plot(lambda: _plot_failing(summary, result, png), result):
            names.append(png.name)
        text = _failing_markdown(result, summary, names)
    elif phase == "stalled-relay":
        summary = summarize_stalled_relay(result)
        if plots and _try_plot(lambda: _plot_stalled(summary, result, png), result):
            names.append(png.name)
        text = _stalled_markdown(result, summary, names)
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
