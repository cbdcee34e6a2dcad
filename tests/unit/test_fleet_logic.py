"""A relay serving many outboxes (issue #34), the parts that need no server: its settings, how
a listener routes a notification by its payload, and how a single-outbox relay's listener
ignores the news of other outboxes sharing its channel (migration 0008)."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import anyio
import pytest

from notify_outbox import Fleet, FleetDatabase, OutboxNames, Relay
from notify_outbox.core.errors import ConfigurationError
from notify_outbox.core.events import RelayEvents
from notify_outbox.core.settings import OutboxSettings, load_settings
from notify_outbox.relay.fleet import _Activity, pause_for
from notify_outbox.relay.fleet_file import load_fleet_file
from notify_outbox.relay.listener import PROBE_PREFIX, Listener
from notify_outbox.relay.outage import Outage
from notify_outbox.relay.wiring import SharedPorts
from tests.fakes import FakePublisher, FakeStore, fake_settings

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


# --- a draining outbox's share (outbox_drain_share) ---------------------------------------------


def test_activity_says_whether_another_outbox_had_events_within_the_window() -> None:
    a, b, c = object(), object(), object()
    seen = _Activity(window=1.0)
    assert not seen.others(a, 0.0)  # nothing yet
    seen.note(a, 10.0)
    assert not seen.others(a, 10.5)  # only itself
    assert seen.others(b, 10.5)
    seen.note(b, 11.0)
    seen.note(a, 11.2)  # a again: b is still the latest other
    assert seen.others(a, 11.9)
    assert not seen.others(a, 12.1)  # b's events are older than the window
    seen.note(c, 12.0)
    assert seen.others(a, 12.1)  # c
    assert seen.others(c, 12.1)  # a at 11.2 is within the window
    assert not seen.others(c, 12.3)  # and is not any more


def test_a_paused_drain_claims_for_its_share_of_the_time() -> None:
    assert pause_for(0.04, 0.25) == pytest.approx(0.12)  # claims 40 ms of every 160 ms
    assert pause_for(0.04, 0.5) == pytest.approx(0.04)
    assert pause_for(0.04, 1.0) == 0.0
    assert pause_for(30.0, 0.1) == 1.0  # one slow claim does not stop the drain for long


@pytest.mark.anyio
async def test_the_fleet_pauses_a_drain_only_while_other_outboxes_have_events(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    monkeypatch.setattr(anyio, "sleep", sleep)  # the fleet's pause
    spec = FleetDatabase(settings(outbox_drain_share=0.5), discover=True)
    fleet = Fleet([spec])
    drain, other = cast(Any, object()), cast(Any, object())
    activity = _Activity()  # the database's
    pace = fleet._pacer(drain, activity)
    assert pace is not None
    await pace(0.03)
    assert slept == []  # alone: full speed
    activity.note(other, time.monotonic())
    await pace(0.03)
    assert slept == [pytest.approx(0.03)]
    assert fleet.events.counts["drain_paused"] == 1
    activity.note(drain, time.monotonic())  # its own events do not count
    await pace(0.03)
    assert len(slept) == 2
    never = Fleet([FleetDatabase(settings(outbox_drain_share=1), discover=True)])
    assert never._pacer(drain, activity) is None
    assert Fleet([FleetDatabase(settings(), discover=True)])._drain_share == 0.15  # default


def test_a_drain_claims_fewer_rows_while_other_outboxes_have_events() -> None:
    fleet = Fleet([FleetDatabase(settings(outbox_drain_share=0.5), discover=True)])
    other = cast(Any, object())

    def member(batch_size: int) -> SimpleNamespace:
        return SimpleNamespace(relay=SimpleNamespace(settings=settings(batch_size=batch_size)))

    big, small = member(1000), member(50)
    activity = _Activity()
    limit = fleet._limiter(cast(Any, big), activity)
    limit_small = fleet._limiter(cast(Any, small), activity)
    assert limit is not None
    assert limit_small is not None
    assert limit() is None  # alone: its batch size
    activity.note(other, time.monotonic())
    assert limit() == 100
    assert limit_small() == 50  # never more than its batch size
    share_one = Fleet([FleetDatabase(settings(outbox_drain_share=1), discover=True)])
    assert share_one._limiter(cast(Any, big), activity) is None


async def drain_shared(store: FakeStore, pub: FakePublisher, **ports: Any) -> None:
    """A relay of one worker and batches of 50 on ``store``, given the fleet's ``ports``
    (``pace``, ``limit``), woken as the fleet's listener would, until the store is empty."""
    shared = SharedPorts(
        pool=cast(Any, None),
        behind_pooler=False,
        publisher=pub,
        listener=None,
        pulse=None,
        relay_id="test",
        kafka_outage=Outage("Kafka", logging.getLogger("test")),
        **ports,
    )
    relay = Relay(fake_settings(workers=1, batch_size=50), store=store, shared=shared)
    async with relay:
        relay.wake("notification")
        with anyio.fail_after(10):
            while store.pending():
                await relay.events.wait_for("batch_done", relay.events.counts["batch_done"] + 1)


@pytest.mark.anyio
async def test_a_shared_relay_paces_after_full_claims_only() -> None:
    store, pub = FakeStore(), FakePublisher()
    for i in range(120):
        store.add(key=f"k{i % 7}")
    paced: list[float] = []

    async def pace(busy: float) -> None:
        paced.append(busy)

    await drain_shared(store, pub, pace=pace)
    assert sorted(r.id for r in pub.sent) == list(range(1, 121))
    # Claims of 50, 50 and 20 rows: the two full ones paused, with the time each took.
    assert len(paced) == 2
    assert all(busy > 0 for busy in paced)


@pytest.mark.anyio
async def test_a_shared_relay_claims_as_many_rows_as_it_is_told() -> None:
    store, pub = FakeStore(), FakePublisher()
    for i in range(120):
        store.add(key=f"k{i % 7}")
    sizes: list[int] = []
    store_claim = store.claim

    def claim(limit: int, idle_timeout: float | None = None) -> Any:
        sizes.append(limit)
        return store_claim(limit, idle_timeout)

    store.claim = claim  # type: ignore[method-assign]
    await drain_shared(store, pub, limit=lambda: 30)
    assert sorted(r.id for r in pub.sent) == list(range(1, 121))
    assert sizes[:4] == [30, 30, 30, 30]  # 120 rows in four claims of 30
    assert set(sizes) == {30}
