"""From a latency run's result JSON to the summary, the markdown report and the plots
(``python -m bench report FILE.json``; ``bench.catalog`` finds the other regimes')."""

from __future__ import annotations

import json
import math
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from bench.analysis import median
from bench.fmt import environment_lines, grid, modes_section, num, pct, profile_lines, signed, table
from bench.stages import STAGES

_PCTS = ("p50", "p95", "p99", "p99.9", "max")


def _med(values: Iterable[float | None]) -> float:
    """``median``, NaN when there is no value (the latency tables' missing figure)."""
    m = median(values)
    return math.nan if m is None else m


def _majority(flags: list[bool]) -> bool:
    return sum(flags) * 2 > len(flags)


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """Medians over repetitions, maximum throughput per mode, producer ratios, targets."""
    # A load that did not keep up is tried a second time in the first round; the second
    # attempt stands for that round (both stay in the JSON).
    final: dict[tuple[str, float, str, str, int], dict[str, Any]] = {}
    for c in result["latency_cells"]:
        key = (c["mode"], float(c["load"]), c["arrival"], c["producer"], int(c["rep"]))
        if key not in final or c.get("attempt", 1) >= final[key].get("attempt", 1):
            final[key] = c
    groups: dict[tuple[str, float, str, str], list[dict[str, Any]]] = defaultdict(list)
    for c in final.values():
        groups[(c["mode"], float(c["load"]), c["arrival"], c["producer"])].append(c)
    latency = []
    for (mode, load, arrival, producer), cells in groups.items():
        row: dict[str, Any] = {
            "mode": mode,
            "load": load,
            "arrival": arrival,
            "producer": producer,
            "reps": len(cells),
            "commit_rate": _med(c["commit_rate"] for c in cells),
            "delivered_rate": _med(c["delivered_rate"] for c in cells),
            "sustained_reps": sum(bool(c["sustained"]) for c in cells),
            "keeps_up_reps": sum(bool(c["keeps_up"]) for c in cells),
            "sustained": _majority([bool(c["sustained"]) for c in cells]),
            "keeps_up": _majority([bool(c["keeps_up"]) for c in cells]),
            "missing": sum(int(c["missing"]) for c in cells),
            "limits": sorted({str(c.get("limit")) for c in cells if c.get("limit")}),
            "mode_cpu_us_per_event": _med(c.get("mode_cpu_us_per_event") for c in cells),
            "db_cpu_us_per_event": _med(c.get("db_cpu_us_per_event") for c in cells),
            "host_cpu_busy": _med(c.get("host_cpu_busy") for c in cells),
        }
        for metric in ("e2e", "ack_to_recv"):
            row[metric] = {p: _med(c["latency"][metric].get(p) for c in cells) for p in _PCTS}
        row["stages"] = {
            stage: {p: _med(c["stages"][stage].get(p) for c in cells) for p in ("p50", "p99")}
            for stage in cells[0]["stages"]
        }
        if any("stage_log" in c for c in cells):
            row["stage_log"] = _stage_log_summary([c["stage_log"] for c in cells])
        latency.append(row)
    # The database's CPU per event with the same writers and no relay, per load; what a mode
    # adds is its own minus that (medians over rounds each).
    baseline_cells: dict[float, list[dict[str, Any]]] = defaultdict(list)
    for c in result.get("baseline_cells", []):
        baseline_cells[float(c["load"])].append(c)
    db_baseline = {
        load: _med(c.get("db_cpu_us_per_event") for c in cells)
        for load, cells in sorted(baseline_cells.items())
    }
    for row in latency:
        base = db_baseline.get(row["load"], math.nan)
        row["db_added_us_per_event"] = row["db_cpu_us_per_event"] - base
    mode_order = list(result["config"]["modes"])
    floors = _floor_modes(result)

    def rank(mode: str) -> int:
        return mode_order.index(mode) if mode in mode_order else 99

    # With a Kafka floor, the rows go by load, the floor first, so that it sits next to the
    # modes it bounds; without, by mode, as always.
    latency.sort(
        key=lambda r: (
            r["arrival"] != "constant" or r["producer"] != "sql",
            *((r["load"], r["mode"] not in floors) if floors else ()),
            rank(r["mode"]),
            r["load"],
            r["arrival"],
            r["producer"],
        )
    )
    main = [r for r in latency if r["arrival"] == "constant" and r["producer"] == "sql"]
    throughput = {}
    for mode in mode_order:
        rows = [r for r in main if r["mode"] == mode]
        if not rows:
            continue
        throughput[mode] = {
            "max_sustained": max((r["load"] for r in rows if r["sustained"]), default=None),
            "max_keeping_up": max((r["load"] for r in rows if r["keeps_up"]), default=None),
            "highest_tried": max(r["load"] for r in rows),
            "first_failing": min((r["load"] for r in rows if not r["keeps_up"]), default=None),
        }
        failing = [r for r in rows if not r["keeps_up"]]
        throughput[mode]["first_failing_limit"] = (
            "/".join(min(failing, key=lambda r: r["load"])["limits"]) if failing else None
        )
    producer_rows = _producer_summary(result)
    idle = {
        i["mode"]: {k: i[k] for k in ("queries_per_s", "commits_per_s", "cpu_percent")}
        for i in result["idle"]
    }
    summary: dict[str, Any] = {
        "latency": latency,
        "throughput": throughput,
        "producer": producer_rows,
        "idle": idle,
        "db_baseline": db_baseline,
        "final_cells": sorted(int(c["cell"]) for c in final.values()),
        "over_floor": _over_floor(final.values(), floors[0] if floors else None, rank),
    }
    summary["targets"] = _targets(summary)
    return summary


