"""A relay serving many outboxes (issue #34), the parts that need no server: its settings, how
a listener routes a notification by its payload, and how a single-outbox relay's listener
ignores the news of other outboxes sharing its channel (migration 0008)."""

from __future__ import annotations

from typing import Any

import pytest

from notify_outbox import FleetDatabase, OutboxNames
from notify_outbox.core.errors import ConfigurationError
from notify_outbox.core.events import RelayEvents
from notify_outbox.core.settings import OutboxSettings, load_settings
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
