"""The inbox's reading of event ids from messages, and its settings: no database needed."""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field

import pytest

from notify_outbox.core.errors import ConfigurationError
from notify_outbox.inbox import BadEventId, Inbox, InboxNames


@dataclass
class Msg:
    headers: list[tuple[str, bytes]] = field(default_factory=list)
    key: bytes | None = None
    topic: str = "orders"
    partition: int = 2
    offset: int = 17


def test_outbox_header_is_read_and_lowered() -> None:
    eid = uuid.uuid4()
    msg = Msg([("trace", b"x"), ("outbox-event-id", str(eid).upper().encode())])
    assert Inbox().event_id(msg) == str(eid)


@pytest.mark.parametrize(
    ("msg", "expected"),
    [
        (Msg([("trace", b"x")]), "has no header 'outbox-event-id'"),
        (Msg([("outbox-event-id", b"not-a-uuid")]), "is not a UUID"),
        (Msg([("outbox-event-id", b"\xff\xfe")]), "is not UTF-8"),
        (Msg([("outbox-event-id", b"{" + str(uuid.uuid4()).encode() + b"}")]), "is not a UUID"),
        (
            Msg(
                [("outbox-event-id", str(uuid.uuid4()).encode())] * 1
                + [("outbox-event-id", str(uuid.uuid4()).encode())]
            ),
            "2 different header 'outbox-event-id' values",
        ),
    ],
)
def test_bad_ids_raise_a_clear_error(msg: Msg, expected: str) -> None:
    with pytest.raises(BadEventId, match=expected) as info:
        Inbox().event_id(msg)
    # The message says where the message is, so an operator can find it.
    assert "topic orders, partition 2, offset 17" in str(info.value)


def test_key_and_text_ids() -> None:
    inbox = Inbox(id_source="key", id_format="text")
    assert inbox.event_id(Msg(key=b"order-42:v3")) == "order-42:v3"
    with pytest.raises(BadEventId, match="has no key"):
        inbox.event_id(Msg())
    with pytest.raises(BadEventId, match="1 to 512 bytes"):
        inbox.event_id(Msg(key=b"x" * 513))
    with pytest.raises(BadEventId, match="1 to 512 bytes"):
        inbox.event_id(Msg(key=b""))
    other = Inbox(id_header="message-id", id_format="text")
    assert other.event_id(Msg([("message-id", b"abc")])) == "abc"


def test_settings_are_checked() -> None:
    with pytest.raises(ConfigurationError, match="consumer"):
        Inbox(consumer="")
    with pytest.raises(ConfigurationError, match="on_bad_id"):
        Inbox(on_bad_id="ignore")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="id_format"):
        Inbox(id_format="int")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="inbox table"):
        InboxNames(table="Bad-Name")


def test_bad_id_policies_log_and_count(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="notify_outbox.inbox")
    error = BadEventId("message (topic t) has no header 'outbox-event-id'")
    skip, apply = Inbox(on_bad_id="skip"), Inbox(on_bad_id="apply")
    assert skip._bad_id(error) is False
    assert apply._bad_id(error) is True
    assert skip.counts["bad_id_skipped"] == 1
    assert apply.counts["bad_id_applied"] == 1
    assert [r.levelname for r in caplog.records] == ["WARNING", "WARNING"]
    assert "skipped, not applied" in caplog.records[0].getMessage()
    assert "applied without deduplication" in caplog.records[1].getMessage()
    with pytest.raises(BadEventId):
        Inbox()._bad_id(error)


def test_inbox_names_are_their_own_track() -> None:
    names = InboxNames("app", "processed")
    assert names.target == "inbox:app.processed"
    # The outbox's tracking table, keyed by target: the inbox can share it without collisions.
    assert names.substitutions()["@migrations@"] == '"app"."notify_outbox_migrations"'
