"""The shipped Prometheus alert rules and Grafana dashboard: ``promtool check rules`` and
``promtool test rules`` (deploy/prometheus/notify-outbox-alerts.test.yml), and every metric
they name is one the relay exports.

promtool comes from Debian's ``prometheus`` package, installed when missing (as root); without
it the test fails and says what to install."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from notify_outbox import OutboxSettings, Relay
from notify_outbox.ops.metrics import RelayMetrics

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "notify-outbox-alerts.yml"
RULES_TEST = ROOT / "deploy" / "prometheus" / "notify-outbox-alerts.test.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "notify-outbox.json"
METRIC = re.compile(r"\bnotify_outbox_[a-z_]+\b")


@pytest.fixture(scope="module")
def promtool() -> Path:
    from devstack import StackError
    from devstack.prometheus import find_tool

    try:
        return find_tool("promtool")
    except StackError as e:
        pytest.fail(f"promtool is needed to test the alert rules: {e}", pytrace=False)


def _run(argv: list[str], cwd: Path) -> None:
    done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, f"{' '.join(argv)} failed:\n{done.stdout}\n{done.stderr}"


def test_promtool_checks_the_rules(promtool: Path) -> None:
    _run([str(promtool), "check", "rules", str(RULES)], RULES.parent)


def test_promtool_unit_tests_the_rules(promtool: Path) -> None:
    _run([str(promtool), "test", "rules", RULES_TEST.name], RULES_TEST.parent)


def test_every_alert_has_a_unit_test() -> None:
    rules = yaml.safe_load(RULES.read_text())
    alerts = {r["alert"] for g in rules["groups"] for r in g["rules"] if "alert" in r}
    tests = yaml.safe_load(RULES_TEST.read_text())
    tested = {t["alertname"] for case in tests["tests"] for t in case["alert_rule_test"]}
    assert alerts == tested


def exported_metrics() -> set[str]:
    """Every series name the relay's collectors can export."""
    settings = OutboxSettings(
        dsn="postgresql://u@127.0.0.1:1/db",  # type: ignore[arg-type]
        kafka_bootstrap_servers="127.0.0.1:1",
    )

    async def build() -> RelayMetrics:  # a Relay is made inside an event loop
        return RelayMetrics(Relay(settings))

    metrics = asyncio.run(build())
    names: set[str] = set()
    for collector in list(metrics.registry._collector_to_names):
        describe = getattr(collector, "describe", None)
        for family in describe() if describe else collector.collect():
            suffixes = {
                "counter": ["_total"],
                "histogram": ["_bucket", "_sum", "_count"],
            }.get(family.type, [""])
            names.update(family.name + s for s in suffixes)
    return names


def test_rules_and_dashboard_name_only_exported_metrics() -> None:
    exported = exported_metrics()
    assert "notify_outbox_pending_events" in exported
    rules = yaml.safe_load(RULES.read_text())
    used = {m for g in rules["groups"] for r in g["rules"] for m in METRIC.findall(r["expr"])}
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert exprs, "the dashboard has no queries"
    used |= {m for e in exprs for m in METRIC.findall(e)}
    assert used - exported == set()
    # The dashboard shows every metric of the issue.
    for name in (
        "notify_outbox_pending_events",
        "notify_outbox_oldest_pending_age_seconds",
        "notify_outbox_published_total",
        "notify_outbox_publish_failures_total",
        "notify_outbox_retries_total",
        "notify_outbox_dead_lettered_total",
        "notify_outbox_dead_letter_events",
        "notify_outbox_commit_to_ack_seconds_bucket",
        "notify_outbox_claim_batch_size_bucket",
        "notify_outbox_wakeups_total",
        "notify_outbox_up",
        "notify_outbox_awake",
    ):
        assert any(name in e for e in exprs), f"no dashboard panel shows {name}"
