"""The bench's smoke mode end to end against the test services: it must run every mode and
write a result, and says nothing about speed (the machines are shared and noisy)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.config import smoke_config
from devstack.relayproc import relay_env
from tests.conftest import Services
from tests.support import ROOT

SMOKE_TIMEOUT = 170


@pytest.mark.timeout(SMOKE_TIMEOUT + 30)
def test_smoke_run_writes_a_result_with_every_mode(services: Services, tmp_path: Path) -> None:
    env = relay_env(services.dsn, services.bootstrap)
    done = subprocess.run(
        [sys.executable, "-m", "bench", "smoke", "--out", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=SMOKE_TIMEOUT,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    results = list(tmp_path.glob("*.json"))
    assert len(results) == 1, sorted(p.name for p in tmp_path.iterdir())
    result = json.loads(results[0].read_text())
    modes = set(result["config"]["modes"])
    assert modes == set(smoke_config().modes)
    assert {"notify-pgbouncer", "relay-poll-pgbouncer", "floor"} <= modes
    assert {c["mode"] for c in result["latency_cells"]} == modes
    assert all(c["missing"] == 0 and c["events"] > 0 for c in result["latency_cells"])
    # The smoke asks for the relays' stage logs: every relay cell says what it found (a relay
    # that does not write one yet: "no stage log").
    relay_cells = [
        c for c in result["latency_cells"] if result["modes"][c["mode"]]["kind"] == "relay"
    ]
    assert relay_cells
    assert all(c["stage_log"]["status"] in ("ok", "no stage log") for c in relay_cells)
    # The database's CPU over every relay cell, and over the same writers with no relay at
    # each load the relays ran (the baseline of what a relay adds).
    assert result["postmaster_pid"], "the test PostgreSQL runs on this host: its CPU is visible"
    assert all(c["db_cpu_us_per_event"] > 0 for c in relay_cells)
    baseline = result["baseline_cells"]
    assert {c["load"] for c in baseline} == {c["load"] for c in relay_cells}, baseline
    assert all(c["db_cpu_us_per_event"] > 0 and c["events"] > 0 for c in baseline), baseline
    assert "## Cost per event at steady load" in results[0].with_suffix(".md").read_text()
    # The Kafka floor has no process of its own to idle.
    assert {i["mode"] for i in result["idle"]} == modes - {"floor"}
    assert {p["variant"] for p in result["producer_cells"]} == set(result["config"]["variants"])
    # The pooled modes ran through the bench's own PgBouncer, stopped at the end.
    pgbouncer = result["environment"]["pgbouncer"]
    assert pgbouncer["ran"], pgbouncer
    assert pgbouncer["pool_mode"] == "transaction", pgbouncer
    assert pgbouncer["version"].startswith("PgBouncer "), pgbouncer
    assert pgbouncer["running_at_end"], pgbouncer
    assert not _is_pgbouncer(pgbouncer["pid"]), "the bench left its PgBouncer running"
    # The pooled modes' transactions went through it (its own counters), and only theirs.
    prefix = f"bench_{result['run_id'].lower()}_"
    through = {
        db.removeprefix(prefix)
        for db, stats in pgbouncer["stats"].items()
        if db.startswith(prefix) and stats["transactions"] > 0
    }
    assert through == {"notify_pgbouncer", "relay_poll_pgbouncer"}, pgbouncer
    assert results[0].with_suffix(".md").is_file()
    # matplotlib is a dev dependency: the plots must be there.
    assert list(tmp_path.glob("*-latency-vs-load.png"))


def _is_pgbouncer(pid: int) -> bool:
    try:
        return b"pgbouncer" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
