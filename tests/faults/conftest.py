"""Fixtures of the fault suite, and the run's figures (tests/faults/last_run.json)."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import Services
from tests.faults.checker import FIGURES

LAST_RUN = Path(__file__).with_name("last_run.json")
_started = time.monotonic()


@pytest.fixture(autouse=True)
def _services_back_up(services: Services, caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """A test that stops PostgreSQL or Kafka and then fails must not take the rest of the
    session down with it: bring both back after every test. (Also: the test's own Kafka
    clients log an error per reconnect attempt during an outage, which is expected; keep
    only their critical lines, so a failure report shows what matters.)"""
    caplog.set_level(logging.CRITICAL, logger="aiokafka")
    yield
    from devstack import KafkaBroker, PostgresServer

    if isinstance(services.postgres, PostgresServer) and not services.postgres.is_running():
        services.postgres.start()
    if isinstance(services.kafka, KafkaBroker) and not services.kafka.is_running():
        services.kafka.start()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if not FIGURES.checks and not FIGURES.recoveries:
        return
    summary = FIGURES.summary()
    summary["wall_seconds"] = round(time.monotonic() - _started, 1)
    summary["exit_status"] = int(exitstatus)
    LAST_RUN.write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not FIGURES.checks and not FIGURES.recoveries:
        return
    s = FIGURES.summary()
    write = terminalreporter.write_line
    terminalreporter.section("fault suite figures")
    write(
        f"invariant checks: {s['scenarios_checked']}, events checked: {s['events_checked']}, "
        f"lost: {s['lost']}, phantom: {s['phantom']}, duplicates: {s['duplicates']} "
        f"{s['duplicates_by_fault']}, order violations: {s['order_violations']}"
    )
    for kind, seconds in s["longest_recovery_s"].items():
        write(f"longest recovery, {kind}: {seconds:.2f}s (of {len(s['recoveries_s'][kind])})")
    for name, value in s["notes"].items():
        write(f"{name}: {value}")
    if s["failed_checks"]:
        write(f"FAILED checks: {', '.join(s['failed_checks'])}")
    write(f"figures written to {LAST_RUN}")
