"""The stage breakdown of ``run --stages`` on a small synthetic stage log: the join of the
relay's claim lines with the generator's commit acks and the consumer's receipts, per event,
and its summary over rounds. No services."""

from __future__ import annotations

import asyncio
import json
from array import array
from pathlib import Path
from typing import Any

import pytest

from bench.report import _stage_log_lines, _stage_log_summary
from bench.stages import STAGES, StageLog, analyse_stages, collect_stages

MS = 1_000_000
T0 = 10_000 * MS
CELL = 7
N = 10


def _arrays() -> tuple[dict[str, array[int]], dict[str, array[int]], int, int]:
    """Ten events 1 ms apart, each committed 0.5 ms after its schedule, except event 5 (its
    commit failed); the window holds events 2 .. 8; the consumer got 2, 3, 4, 6 and 7, 10 ms
    after the commit, with a CreateTime 6 ms after it."""
    sched = array("q", (T0 + i * MS for i in range(N)))
    ack = array("q", (0 if i == 5 else t + MS // 2 for i, t in enumerate(sched)))
    got_index = [2, 3, 4, 6, 7]
    gen = {"sched": sched, "send": array("q", sched), "ack": ack}
    got = {
        "index": array("q", got_index),
        "recv": array("q", (ack[i] + 10 * MS for i in got_index)),
        "kafka_ts": array("q", (ack[i] + 6 * MS for i in got_index)),
    }
    return gen, got, sched[2], sched[9]


def _claim(src: str, notified: int | None, woken: int, payloads: list[str]) -> dict[str, Any]:
    start = woken + MS // 10
    rows = start + MS
    handed = rows + MS // 5
    acked = handed + 3 * MS
    return {
        "src": src,
        "notified": notified,
        "woken": woken,
        "start": start,
        "rows": rows,
        "handed": handed,
        "acked": acked,
        "marked": acked + MS,
        "payloads": payloads,
    }


def _payload(i: int, cell: int = CELL) -> str:
    # As PostgreSQL's jsonb prints it (the relay sends the stored text).
    return f'{{"c": {cell}, "i": {i}, "t": {T0 + i * MS}}}'


def _lines(gen: dict[str, array[int]]) -> tuple[str, str, str]:
    ack = gen["ack"]
    # A notification 0.5 ms after event 3's commit led to the claim of events 2 and 3 (and of
    # event 1, before the window); a line's foreign payloads are ignored.
    a = _claim(
        "notify",
        ack[3] + MS // 2,
        ack[3] + MS,
        [_payload(1), _payload(2), _payload(3), "not json", _payload(2, cell=CELL - 1)],
    )
    # No notification: a worker woke 1 ms after event 4's commit, before event 6's.
    b = _claim("backlog", None, ack[4] + MS, [_payload(4), _payload(6)])
    c = _claim("linger", None, ack[7] + MS, [_payload(7)])
    return json.dumps(a) + "\n", json.dumps(b) + "\n", json.dumps(c) + "\n"


def test_join_per_event_with_missing_lines_and_a_partial_line(tmp_path: Path) -> None:
    gen, got, start, end = _arrays()
    a, b, c = _lines(gen)
    path = tmp_path / "stages.jsonl"
    path.write_text(a + b + "{not a claim}\n" + c[:20])  # the relay is half-way through c
    log = StageLog(path)
    assert log.read() == 2
    assert log.bad_lines == 1

    s = analyse_stages(log.claims, gen, got, CELL, start, end)
    assert s["status"] == "ok"
    assert s["events"] == 6  # 2, 3, 4, 6, 7, 8: event 5 never committed
    assert s["missing_lines"] == 2  # 7 (its line is not complete yet) and 8 (none)
    assert s["claims"] == 2
    assert s["sources"] == {"notify": 1, "backlog": 1}
    st = s["stages"]
    # Events 2 and 3 were notified 1.5 and 0.5 ms after their commits.
    assert st["ack_to_notified"]["count"] == 2
    assert st["ack_to_notified"]["p50"] == pytest.approx(0.5, rel=0.01)
    assert st["ack_to_notified"]["max"] == pytest.approx(1.5, rel=0.01)
    # notified -> woken 0.5 ms (2, 3); ack -> woken 1 ms (4) and -1 ms (6: counted as 0).
    assert st["to_woken"]["count"] == 4
    assert st["to_woken"]["negative"] == pytest.approx(0.25)
    assert st["to_woken"]["max"] == pytest.approx(1.0, rel=0.01)
    for stage, ms in (
        ("woken_to_start", 0.1),
        ("start_to_rows", 1.0),
        ("rows_to_handed", 0.2),
        ("handed_to_acked", 3.0),
        ("acked_to_marked", 1.0),
    ):
        assert st[stage]["count"] == 4, stage
        assert st[stage]["p50"] == pytest.approx(ms, rel=0.01), stage
        assert st[stage]["negative"] == 0, stage
    # Received 10 ms after the commit; handed 2.3 ms after the wake: 7.7 ms for events 3 and
    # 4 (woken 1 ms after their commits), 6.7 for 2 (1 ms earlier), 9.7 for 6 (2 ms later).
    assert st["handed_to_recv"]["count"] == 4
    assert st["handed_to_recv"]["p50"] == pytest.approx(7.7, rel=0.01)
    assert st["handed_to_recv"]["max"] == pytest.approx(9.7, rel=0.01)
    # The CreateTime is 6 ms after the commit: 4 ms before the receipt.
    assert st["handed_to_create_time"]["count"] == 4
    assert st["handed_to_create_time"]["max"] == pytest.approx(5.7, rel=0.01)

    # The rest of line c arrives while the bench waits for it; event 8 never gets a line.
    with path.open("a") as fh:
        fh.write(c[20:])
    s = asyncio.run(collect_stages(log, gen, got, CELL, start, end, settle=0.2))
    assert s["missing_lines"] == 1
    assert s["claims"] == 3
    assert s["sources"] == {"notify": 1, "backlog": 1, "linger": 1}
    assert s["stages"]["handed_to_recv"]["count"] == 5
    assert log.claims == []  # let go once the cell has them


def test_a_relay_without_a_stage_log_reports_so(tmp_path: Path) -> None:
    gen, got, start, end = _arrays()
    log = StageLog(tmp_path / "never-written.jsonl")
    s = asyncio.run(collect_stages(log, gen, got, CELL, start, end))
    assert s == {"status": "no stage log", "events": 6}
    # Lines of other cells only: no stage log for this one either.
    other = _claim("notify", None, T0, [_payload(2, cell=CELL + 1)])
    assert analyse_stages([other], gen, got, CELL, start, end)["status"] == "no stage log"


def test_summary_over_rounds_and_its_table(tmp_path: Path) -> None:
    gen, got, start, end = _arrays()
    path = tmp_path / "stages.jsonl"
    path.write_text("".join(_lines(gen)))
    log = StageLog(path)
    log.read()
    ok = analyse_stages(log.claims, gen, got, CELL, start, end)
    summary = _stage_log_summary([ok, ok, {"status": "no stage log", "events": 6}])
    assert summary["rounds"] == 2
    assert summary["rounds_without"] == 1
    assert summary["claims"] == 6
    assert summary["sources"] == pytest.approx({"notify": 1 / 3, "backlog": 1 / 3, "linger": 1 / 3})
    assert summary["missing_lines"] == 2
    assert set(summary["stages"]) == set(STAGES)
    assert summary["stages"]["start_to_rows"]["p50"] == pytest.approx(1.0, rel=0.01)
    assert _stage_log_summary([{"status": "no stage log", "events": 6}]) == {
        "status": "no stage log",
        "rounds": 1,
    }

    row = {"mode": "notify", "load": 100.0, "arrival": "constant", "producer": "sql"}
    lines = _stage_log_lines(
        {
            "latency": [
                {**row, "stage_log": summary},
                {**row, "mode": "notify-alt", "stage_log": {"status": "no stage log"}},
                {**row, "mode": "poll-100ms"},  # no stage log asked: not in the table
            ]
        }
    )
    table = [line for line in lines if line.startswith("| notify")]
    assert len(table) == 2
    assert "notify 33%" in table[0]
    assert "(20% <0)" in table[0]  # ack -> woken of event 6, of 5 events
    assert "2 of 12 (1 round(s) without a log)" in table[0]
    assert "no stage log" in table[1]
    assert not any("poll-100ms" in line for line in lines)