def _stage_log_summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The relay's stage log over the rounds of one mode and load: each stage's p50, p99 and
    share of negative intervals (medians over rounds), the claims' wake sources (shares of
    all rounds' claims), and the events no line carried (all rounds)."""
    ok = [r for r in records if r["status"] == "ok"]
    if not ok:
        return {"status": "no stage log", "rounds": len(records)}
    sources: Counter[str] = Counter()
    for r in ok:
        sources.update(r["sources"])
    claims = sum(sources.values())
    return {
        "status": "ok",
        "rounds": len(ok),
        "rounds_without": len(records) - len(ok),
        "claims": claims,
        "sources": {k: n / claims for k, n in sources.most_common()},
        "events": sum(r["events"] for r in ok),
        "missing_lines": sum(r["missing_lines"] for r in ok),
        "stages": {
            stage: {p: _med(r["stages"][stage][p] for r in ok) for p in ("p50", "p99", "negative")}
            for stage in STAGES
        },
    }


def _floor_modes(result: dict[str, Any]) -> list[str]:
    """The run's Kafka floor modes (no database: what Kafka and the consumer alone cost)."""
    return [n for n, m in result.get("modes", {}).items() if m.get("kind") == "floor"]


def _over_floor(
    cells: Iterable[dict[str, Any]], floor_mode: str | None, rank: Callable[[str], int]
) -> list[dict[str, Any]]:
    """Per mode and load, ack->recv p50 and p99 and their excess over the floor's in the same
    round (the median of the per-round differences: both saw the same minute of the host)."""
    main = [c for c in cells if c["arrival"] == "constant" and c["producer"] == "sql"]
    floor = {(float(c["load"]), int(c["rep"])): c for c in main if c["mode"] == floor_mode}
    groups: dict[tuple[str, float], list[tuple[dict[str, Any], dict[str, Any]]]] = defaultdict(list)
    for c in main:
        f = floor.get((float(c["load"]), int(c["rep"])))
        if f is not None and c["mode"] != floor_mode:
            groups[(c["mode"], float(c["load"]))].append((c, f))
    rows = []
    for (mode, load), pairs in groups.items():
        row: dict[str, Any] = {"mode": mode, "load": load, "rounds": len(pairs)}
        for p in ("p50", "p99"):
            ours = [c["latency"]["ack_to_recv"][p] for c, _ in pairs]
            theirs = [f["latency"]["ack_to_recv"][p] for _, f in pairs]
            row[p] = _med(ours)
            row[f"floor_{p}"] = _med(theirs)
            row[f"over_{p}"] = _med(
                a - b for a, b in zip(ours, theirs, strict=True) if a is not None and b is not None
            )
        rows.append(row)
    rows.sort(key=lambda r: (r["load"], rank(r["mode"])))
    return rows


