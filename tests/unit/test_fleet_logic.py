"""A relay serving many outboxes (issue #34), the parts that need no server: its settings, how
a listener routes a notification by its payload, and how a single-outbox relay's listener
ignores the news of other outboxes sharing its channel (migration 0008)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from notify_outbox import FleetDatabase, OutboxNames
from notify_outbox.core.errors import ConfigurationError
from notify_outbox.core.events import RelayEvents
from notify_outbox.core.settings import OutboxSettings, load_settings
from notify_outbox.relay.fleet_file import load_fleet_file
from notify_outbox.relay.listener import PROBE_PREFIX, Listener

DSN = "postgresql://app:secret@127.0.0.1:5432/app"


def settings(**kw: Any) -> OutboxSettings:
    return OutboxSettings(dsn=DSN, kafka_bootstrap_servers="127.0.0.1:9092", **kw)


def test_outboxes_take_star_or_a_list_of_schema_table() -> None:
    assert settings(outboxes=" * ").outboxes == "*"
    assert settings(outboxes="t1.outbox, t2.events").outboxes == "t1.outbox,t2.events"
    listed = FleetDatabase.from_settings(settings(outboxes="t1.outbox,t2.events", channel="c"))
    assert listed.outboxes == (OutboxNames("t1", "outbox", "c"), OutboxNames("t2", "events", "c"))
    found = FleetDatabase.from_settings(settings(outboxes="*", outbox_schemas_like="tenant%"))
    assert found.discover
    assert found.schemas_like == "tenant%"


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        ({"outboxes": "outbox"}, "NOTIFY_OUTBOX_OUTBOXES"),
        ({"outboxes": "t1.Outbox"}, "NOTIFY_OUTBOX_OUTBOXES"),
        ({"outboxes": ","}, "NOTIFY_OUTBOX_OUTBOXES"),
        ({"outbox_schemas_like": "t%"}, r"only with NOTIFY_OUTBOX_OUTBOXES=\*"),
        ({"outboxes": "*", "delivery": "exactly-once"}, "at-least-once delivery only"),
    ],
)
def test_wrong_outboxes_settings_say_which_variable(overrides: dict[str, str], says: str) -> None:
    with pytest.raises(ConfigurationError, match=says):
        load_settings(OutboxSettings, dsn=DSN, kafka_bootstrap_servers="h:1", **overrides)


def test_a_fleet_database_needs_outboxes_or_discovery() -> None:
    with pytest.raises(ConfigurationError, match="either a list of outboxes or discover"):
        FleetDatabase(settings())
    with pytest.raises(ConfigurationError, match="either a list of outboxes or discover"):
        FleetDatabase(settings(), outboxes=(OutboxNames(),), discover=True)


def _listener(s: OutboxSettings, route: list[str] | None = None) -> tuple[Listener, list[str]]:
    woken: list[str] = []
    listener = Listener(
        s,
        woken.append,
        RelayEvents(),
        route=None if route is None else route.append,
    )
    return listener, woken


def test_a_single_outbox_listener_wakes_only_for_its_own_outbox() -> None:
    listener, woken = _listener(settings(db_schema="tenant_a"))
    listener._on_notification(None, 1, "notify_outbox", "tenant_b.outbox")  # another's news
    assert woken == []
    listener._on_notification(None, 1, "notify_outbox", "tenant_a.outbox")
    listener._on_notification(None, 1, "notify_outbox", "")  # a trigger older than 0008
    assert woken == ["notification", "notification"]
    listener._on_notification(None, 1, "notify_outbox", PROBE_PREFIX + "x")  # a health probe
    assert woken == ["notification", "notification"]


def test_a_fleet_listener_routes_every_payload_but_probes() -> None:
    routed: list[str] = []
    listener, woken = _listener(settings(), route=routed)
    for payload in ("tenant_a.outbox", "", "notify-outbox:registry", PROBE_PREFIX + "y"):
        listener._on_notification(None, 1, "notify_outbox", payload)
    assert routed == ["tenant_a.outbox", "", "notify-outbox:registry"]
    assert woken == []


def test_the_fleet_file_names_each_database_and_its_outboxes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TENANTS_DSN", "postgresql://relay:tenant-secret@db-1/app")
    secret = tmp_path / "billing_dsn"
    secret.write_text("postgresql://relay:billing-secret@db-2/billing\n")
    path = tmp_path / "fleet.toml"
    path.write_text(
        f"""
[[database]]
dsn_env = "TENANTS_DSN"
outboxes = "*"
schemas_like = "tenant\\\\_%"

[[database]]
dsn_file = "{secret}"
outboxes = ["public.outbox", "audit.events"]
channel = "billing_events"

[[database]]
outboxes = ["public.outbox"]
"""
    )
    tenants, billing, default = load_fleet_file(path, settings(listen_dsn=DSN))
    assert tenants.discover
    assert tenants.schemas_like == "tenant\\_%"
    assert tenants.settings.dsn.get_secret_value().endswith("@db-1/app")
    assert tenants.settings.listen_dsn is None  # NOTIFY_OUTBOX_LISTEN_DSN is DSN's alone
    assert billing.settings.dsn.get_secret_value().endswith("@db-2/billing")
    assert billing.outboxes == (
        OutboxNames("public", "outbox", "billing_events"),
        OutboxNames("audit", "events", "billing_events"),
    )
    assert default.settings.dsn.get_secret_value() == DSN
    assert default.settings.listen_dsn is not None


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("[[database]]\noutboxes = []\n", "number 1: outboxes must be"),
        ('[[database]]\noutboxes = "*"\n[[database]]\nhost = "x"\n', "number 2: unknown key host"),
        ('[[database]]\noutboxes = ["outbox"]\n', "is not schema.table"),
        ('[[database]]\noutboxes = ["public.outbox"]\nschemas_like = "t%"\n', "only with"),
        ('[[database]]\ndsn_env = "NO_SUCH_DSN_VAR"\noutboxes = "*"\n', "NO_SUCH_DSN_VAR"),
        ('[[database]]\ndsn = "mysql://x"\noutboxes = "*"\n', "NOTIFY_OUTBOX_DSN"),
        ('[[database]]\ndsn = "a"\ndsn_env = "b"\noutboxes = "*"\n', "one of dsn"),
        ('outboxes = "*"\n', "one or more \\[\\[database\\]\\] tables"),
        ("[[database]\n", "not valid TOML"),
    ],
)
def test_a_wrong_fleet_file_says_where(tmp_path: Path, text: str, says: str) -> None:
    path = tmp_path / "fleet.toml"
    path.write_text(text)
    with pytest.raises(ConfigurationError, match=says) as raised:
        load_fleet_file(path, settings())
    assert "secret" not in str(raised.value)
