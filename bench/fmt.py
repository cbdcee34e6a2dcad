"""How the bench writes figures, in its markdown reports and on the terminal: numbers (``-``
for a value that is missing), milliseconds, percentages, markdown tables, and the report parts
every result shares (the environment bullets, the modes, targets, plots and notes sections).
Only formatting: no module of the bench is imported but ``bench.revs`` (revision names)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

from bench.revs import revision_text

# --- numbers --------------------------------------------------------------------------------


def num(v: Any, digits: int = 2) -> str:
    """A figure of a report: ``-`` when missing (None, NaN); a float with ``digits`` decimals
    below 10, one from 10, none from 100; anything else as ``str``."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, float):
        if abs(v) >= 100:
            return f"{v:.0f}"
        if abs(v) >= 10:
            return f"{v:.1f}"
        return f"{v:.{digits}f}"
    return str(v)


def opt(v: float | None, spec: str, none: str = "-") -> str:
    """``v`` in the format ``spec``, or ``none`` when it is missing."""
    return none if v is None else format(v, spec)


def whole(v: float | None) -> str:
    """A rate or a count as a whole number with thousands separators (``12,345``)."""
    return opt(v, ",.0f")


def ms(v: float | None) -> str:
    """Milliseconds with their unit, one decimal (``12.3 ms``)."""
    return "-" if v is None else f"{v:.1f} ms"


def ms_aligned(v: float | None) -> str:
    """Milliseconds in a column 7 wide (a terminal line per cell): two decimals below 10."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "   -   "
    return f"{v:7.1f}" if v >= 10 else f"{v:7.2f}"


def pct(v: float | None) -> str:
    """A share as a whole percentage with its sign (``0.123`` -> ``12%``)."""
    return "-" if v is None or math.isnan(v) else f"{100 * v:.0f}%"


def share(v: float | None) -> str:
    """A share as a whole percentage, without the sign (a column headed ``%``)."""
    return "-" if v is None else f"{100 * v:.0f}"


def percent(v: float | None) -> float | None:
    """A share as a percentage (None stays None)."""
    return None if v is None else 100 * v


def signed(v: float | None) -> str:
    """``num`` with a ``+`` before a positive figure (a difference)."""
    text = num(v)
    return text if text == "-" or text.startswith("-") else f"+{text}"


# --- markdown -------------------------------------------------------------------------------


def table(head: str | list[str], rows: list[list[str]]) -> list[str]:
    """A markdown table's lines; ``head`` as a list of column headings, or as the heading row
    itself (``"mode | p50 | p99"``)."""
    if isinstance(head, str):
        head = head.split(" | ")
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return lines


Column = tuple[str, Callable[[Any], str]]


def grid(rows: Iterable[Any], *columns: Column) -> list[str]:
    """A markdown table with a row per item of ``rows``: ``columns`` are (heading, the cell of
    an item)."""
    return table([h for h, _ in columns], [[cell(r) for _, cell in columns] for r in rows])


def tables_under(text: str, heads: tuple[str, ...]) -> list[str]:
    """The first table under each of the sections whose heading starts with one of ``heads``
    (in that order), each with its heading: a report's main tables for the terminal."""
    lines = text.splitlines()
    out: list[str] = []
    for head in heads:
        start = next((i for i, line in enumerate(lines) if line.startswith(head)), None)
        if start is None:
            continue
        first = start + 2
        while first < len(lines) and not lines[first].startswith("|"):
            first += 1
        end = first
        while end < len(lines) and lines[end].startswith("|"):
            end += 1
        out += [lines[start], *lines[first:end], ""]
    return out


def profile_lines(title: str, prof: dict[str, Any]) -> list[str]:
    """A profiled cell's functions with the most own time (``bench.profile.top_self``)."""
    if not prof.get("samples"):
        return []
    lines = ["", f"## Profile: {title} (py-spy, {prof['samples']:,} samples, `{prof['file']}`)", ""]
    return lines + table(
        ["function (own time)", "share"],
        [[f"`{t['function']}`", f"{100 * t['share']:.1f}%"] for t in prof["top"]],
    )


