"""The latency run's cost per event: the database CPU a mode adds is its own minus that of the
same writers with no relay at the same load, medians over rounds (bench/report.py)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from bench.report import render_markdown, summarize

# A run with a floor, the notify relay, the poller and the cells without a relay.
RUN = Path(__file__).resolve().parents[2] / "bench" / "results" / "20261129T124142Z.json"


def _with_db_cpu(result: dict[str, Any], mode: float, baseline: dict[float, list[float]]) -> None:
    """Every notify cell at ``mode`` µs per event; the cells without a relay, per load, at the
    given values in turn."""
    for c in result["latency_cells"]:
        if c["mode"] == "notify":
            c["db_cpu_us_per_event"] = mode
    seen: dict[float, int] = {}
    for c in result["baseline_cells"]:
        load = float(c["load"])
        c["db_cpu_us_per_event"] = baseline[load][seen.get(load, 0)]
        seen[load] = seen.get(load, 0) + 1


def _row(summary: dict[str, Any], mode: str, load: float) -> dict[str, Any]:
    (row,) = [
        r
        for r in summary["latency"]
        if (r["mode"], r["load"], r["arrival"], r["producer"]) == (mode, load, "constant", "sql")
    ]
    return row


def test_what_the_relay_adds_is_its_database_cpu_minus_the_writers_alone() -> None:
    result = json.loads(RUN.read_text())
    assert {c["load"] for c in result["baseline_cells"]} == {100.0, 1000.0}
    _with_db_cpu(result, 900.0, {100.0: [500.0, 700.0, 600.0], 1000.0: [800.0, 850.0, 950.0]})
    summary = summarize(result)
    assert summary["db_baseline"] == {100.0: 600.0, 1000.0: 850.0}
    assert _row(summary, "notify", 100.0)["db_added_us_per_event"] == 300.0
    assert _row(summary, "notify", 1000.0)["db_added_us_per_event"] == 50.0
    verdicts = {t["target"]: (t["measured"], t["verdict"]) for t in summary["targets"]}
    assert verdicts["notify @ 100 ev/s, CPU per event: database added by the relay <= 1000 µs"] == (
        "300 µs (900 with the relay, 600 without)",
        "met",
    )
    assert verdicts["notify @ 1000 ev/s, CPU per event: database added by the relay <= 150 µs"] == (
        "50.0 µs (900 with the relay, 850 without)",
        "met",
    )
    text = render_markdown(result, summary, [])
    assert "| notify | 100 | " in text.split("## Cost per event at steady load")[1]


def test_without_cells_without_a_relay_the_added_cost_is_not_measured() -> None:
    result = json.loads(RUN.read_text())
    older = copy.deepcopy(result)
    older["baseline_cells"] = []
    summary = summarize(older)
    verdicts = {t["target"]: (t["measured"], t["verdict"]) for t in summary["targets"]}
    key = "notify @ 1000 ev/s, CPU per event: database added by the relay <= 150 µs"
    assert verdicts[key] == ("not measured (no cells without a relay)", "n/a")
    # A result from before the database was measured at all renders without the section.
    for c in older["latency_cells"]:
        c.pop("db_cpu_us_per_event", None)
    assert "## Cost per event" not in render_markdown(older, summarize(older), [])
