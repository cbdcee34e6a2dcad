"""How an outbox row becomes a Kafka record: its key, value and headers.

Called once per event on the relay's hot path (``_record``); ``to_message`` is the same as a
``KafkaMessage``. The Debezium header style is mapped here too, so the publisher does not import
the Debezium mode (``debezium/``), which re-exports ``debezium_headers``.
"""

from __future__ import annotations

import json

from notify_outbox.core.message import (
    AGGREGATE_ID_HEADER,
    AGGREGATE_TYPE_HEADER,
    EVENT_ID_HEADER,
    EVENT_TYPE_HEADER,
    RESERVED_HEADERS,
    KafkaMessage,
)
from notify_outbox.core.outbox import OutboxRow

__all__ = ["Record", "RowRejected", "debezium_headers", "to_message"]


class RowRejected(ValueError):
    """The row can never become a Kafka message as stored (e.g. malformed headers). The one
    error of mapping a row that dead-letters it: any other is a bug, not a bad row."""


def to_message(row: OutboxRow, *, header_style: str = "native") -> KafkaMessage:
    """Map an outbox row to a Kafka message: ``payload`` JSON (or ``payload_bytes``) becomes
    the value, ``key`` the key, ``headers`` plus the event metadata the headers.

    ``header_style="debezium"``: the headers are the row's own, ``id`` first, and nothing of
    the relay's (what Debezium's outbox event router sends; see ``debezium/capture.py``)."""
    key, value, headers = _record(row, header_style == "debezium")
    return KafkaMessage(row.topic, key, value, headers)


Record = tuple[bytes | None, bytes | None, list[tuple[str, bytes | None]]]


def _record(row: OutboxRow, debezium: bool) -> Record:
    """``to_message`` without the message object: key, value and headers, as the batch
    builder takes them (called once per event on the relay's hot path)."""
    value = row.payload_bytes
    if value is None and (payload := row.payload) is not None:
        value = payload.encode()
    key = row.key.encode() if row.key is not None else None
    if debezium:
        try:
            dbz_headers = debezium_headers(row.headers)
        except ValueError as e:  # what the row holds, not our code: json and shape errors
            raise RowRejected(str(e)) from e
        # The router sends a null key with a null value too (not a tombstone to refuse).
        return key, value, dbz_headers
    if value is None and key is None:
        raise RowRejected("event has neither a payload nor a key")
    headers: list[tuple[str, bytes | None]] = (
        [] if row.headers is None else _own_headers(row.headers)
    )
    headers.append((EVENT_ID_HEADER, str(row.event_id).encode()))
    if row.event_type is not None:
        headers.append((EVENT_TYPE_HEADER, row.event_type.encode()))
    if row.aggregate_type is not None:
        headers.append((AGGREGATE_TYPE_HEADER, row.aggregate_type.encode()))
    if row.aggregate_id is not None:
        headers.append((AGGREGATE_ID_HEADER, row.aggregate_id.encode()))
    return key, value, headers


def _own_headers(text: str) -> list[tuple[str, bytes | None]]:
    """An event's own headers (a JSON object of strings) as Kafka headers."""
    try:
        parsed = json.loads(text)
    except ValueError as e:
        raise RowRejected(f"headers are not JSON: {e}") from e
    if not isinstance(parsed, dict):
        raise RowRejected("headers must be a JSON object")
    headers: list[tuple[str, bytes | None]] = []
    for name, val in parsed.items():
        if not isinstance(val, str):
            raise RowRejected(f"header {name!r} must have a string value")
        if name in RESERVED_HEADERS:
            raise RowRejected(f"header {name!r} is reserved for the relay")
        headers.append((name, val.encode()))
    return headers


def debezium_headers(headers_json: str | None) -> list[tuple[str, bytes | None]]:
    """The Kafka headers of a row the capture wrote: ``id`` first (as the router adds it),
    then the additional header fields; a JSON null is a header with a null value (what
    SimpleHeaderConverter makes of a NULL column). Raises ValueError for anything else."""
    if headers_json is None:
        raise ValueError("Debezium-style row without headers (no 'id'): not written by the capture")
    parsed = json.loads(headers_json)
    if not isinstance(parsed, dict) or not isinstance(parsed.get("id"), str):
        raise ValueError("Debezium-style row: headers must be a JSON object with an 'id' string")
    out: list[tuple[str, bytes | None]] = [("id", parsed.pop("id").encode())]
    for name, value in parsed.items():
        if value is not None and not isinstance(value, str):
            raise ValueError(f"header {name!r} must have a string value or null")
        out.append((name, None if value is None else value.encode()))
    return out
