"""What the production-condition regimes (``held-snapshot``, ``failing-head``) share: their
modes, the join of the writers' and the consumer's per-event arrays, latency figures, medians
over rounds and the sampling of a mode's and the database's CPU."""

from __future__ import annotations

import dataclasses
import math
import statistics
from array import array
from collections.abc import Awaitable, Iterable
from typing import Any

from bench.config import MODES, Mode
from bench.drain import parse_mode
from bench.hist import Histogram
from bench.phase import PhaseRun
from bench.procs import BenchError, Child, cluster_cpu_seconds
from bench.services import Services, postmaster_pid

__all__ = [
    "DEFAULT_REGIME_MODES",
    "CpuMeter",
    "add_cell",
    "database_postmaster",
    "latency_ms",
    "median",
    "received_at",
    "regime_mode",
    "unfinished",
]

DEFAULT_REGIME_MODES = ("notify", "poller")


def regime_mode(name: str, alt_tree: str | None) -> Mode:
    """``notify`` (the relay, default settings), ``notify-alt`` (the same from the
    ``--alt-relay`` tree) or ``poller`` (the drain phase's plain poller: ``ORDER BY id LIMIT
    200 FOR UPDATE SKIP LOCKED`` every 0.1 s, ``--mark update``)."""
    if name == "notify":
        return MODES["notify"]
    if name == "notify-alt":
        if alt_tree is None:
            raise BenchError("mode notify-alt needs --alt-relay DIR")
        base = MODES["notify"]
        return dataclasses.replace(
            base,
            name=name,
            description=f"{base.description}; relay code from {alt_tree}",
            cwd=alt_tree,
        )
    if name == "poller":
        return parse_mode("poller", None).mode
    raise BenchError(f"unknown mode {name!r}: notify, notify-alt (with --alt-relay) or poller")


def received_at(got: dict[str, array[int]]) -> dict[int, int]:
    """Event index -> its first receipt (monotonic ns), from the consumer's arrays."""
    out: dict[int, int] = {}
    for i, r in zip(got["index"], got["recv"], strict=True):
        out.setdefault(int(i), int(r))
    return out


def latency_ms(h: Histogram) -> dict[str, float | None]:
    """count, p50, p99 and max of a histogram, in milliseconds (None when empty)."""
    if h.count == 0:
        return {"count": 0, "p50": None, "p99": None, "max": None}
    return {
        "count": h.count,
        "p50": h.value_at(50.0) / 1000.0,
        "p99": h.value_at(99.0) / 1000.0,
        "max": h.max_us / 1000.0,
    }


def median(values: Iterable[Any]) -> float | None:
    """The median of the numbers among ``values`` (None, NaN and missing values left out)."""
    vs = [
        float(v)
        for v in values
        if isinstance(v, int | float) and not (isinstance(v, float) and math.isnan(v))
    ]
    return statistics.median(vs) if vs else None


class CpuMeter:
    """CPU seconds of the mode's processes and of the PostgreSQL cluster (every process of its
    postmaster, from /proc; None when the server's processes are not visible here)."""

    def __init__(self, procs: list[Child], postmaster: int | None) -> None:
        self.procs = procs
        self.postmaster = postmaster

    def read(self) -> tuple[float, float | None]:
        """(mode CPU seconds, database CPU seconds)."""
        db = cluster_cpu_seconds(self.postmaster) if self.postmaster is not None else None
        return sum(p.cpu() for p in self.procs), db


async def database_postmaster(services: Services, run: PhaseRun) -> int | None:
    """The postmaster whose processes' CPU is "the database's" (recorded; a note when it is
    not visible, or when it is not the bench's own server)."""
    pid = await postmaster_pid(services.dsn)
    run.result["postmaster_pid"] = pid
    if pid is None:
        run.notes.append(
            "the PostgreSQL server's processes are not visible on this host: no database CPU"
        )
    elif not services.own_stack:
        run.notes.append(
            "database CPU is the whole cluster's: with given services, other databases' work "
            "counts too"
        )
    return pid


async def add_cell(
    run: PhaseRun,
    cells: list[dict[str, Any]],
    identity: dict[str, Any],
    label: str,
    measure: Awaitable[dict[str, Any]],
) -> None:
    """Run one cell and append its record; a cell the bench could not finish is recorded
    with its error (the other cells still run). The JSON is rewritten after every cell, so a
    long run keeps what it has if it is stopped."""
    try:
        cell = await measure
    except BenchError as e:
        cell = {"cell": len(cells) + 1, **identity, "error": str(e)}
        run.errors.append(f"{label}: {e}")
        run.progress.line(f"{label}: FAILED: {e}", cell=True)
    cells.append(cell)
    run.write()


def unfinished(cell: dict[str, Any], where: str, needs: str) -> list[str]:
    """The problem of a cell that failed or has no ``needs`` (its analysis)."""
    if "error" in cell or needs not in cell:
        return [f"{where}: did not finish: {cell.get('error', 'no analysis')}"]
    return []