def _producer_summary(result: dict[str, Any]) -> list[dict[str, Any]]:
    groups: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
    for c in result["producer_cells"]:
        groups[(c["variant"], int(c["writers"]))].append(c)
    rows: list[dict[str, Any]] = []
    for (variant, writers), cells in groups.items():
        rows.append(
            {
                "variant": variant,
                "writers": writers,
                "reps": len(cells),
                "commits_per_s": _med(c["commits_per_s"] for c in cells),
                "p50": _med(c["latency"]["p50"] for c in cells),
                "p99": _med(c["latency"]["p99"] for c in cells),
            }
        )
    base = {(r["variant"], r["writers"]): r["commits_per_s"] for r in rows}
    for r in rows:
        for ref in _PRODUCER_REFS:
            b = base.get((ref, r["writers"]))
            r[f"vs_{ref}"] = r["commits_per_s"] / b if b else math.nan
    order = list(result["config"]["variants"])
    rows.sort(
        key=lambda r: (order.index(r["variant"]) if r["variant"] in order else 99, r["writers"])
    )
    return rows


# The baselines of the producer table: nothing draining; a relay polling every 0.1 s (cheap,
# large batches); a relay polling every 2 ms (draining as continuously as an awake relay).
_PRODUCER_REFS = ("no-trigger", "no-trigger+relay", "no-trigger+fast-relay")


def _find(summary: dict[str, Any], mode: str, load: float) -> dict[str, Any] | None:
    for r in summary["latency"]:
        if (
            r["mode"] == mode
            and r["load"] == load
            and r["arrival"] == "constant"
            and r["producer"] == "sql"
        ):
            found: dict[str, Any] = r
            return found
    return None


def _verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else "met" if ok else "MISSED"


