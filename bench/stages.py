"""The relay's stage log (``run --stages``): where an event's time goes between its commit and
the consumer.

With ``NOTIFY_OUTBOX_STAGE_LOG`` naming a file, the relay writes one JSON object per line per
claim that returned rows: ``src`` (what woke the worker: "notify", "backlog", "linger",
"poll", "retry"), ``notified`` (the listener's receipt of the notification that led to the
claim, or null), ``woken``, ``start`` (just before the claim's BEGIN), ``rows``, ``handed``
(every record handed to the producer), ``acked``, ``marked`` (all ``time.monotonic_ns()``,
one clock for every process of the host) and ``payloads`` (each row's payload as JSON text).

The bench gives each relay process of the latency phase a file of its own and, after each
cell, joins the lines that carried the cell's measured events (the payload's ``c`` and ``i``)
with the generator's commit ack and the consumer's receipt of each event. Figures are per
event: a claim counts once for every measured event it carried.
"""

from __future__ import annotations

import asyncio
import json
import time
from array import array
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from bench.analysis import by_index, window_indices
from bench.hist import Histogram

STAGE_LOG_ENV = "NOTIFY_OUTBOX_STAGE_LOG"

# Per event, in the order an event goes through them; the report's column titles.
STAGES: dict[str, str] = {
    "ack_to_notified": "commit ack -> notified",
    "to_woken": "notified -> woken (ack -> woken when not notified)",
    "woken_to_start": "woken -> claim start",
    "start_to_rows": "claim start -> rows",
    "rows_to_handed": "rows -> handed",
    "handed_to_create_time": "handed -> Kafka CreateTime (±0.5 ms)",
    "handed_to_acked": "handed -> acked",
    "acked_to_marked": "acked -> marked",
    "handed_to_recv": "handed -> consumer receipt",
}
_SETTLE = 1.0  # after a cell, how long lines still missing may take to appear


class StageLog:
    """One relay process's stage log, read as it grows."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.claims: list[dict[str, Any]] = []  # read and not yet taken by a cell
        self.bad_lines = 0
        self._offset = 0

    def read(self) -> int:
        """Read the lines written since the last call (complete ones only: the relay may be
        half-way through one); returns how many were new."""
        try:
            with self.path.open("rb") as fh:
                fh.seek(self._offset)
                data = fh.read()
        except FileNotFoundError:  # a relay that does not write one (yet)
            return 0
        end = data.rfind(b"\n") + 1
        self._offset += end
        new = 0
        for line in data[:end].splitlines():
            if not line.strip():
                continue
            try:
                claim = json.loads(line)
            except ValueError:
                claim = None
            if isinstance(claim, dict):
                self.claims.append(claim)
                new += 1
            else:
                self.bad_lines += 1
        return new


def _carried(claims: Iterable[dict[str, Any]], cell: int) -> tuple[dict[int, dict[str, Any]], int]:
    """Event index -> the claim that carried it, for the events of ``cell``; and how many were
    carried more than once (a claim that failed and was retried: the later line stands)."""
    out: dict[int, dict[str, Any]] = {}
    repeated = 0
    for claim in claims:
        for text in claim.get("payloads") or ():
            try:
                payload = json.loads(text)
                c, i = int(payload["c"]), int(payload["i"])
            except (ValueError, TypeError, KeyError):
                continue  # not one of the bench's events
            if c == cell:
                if i in out:
                    repeated += 1
                out[i] = claim
    return out, repeated


def _span(h: Histogram, start: int | None, end: int | None) -> None:
    """Record ``end - start`` (ns) when both are known; negative counts as 0 and is tallied."""
    if start is not None and end is not None:
        h.record_ns((int(end) - int(start),))


def analyse_stages(
    claims: Iterable[dict[str, Any]],
    gen: dict[str, array[int]],
    got: dict[str, array[int]],
    cell: int,
    window_start: int,
    window_end: int,
) -> dict[str, Any]:
    """Per stage, the distribution over the cell's measured, committed events (ms, with the
    share of negative intervals); the claims' wake sources; the events no line carried."""
    sched, ack = gen["sched"], gen["ack"]
    recv, kts = by_index(got, len(sched))
    events = [i for i in window_indices(sched, window_start, window_end) if ack[i]]
    carried, repeated = _carried(claims, cell)
    if not carried:
        return {"status": "no stage log", "events": len(events)}
    hists = {k: Histogram() for k in STAGES}
    used: dict[int, dict[str, Any]] = {}
    missing = 0
    for i in events:
        claim = carried.get(i)
        if claim is None:
            missing += 1
            continue
        used[id(claim)] = claim
        notified, handed = claim.get("notified"), claim.get("handed")
        _span(hists["ack_to_notified"], ack[i], notified)
        _span(hists["to_woken"], ack[i] if notified is None else notified, claim.get("woken"))
        _span(hists["woken_to_start"], claim.get("woken"), claim.get("start"))
        _span(hists["start_to_rows"], claim.get("start"), claim.get("rows"))
        _span(hists["rows_to_handed"], claim.get("rows"), handed)
        _span(hists["handed_to_acked"], handed, claim.get("acked"))
        _span(hists["acked_to_marked"], claim.get("acked"), claim.get("marked"))
        if recv[i]:
            _span(hists["handed_to_create_time"], handed, kts[i])
            _span(hists["handed_to_recv"], handed, recv[i])
    return {
        "status": "ok",
        "events": len(events),
        "missing_lines": missing,
        "carried_twice": repeated,
        "claims": len(used),
        "sources": dict(Counter(str(c.get("src")) for c in used.values()).most_common()),
        "stages": {
            k: {**h.summary_ms(), "negative": h.negative / h.count if h.count else None}
            for k, h in hists.items()
        },
    }


async def collect_stages(
    log: StageLog,
    gen: dict[str, array[int]],
    got: dict[str, array[int]],
    cell: int,
    window_start: int,
    window_end: int,
    *,
    settle: float = _SETTLE,
) -> dict[str, Any]:
    """``analyse_stages`` on what ``log`` holds once the cell is done (its rows are marked):
    a line the relay writes just after its mark may be a moment late, so while events lack
    one, the log is read again for up to ``settle`` seconds. The lines read are then let
    go."""
    log.read()
    stages = analyse_stages(log.claims, gen, got, cell, window_start, window_end)
    deadline = time.monotonic() + settle
    while stages.get("missing_lines") and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
        if log.read():
            stages = analyse_stages(log.claims, gen, got, cell, window_start, window_end)
    if log.bad_lines:
        stages["bad_lines"] = log.bad_lines  # not JSON objects: since the last cell
        log.bad_lines = 0
    log.claims.clear()
    return stages