def environment_lines(result: dict[str, Any]) -> list[str]:
    """The markdown bullets describing the machine, services, revision and noise of a run."""
    env = result.get("environment", {})
    host = env.get("host", {})
    pg = env.get("postgres", {}).get("settings", {})
    git = env.get("git", {})
    fs = env.get("fdatasync_probe", {})
    ptf = env.get("pg_test_fsync", {})
    pgb = env.get("pgbouncer", {})
    pooler = (
        [
            f"- PgBouncer (pooled modes): {pgb.get('version')}, {pgb.get('pool_mode')} pooling, "
            f"default_pool_size {pgb.get('settings', {}).get('default_pool_size')}"
            + ("; it was NOT running at the end" if pgb.get("running_at_end") is False else "")
        ]
        if pgb.get("ran")
        else []
    )
    return [
        f"- machine: {host.get('cpu_model')} x{host.get('cores')} cores, "
        f"{host.get('memory_gib')} GiB, kernel {host.get('kernel')}, Python {host.get('python')}",
        f"- fsync: fdatasync probe median {fs.get('median_us')} µs"
        + (
            f"; pg_test_fsync fdatasync {ptf.get('fdatasync_us_per_op')} µs/op"
            if ptf.get("fdatasync_us_per_op")
            else ""
        ),
        f"- PostgreSQL {pg.get('server_version')}: "
        f"synchronous_commit={pg.get('synchronous_commit')}, fsync={pg.get('fsync')}, "
        f"shared_buffers={pg.get('shared_buffers')}, "
        f"wal_sync_method={pg.get('wal_sync_method')}; Kafka "
        f"{env.get('kafka', {}).get('version')} (one broker, acks=all, idempotent producers)",
        *pooler,
        f"- git {str(git.get('revision'))[:12]} on {git.get('branch')}"
        + (" (uncommitted changes)" if git.get("dirty") else ""),
        *_compare_lines(result),
        f"- noise: load average {result.get('load_average_start')} at start, "
        f"{result.get('load_average_end')} at end; host CPU busy "
        f"{num(100 * (result.get('host_cpu_busy') or math.nan), 0)}% over "
        f"{num(result.get('wall_seconds'), 0)} s",
    ]


def _compare_lines(result: dict[str, Any]) -> list[str]:
    """With ``--compare-rev``: which revision ran where."""
    alt = result.get("config", {}).get("alt_revision")
    if not alt:
        return []
    git = result.get("environment", {}).get("git", {})
    return [
        f"- **compared** (`--compare-rev {alt['ref']}`): the `-alt` modes (recovery and "
        f"stalled-relay: the relay itself) ran {revision_text(alt)}; the others this checkout, "
        f"{revision_text(git)}"
    ]


def mode_bullets(result: dict[str, Any]) -> list[str]:
    """One bullet per mode: its description, and with ``--compare-rev`` its revision."""
    return [
        f"- `{n}`: {m['description']}"
        + (f"; {revision_text(m['revision'])}" if m.get("revision") else "")
        for n, m in result.get("modes", {}).items()
    ]


def modes_section(result: dict[str, Any]) -> list[str]:
    """The "Modes" section: ``mode_bullets`` under a heading."""
    return ["", "## Modes", "", *mode_bullets(result)]


def targets_section(summary: dict[str, Any], source: str) -> list[str]:
    """The targets section (target, measured, verdict) of a summary, if it has any."""
    if not summary["targets"]:
        return []
    return [
        "",
        f"## Targets ({source})",
        "",
        *table(
            "target | measured | verdict",
            [[t["target"], t["measured"], t["verdict"]] for t in summary["targets"]],
        ),
    ]


def finish(lines: list[str], result: dict[str, Any], plots: list[str], problems: list[str]) -> str:
    """A regime report's end: its plots, then the notes (the run's, a check that failed, an
    error of the run), as the markdown text."""
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
