"""The backlog-drain, outage-recovery, held-snapshot, failing-head, stalled-relay and
eos-freeze phases of the bench, tiny, end to end: they must run, deliver every row (in per-key
order where that is checked), and write their result and report. Nothing here looks at speed
(the machines are shared and noisy)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from devstack.relayproc import child_env, relay_env
from tests.conftest import Services
from tests.support import ROOT

DRAIN_TIMEOUT = 120
RECOVERY_TIMEOUT = 180


def _bench(
    args: list[str], env: dict[str, str], timeout: float
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "bench", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.mark.timeout(DRAIN_TIMEOUT + 30)
def test_drain_delivers_every_row_in_key_order(services: Services, tmp_path: Path) -> None:
    rows = 2000
    done = _bench(
        [
            "drain",
            *("--rows", str(rows), "--mixes", "keys-1000"),
            # relay-1-pgbouncer: the relay's workers through the bench's own PgBouncer.
            *("--modes", "relay-1", "relay-1-pgbouncer", "poller"),
            *("--out", str(tmp_path), "--cell-timeout", "60"),
        ],
        relay_env(services.dsn, services.bootstrap),
        DRAIN_TIMEOUT,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    (path,) = tmp_path.glob("drain-*.json")
    result = json.loads(path.read_text())
    cells = result["cells"]
    assert {c["mode"] for c in cells} == {"relay-1", "relay-1-pgbouncer", "poller"}
    assert result["environment"]["pgbouncer"]["ran"], result["environment"]["pgbouncer"]
    for c in cells:
        assert not c["timed_out"], c
        assert c["unique"] == rows, c
        assert c["order_violations"] == 0, c
        assert c["keyed"] == rows, c
        assert c["pending_after"] == 0, c
        assert c["rate_first_last"] is not None, c
    assert path.with_suffix(".md").is_file()
    assert path.with_suffix(".png").is_file()


@pytest.mark.timeout(RECOVERY_TIMEOUT + 30)
def test_recovery_after_a_kafka_restart(services: Services, tmp_path: Path) -> None:
    from devstack import KafkaBroker, PostgresServer

    args = ["recovery", "--repeat", "1", "--services", "kafka", "--settle", "2"]
    args += ["--out", str(tmp_path), "--no-plots"]
    if isinstance(services.kafka, KafkaBroker) and isinstance(services.postgres, PostgresServer):
        # The tests' own devstack stack: the bench restarts its broker (as the fault suite
        # does) instead of starting a second stack.
        base = services.kafka.base_dir.parent
        assert services.postgres.base_dir.parent == base
        args += ["--stack-dir", str(base)]
    # Otherwise no service variables: the bench starts a stack of its own, which it may restart.
    done = _bench(args, child_env(), RECOVERY_TIMEOUT)
    assert done.returncode == 0, done.stderr[-4000:]
    (path,) = tmp_path.glob("recovery-*.json")
    result = json.loads(path.read_text())
    assert result["events"]["missing"] == 0, result["events"]
    assert result["events"]["acked"] > 0
    (restart,) = result["restarts"]
    assert restart["service"] == "kafka"
    assert restart["first_delivery_after_up_s"] is not None, restart
    # The relay logged the outage (quietly: the kinds of its lines are counted).
    assert restart["log_lines"] >= 1, restart
    kinds = [kind for kind, _count in restart["log_kinds"]]
    assert any("notify_outbox.relay: Kafka unavailable" in kind for kind in kinds), kinds
    # The relay's transactions were looked at through the outage, and all of them ended.
    xact = restart["xact"]
    assert xact["samples"] > 0, xact
    assert not xact["errors"], xact
    assert xact["clear_after_stop_s"] is not None, xact
    assert path.with_suffix(".md").is_file()


HELD_TIMEOUT = 150
FAILING_TIMEOUT = 240


@pytest.mark.timeout(HELD_TIMEOUT + 30)
def test_held_snapshot_runs_both_modes(services: Services, tmp_path: Path) -> None:
    args = ["held-snapshot", "--baseline", "3", "--hold", "5", "--recovery", "3"]
    args += ["--rate", "200", "--warmup", "2", "--out", str(tmp_path)]
    done = _bench(args, relay_env(services.dsn, services.bootstrap), HELD_TIMEOUT)
    assert done.returncode == 0, done.stderr[-4000:]
    (path,) = tmp_path.glob("held-snapshot-*.json")
    result = json.loads(path.read_text())
    # The unmeasured warm-up ran through the relay before the first cell.
    assert result["warmup"]["writers"]["acked"] > 0, result["warmup"]
    assert result["warmup"]["exit_code"] in (0, -15), result["warmup"]
    cells = result["cells"]
    assert {c["mode"] for c in cells} == {"notify", "poller"}
    for c in cells:
        assert c["events"]["acked"] > 0, c["events"]
        assert c["events"]["received"] == c["events"]["acked"], c["events"]
        assert [w["phase"] for w in c["windows"]] == ["baseline", "hold", "recovery"], c
        assert all(w["committed"] > 0 for w in c["windows"]), c["windows"]
        # The snapshot's first statement counted this cell's fresh outbox: never more rows than
        # were written, and for the poller (which marks rows and never deletes them) at least every
        # row acknowledged before the hold began. The relay deletes what it sent, so its count is
        # the backlog of that instant and has no lower bound.
        baseline = sum(w["committed"] for w in c["windows"] if w["phase"] == "baseline")
        low = baseline if c["mode"] == "poller" else 0
        assert low <= c["snapshot_count"] <= c["events"]["acked"], (c["snapshot_count"], baseline)
        if c["mode"] == "poller":
            assert c["snapshot_count"] > 0, c["snapshot_count"]
        assert c["windows"][-1]["dead_tuples"] is not None, c["windows"]
    assert path.with_suffix(".md").is_file()
    assert path.with_suffix(".png").is_file()


@pytest.mark.timeout(FAILING_TIMEOUT + 30)
def test_failing_head_runs_both_modes(services: Services, tmp_path: Path) -> None:
    args = ["failing-head", "--failing-rows", "200", "--healthy-timeout", "10"]
    args += ["--quiet", "2", "--quiet-settle", "1", "--out", str(tmp_path)]
    done = _bench(args, relay_env(services.dsn, services.bootstrap), FAILING_TIMEOUT)
    assert done.returncode == 0, done.stderr[-4000:]
    (path,) = tmp_path.glob("failing-head-*.json")
    result = json.loads(path.read_text())
    cells = result["cells"]
    assert {c["mode"] for c in cells} == {"notify", "poller"}
    for c in cells:
        assert c["tried"], c
        assert c["healthy"]["acked"] == 300, c["healthy"]
        assert c["quiet"]["seconds"] > 0, c["quiet"]
        # The failing topic must still not exist: the broker did not create it.
        assert c["failing_topic_exists_after"] is False, c
        assert c["end_state"]["failing_left"] > 0, c["end_state"]
    assert path.with_suffix(".md").is_file()
    assert path.with_suffix(".png").is_file()


STALLED_TIMEOUT = 150


@pytest.mark.timeout(STALLED_TIMEOUT + 30)
def test_stalled_relay_freezes_one_relay_and_loses_nothing(
    services: Services, tmp_path: Path
) -> None:
    args = ["stalled-relay", "--keys", "20", "--rate", "100", "--repeat", "1"]
    args += ["--warmup", "1", "--baseline", "2", "--freezes", "2", "--freeze", "1"]
    args += ["--gap", "1", "--recovery", "1", "--out", str(tmp_path)]
    done = _bench(args, relay_env(services.dsn, services.bootstrap), STALLED_TIMEOUT)
    assert done.returncode == 0, done.stderr[-4000:]
    (path,) = tmp_path.glob("stalled-relay-*.json")
    result = json.loads(path.read_text())
    cells = result["cells"]
    assert {c["notify_mode"] for c in cells} == {"gated", "always"}
    for c in cells:
        assert c["events"]["acked"] > 0, c["events"]
        assert c["events"]["missing"] == 0, c["events"]
        assert c["phases"]["baseline"]["committed"] > 0, c["phases"]
        assert c["phases"]["freeze"]["committed"] > 0, c["phases"]
        assert len(c["freezes"]) == 2
        for f in c["freezes"]:
            assert f["confirmed_stopped"], f
            # The frozen relay's sessions were found by their client ports.
            assert f["frozen"]["sessions"] >= 1, f["frozen"]
        # Both relays were continued, and stopped cleanly.
        assert c["exit_codes"] == [0, 0], c["exit_codes"]
    assert path.with_suffix(".md").is_file()
    assert path.with_suffix(".png").is_file()


EOS_FREEZE_TIMEOUT = 180


@pytest.mark.timeout(EOS_FREEZE_TIMEOUT + 30)
def test_eos_freeze_holds_the_lso_while_a_relay_is_frozen_mid_transaction(
    services: Services, tmp_path: Path
) -> None:
    args = ["eos-freeze", "--settings", "2/2", "--warmup", "1", "--baseline", "2"]
    args += ["--freeze", "5", "--after", "2", "--out", str(tmp_path)]
    done = _bench(args, relay_env(services.dsn, services.bootstrap), EOS_FREEZE_TIMEOUT)
    assert done.returncode == 0, done.stderr[-4000:]
    (path,) = tmp_path.glob("eos-freeze-*.json")
    (c,) = json.loads(path.read_text())["cells"]
    assert c["latency"]["events"]["missing"] == 0, c["latency"]["events"]
    assert c["consumer"]["duplicates"] == 0
    # The frozen transaction held some partition's LSO, and it ended before the SIGCONT
    # (the lease of 2 s: the other relay took the slot over and fenced it).
    assert c["lso"]["held_max_s"] is not None
    assert c["lso"]["held_max_s"] < c["frozen_s"], c["lso"]["partitions"]
    assert c["exit_codes"] == [0, 0], c["exit_codes"]
    assert path.with_suffix(".md").is_file()


INBOX_TIMEOUT = 180


@pytest.mark.timeout(INBOX_TIMEOUT + 30)
def test_inbox_bench_applies_every_message_once_in_every_mode(
    services: Services, tmp_path: Path
) -> None:
    messages = 600
    args = ["inbox", "--messages", str(messages), "--repeat", "1", "--no-plots"]
    done = _bench(
        [*args, "--out", str(tmp_path)], relay_env(services.dsn, services.bootstrap), INBOX_TIMEOUT
    )
    assert done.returncode == 0, done.stderr[-4000:]
    (path,) = tmp_path.glob("inbox-*.json")
    cells = json.loads(path.read_text())["cells"]
    assert [c["mode"] for c in cells] == [
        "apply",
        "consume",
        "consume_batches",
        "consume_batches_parallel",
        "baseline",
    ]
    for c in cells:
        # Each message's row written exactly once (the bench's own check, read back here).
        assert c["rows"] == c["distinct"] == messages, c
        assert c["msg_per_s"] > 0, c
    assert path.with_suffix(".md").is_file()


FLEET_TIMEOUT = 240


@pytest.mark.timeout(FLEET_TIMEOUT + 30)
def test_fleet_serves_outboxes_of_two_databases_from_one_process(
    services: Services, tmp_path: Path
) -> None:
    args = ["fleet", "--outboxes", "4", "--databases", "2", "--per-outbox-procs", "2"]
    args += ["--repeat", "1", "--settle", "1", "--idle-window", "1", "--rate", "40"]
    args += ["--warmup", "0.5", "--latency-seconds", "2", "--no-floor", "--split"]
    args += ["--backlog-rows", "300", "--backlog-keys", "10", "--fairness-seconds", "2"]
    args += ["--lead", "1", "--held-backlog", "1", "--drain-timeout", "60", "--out", str(tmp_path)]
    done = _bench(args, relay_env(services.dsn, services.bootstrap), FLEET_TIMEOUT)
    assert done.returncode == 0, done.stderr[-4000:]
    (path,) = tmp_path.glob("fleet-*.json")
    result = json.loads(path.read_text())
    assert result["database"]["databases"] == 2
    cells = result["cells"]
    assert not [c for c in cells if "error" in c], cells
    # The fleet: one process for the outboxes of both databases; every event arrived.
    fleet = next(c for c in cells if c["kind"] == "fleet")
    assert fleet["processes"] == 1
    assert fleet["latency"]["acked"] > 0
    assert fleet["latency"]["missing"] == 0
    per_outbox = next(c for c in cells if c["kind"] == "per-outbox")
    assert per_outbox["processes"] == 2
    assert per_outbox["latency"]["missing"] == 0
    drained = [c for c in cells if c["kind"] == "fairness" and c["backlog"]]
    assert {c.get("setup", "fleet") for c in drained} == {"fleet", "split"}
    for c in drained:
        assert c["drain"]["received"] == 300, c["drain"]
        assert c["others"]["missing"] == 0, c["others"]
        # Held unannounced, then started by the NOTIFY: nothing of it arrived before that.
        assert c["backlog_insert"]["wake_ns"] > c["backlog_insert"]["ack_ns"]
        assert c["drain"]["first_after_s"] > 0, c["drain"]
    assert path.with_suffix(".md").is_file()