def _targets(summary: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []

    def add(target: str, measured: str, ok: bool | None, stretch: bool | None = None) -> None:
        out.append(
            {
                "target": target,
                "measured": measured,
                "verdict": _verdict(ok),
                "stretch": _verdict(stretch) if stretch is not None else "",
            }
        )

    for load, p50_t, p99_t, st50, st99 in ((100, 5, 20, 2, 10), (1000, 10, 30, None, 15)):
        r = _find(summary, "notify", load)
        if r is None:
            add(f"notify @ {load} ev/s: p50 <= {p50_t} ms, p99 <= {p99_t} ms", "not run", None)
            continue
        a = r["ack_to_recv"]
        ok = a["p50"] <= p50_t and a["p99"] <= p99_t
        stretch = (st50 is None or a["p50"] <= st50) and a["p99"] <= st99
        add(
            f"notify @ {load} ev/s, commit ack -> receive: p50 <= {p50_t} ms, p99 <= {p99_t} ms",
            f"p50 {a['p50']:.2f} ms, p99 {a['p99']:.2f} ms "
            f"(from schedule: p50 {r['e2e']['p50']:.2f}, p99 {r['e2e']['p99']:.2f})",
            ok,
            stretch,
        )
    for load, limit in ((100, 1000), (1000, 150)):
        r = _find(summary, "notify", load)
        if r is None:
            continue
        relay, added = r["mode_cpu_us_per_event"], r["db_added_us_per_event"]
        add(
            f"notify @ {load} ev/s, CPU per event: relay <= {limit} µs",
            f"{num(relay, 0)} µs",
            None if math.isnan(relay) else relay <= limit,
        )
        add(
            f"notify @ {load} ev/s, CPU per event: database added by the relay <= {limit} µs",
            "not measured (no cells without a relay)"
            if math.isnan(added)
            else f"{num(added, 0)} µs ({num(r['db_cpu_us_per_event'], 0)} with the relay, "
            f"{num(summary['db_baseline'][load], 0)} without)",
            None if math.isnan(added) else added <= limit,
        )
    for common in (100.0, 1000.0):
        n, p = _find(summary, "notify", common), _find(summary, "poll-100ms", common)
        if n is None or p is None:
            continue
        ratio = p["ack_to_recv"]["p50"] / n["ack_to_recv"]["p50"]
        add(
            f"notify p50 >= 10x lower than 100 ms polling, {common:g} ev/s",
            f"{ratio:.1f}x ({n['ack_to_recv']['p50']:.2f} vs {p['ack_to_recv']['p50']:.1f} ms)",
            ratio >= 10,
            ratio >= 25,
        )
    t = summary["throughput"].get("notify")
    if t is not None:
        best = float(t["max_sustained"] or 0)
        add(
            "notify max sustained throughput >= 5k ev/s (stretch 10k)",
            f"{best:g} ev/s (highest tried {t['highest_tried']:g}; first not keeping up: "
            + (
                f"{t['first_failing']:g}, limited by {t['first_failing_limit']})"
                if t["first_failing"] is not None
                else "none)"
            ),
            best >= 5000,
            best >= 10000,
        )
    prod = {(r["variant"], r["writers"]): r for r in summary["producer"]}
    for (variant, writers), r in sorted(prod.items()):
        if variant not in ("gated+relay", "gated-awake", "shipped+relay"):
            continue
        ratio = r["vs_no-trigger"]
        others = ", ".join(
            f"{pct(r[f'vs_{ref}'])} of {ref}"
            for ref in _PRODUCER_REFS[1:]
            if not math.isnan(r[f"vs_{ref}"])
        )
        add(
            f"producer commits/s, {variant} vs no-trigger, {writers} writer(s): >= 90% "
            "(stretch 97%)",
            f"{pct(ratio)} of no-trigger" + (f" ({others})" if others else ""),
            None if math.isnan(ratio) else ratio >= 0.9,
            None if math.isnan(ratio) else ratio >= 0.97,
        )
    gated, always = _find(summary, "notify", 100), _find(summary, "notify-always", 100)
    if gated is not None and always is not None:
        g, a = gated["ack_to_recv"]["p50"], always["ack_to_recv"]["p50"]
        add(
            "gated (notify) vs always-notify @ 100 ev/s: p50 within 1 ms",
            f"gated {g:.2f} ms, always {a:.2f} ms ({g - a:+.2f} ms)",
            g - a <= 1.0,
            None,
        )
    for mode in ("notify", "relay-poll"):
        i = summary["idle"].get(mode)
        if i is None or i["queries_per_s"] is None:
            continue
        q = i["queries_per_s"]
        add(
            f"idle load of {mode}: <= 1 query/s (stretch 0.2)",
            f"{q:.2f} queries/s, {i['commits_per_s']:.2f} commits/s",
            q <= 1.0 if mode == "notify" else None,
            q <= 0.2 if mode == "notify" else None,
        )
    return out


# --- markdown ---------------------------------------------------------------------------------


def render_markdown(result: dict[str, Any], summary: dict[str, Any], plots: list[str]) -> str:
    """The human-readable report of one run."""
    cfg = result["config"]
    lines = [
        f"# notify-outbox bench {result['run_id']} ({cfg['preset']})",
        "",
        *environment_lines(result),
        f"- cells: {cfg['warmup']:g} s warm-up + {cfg['duration']:g} s measured, "
        f"{cfg['repeat']} repetition(s), medians over repetitions; "
        + (
            "single-row transactions (plain SQL autocommit INSERT unless noted)"
            if cfg.get("tx_events", 1) <= 1
            else f"**up to {cfg['tx_events']} already-due events per transaction** (one "
            "multi-row INSERT; latency still from each event's own schedule)"
        )
        + ", open loop, constant rate unless noted",
        "",
        "Latency is in milliseconds. **e2e** is from the event's *scheduled* send time to the "
        "consumer's receipt (includes generator lag and the INSERT+COMMIT: no coordinated "
        "omission); **ack->recv** is from the producer's commit acknowledgement to the receipt "
        "(the targets' definition).",
        "",
        "## Targets",
        "",
    ]
    lines += table(
        "target | measured | verdict | stretch",
        [[t["target"], t["measured"], t["verdict"], t["stretch"]] for t in summary["targets"]],
    )
    lines += ["", "## Latency per mode and offered load", ""]
    rows = []
    for r in summary["latency"]:
        e, a = r["e2e"], r["ack_to_recv"]
        verdict = (
            f"sustained {r['sustained_reps']}/{r['reps']}"
            if r["sustained"]
            else f"keeps up {r['keeps_up_reps']}/{r['reps']}"
            if r["keeps_up"]
            else f"saturated: {'/'.join(r['limits'])} ({r['keeps_up_reps']}/{r['reps']} keep up)"
        )
        rows.append(
            [
                _row_label(r),
                f"{r['load']:g}",
                num(r["commit_rate"]),
                num(r["delivered_rate"]),
                *(num(e[p]) for p in _PCTS),
                num(a["p50"]),
                num(a["p99"]),
                num(a["p99.9"]),
                verdict,
            ]
        )
    lines += table(
        (
            "mode | offered ev/s | committed/s | delivered/s | e2e p50 | p95 | p99 | p99.9 | "
            "max | ack->recv p50 | p99 | p99.9 | verdict"
        ),
        rows,
    )
    lines += [
        "",
        "*sustained*: committed within 1% of offered, every event delivered, latency flat across "
        "the window (median of the last fifth <= 1.5x the first fifth + 10 ms), e2e p99 <= 100 "
        "ms. *keeps up*: the same without the latency limit. *saturated: commit*: the "
        "producers could not commit at the offered rate (the load generator and PostgreSQL "
        "share the 2 cores with Kafka and the mode under test); *saturated: delivery*: the mode "
        "fell behind (latency grew through the window, or events did not arrive).",
    ]
    lines += _over_floor_section(summary)
    lines += ["", "## Maximum throughput per mode", ""]
    lines += table(
        "mode | max sustained ev/s | max keeping up ev/s | highest tried | first saturated",
        [
            [
                m,
                num(t["max_sustained"]),
                num(t["max_keeping_up"]),
                num(t["highest_tried"]),
                num(t["first_failing"])
                + (f" ({t['first_failing_limit']})" if t.get("first_failing_limit") else ""),
            ]
            for m, t in summary["throughput"].items()
        ],
    )
    stage_load = float(cfg.get("variant_load") or 1000)
    lines += ["", f"## Stage breakdown at {stage_load:g} ev/s (p50 / p99, ms)", ""]
    srows = []
    for r in summary["latency"]:
        if r["load"] != stage_load or r["arrival"] != "constant" or r["producer"] != "sql":
            continue
        s = r["stages"]
        srows.append(
            [
                r["mode"],
                *(f"{num(s[k]['p50'])} / {num(s[k]['p99'])}" for k in s),
                num(r["mode_cpu_us_per_event"], 0),
                num(100 * r["host_cpu_busy"], 0),
            ]
        )
    lines += table(
        (
            "mode | schedule -> send (generator lag) | send -> commit ack | "
            "commit ack -> Kafka send (±0.5 ms) | Kafka send -> receive | "
            "relay/poller CPU µs per event | host CPU busy %"
        ),
        srows,
    )
    lines += [
        "",
        "The Kafka send time is the record's CreateTime, stamped by the publishing producer "
        "at `send()` with millisecond resolution.",
    ]
    lines += _stage_log_lines(summary)
    lines += _cost_lines(summary)
    for c in result.get("latency_cells", []):
        if c.get("profile"):
            lines += profile_lines(
                f"{c['mode']} at {c['load']:g} ev/s, {c['arrival']}/{c['producer']} "
                f"(relay CPU {num(c.get('mode_cpu_us_per_event'), 0)} µs per event)",
                c["profile"],
            )
    lines += [
        "",
        "## Producer overhead (single-row INSERT transactions, as fast as possible)",
        "",
    ]
    lines += grid(
        summary["producer"],
        ("variant", lambda r: r["variant"]),
        ("writers", lambda r: str(r["writers"])),
        ("commits/s", lambda r: num(r["commits_per_s"])),
        ("latency p50", lambda r: num(r["p50"], 3)),
        ("p99", lambda r: num(r["p99"], 3)),
        *((f"vs {ref}", lambda r, ref=ref: pct(r[f"vs_{ref}"])) for ref in _PRODUCER_REFS),
    )
    variants = result.get("variants", {})
    lines += [""] + [f"- `{n}`: {v['description']}" for n, v in variants.items()]
    lines += [
        f"- driver: {result.get('producer_driver', '-')}, "
        f"{cfg['producer_seconds']:g} s per cell, {cfg['producer_repeat']} repetition(s)",
        "",
        f"## Idle load (no traffic, {cfg['idle_seconds']:g} s, all modes at once, each on its own "
        "database)",
        "",
    ]
    lines += table(
        "mode | queries/s (pg_stat_statements) | commits/s (pg_stat_database) | process CPU %",
        [
            [m, num(i["queries_per_s"]), num(i["commits_per_s"]), num(i["cpu_percent"])]
            for m, i in summary["idle"].items()
        ],
    )
    lines += modes_section(result)
    if plots:
        lines += ["", "## Plots", ""]
        lines += [f"![{p}]({p})" for p in plots]
    notes = list(result.get("notes", [])) + [f"ERROR: {e}" for e in result.get("errors", [])]
    if notes:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def _cost_lines(summary: dict[str, Any]) -> list[str]:
    """CPU per event at each steady load: the mode's process, the database, and the
    database's share added by the mode (against the same writers with no relay)."""
    rows = [
        r
        for r in summary["latency"]
        if r["arrival"] == "constant"
        and r["producer"] == "sql"
        and not math.isnan(r.get("db_cpu_us_per_event", math.nan))
    ]
    if not rows:
        return []
    base = summary.get("db_baseline", {})
    lines = [
        "",
        "## Cost per event at steady load (CPU µs per event, from /proc)",
        "",
        "Over each cell from its first event to the outbox emptied; **no relay** is the same "
        "writers and load into an outbox with the same triggers that no relay serves (so its "
        "commits NOTIFY every time), in the same rounds; **added** is the mode's database CPU "
        "minus that.",
        "",
    ]
    lines += table(
        "mode | offered ev/s | relay/poller | database | database, no relay | added by the mode",
        [
            [
                r["mode"],
                num(r["load"]),
                num(r["mode_cpu_us_per_event"], 0),
                num(r["db_cpu_us_per_event"], 0),
                num(base.get(r["load"]), 0),
                num(r.get("db_added_us_per_event"), 0),
            ]
            for r in rows
        ],
    )
    return lines


def _row_label(r: dict[str, Any]) -> str:
    """A latency row's mode, with its arrival and producer when they are not the default."""
    main = r["arrival"] == "constant" and r["producer"] == "sql"
    return str(r["mode"]) + ("" if main else f" ({r['arrival']}, {r['producer']})")


def _stage_log_lines(summary: dict[str, Any]) -> list[str]:
    """The "Where the time goes" section: the relay's stage log joined with every measured
    event."""
    rows = [r for r in summary["latency"] if r.get("stage_log")]
    if not rows:
        return []
    lines = [
        "",
        "## Where the time goes (relay stage log, p50 / p99, ms)",
        "",
        "Per measured event, the claim that carried it (the relay's `NOTIFY_OUTBOX_STAGE_LOG` "
        "line), joined with the generator's commit ack and the consumer's receipt; medians over "
        "rounds. **notified -> woken** is from the commit ack when no notification led to the "
        "claim. The Kafka CreateTime has millisecond resolution (the middle of its millisecond "
        "is taken: ±0.5 ms) and is stamped at each record's `send()`, before *handed* (after "
        "the last one). A negative interval counts as 0; the share of them is in brackets "
        "(commit ack -> notified < 0: the event was committed after the notification that led "
        "to its claim). **no stage log**: the relay wrote no line for the cell's events.",
        "",
    ]
    out = []
    for r in rows:
        s = r["stage_log"]
        if s["status"] != "ok":
            out.append([_row_label(r), f"{r['load']:g}", s["status"], *("-" for _ in STAGES), "-"])
            continue
        sources = ", ".join(f"{k} {pct(v)}" for k, v in s["sources"].items())
        out.append(
            [
                _row_label(r),
                f"{r['load']:g}",
                f"{s['claims']:,}: {sources}",
                *(_stage_cell(s["stages"][k]) for k in STAGES),
                f"{s['missing_lines']:,} of {s['events']:,}"
                + (
                    f" ({s['rounds_without']} round(s) without a log)"
                    if s["rounds_without"]
                    else ""
                ),
            ]
        )
    return lines + table(
        ["mode", "offered ev/s", "claims: wake sources", *STAGES.values(), "events without a line"],
        out,
    )


def _stage_cell(st: dict[str, Any]) -> str:
    text = f"{num(st['p50'])} / {num(st['p99'])}"
    neg = st.get("negative")
    if neg is None or math.isnan(neg) or neg < 0.005:  # shown from 1 % (rounded)
        return text
    return f"{text} ({pct(neg)} <0)"


def _over_floor_section(summary: dict[str, Any]) -> list[str]:
    """The ack->recv of every mode against the Kafka floor's in the same round."""
    rows = summary.get("over_floor") or []
    if not rows:
        return []
    lines = [
        "",
        "## Over the Kafka floor (ack->recv, ms)",
        "",
        "The floor sends every event straight to Kafka with the relay's producer settings, no "
        "database in the path; its commit ack is the hand-over to `send()`. **over** is the "
        "median over rounds of the mode's value minus the floor's in the same round.",
        "",
    ]
    return lines + grid(
        rows,
        ("offered ev/s", lambda r: f"{r['load']:g}"),
        ("mode", lambda r: r["mode"]),
        ("p50", lambda r: num(r["p50"])),
        ("floor p50", lambda r: num(r["floor_p50"])),
        ("over p50", lambda r: signed(r["over_p50"])),
        ("p99", lambda r: num(r["p99"])),
        ("floor p99", lambda r: num(r["floor_p99"])),
        ("over p99", lambda r: signed(r["over_p99"])),
    )


def floor_lines(result: dict[str, Any]) -> list[str]:
    """The "Over the Kafka floor" table of a run's result (empty without a floor), for the
    terminal at the end of a run."""
    if not _floor_modes(result):
        return []
    return [line for line in _over_floor_section(summarize(result)) if line.startswith("|")]


def write_run_report(json_path: Path, *, plots: bool = True) -> Path:
    """Write ``<stem>.md`` (and the PNG plots) next to a latency run's result JSON; returns
    the md path."""
    result = json.loads(json_path.read_text())
    summary = summarize(result)
    names: list[str] = []
    if plots:
        try:
            from bench.plots import make_plots
        except ImportError as e:  # matplotlib is optional: the tables do not need it
            result.setdefault("notes", []).append(f"plots skipped: {e}")
        else:
            paths = make_plots(result, summary, json_path.parent, json_path.stem)
            names = [p.name for p in paths]
    md = json_path.with_suffix(".md")
    md.write_text(render_markdown(result, summary, names))
    return md
