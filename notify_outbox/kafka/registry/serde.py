"""Schemas at the three places an event passes: the producer checks it before its commit
(``EventSchemas``, ``StaticSchema``), the relay encodes it (``RowEncoder``), a consumer decodes
it (``RegistryDeserializer``). Subjects are named as Confluent's serializers name them.

A subject's latest schema is cached for ``refresh`` seconds, so no event waits for the
registry; while the registry is down, a schema already known keeps being used.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

from notify_outbox.kafka.registry.client import (
    RegisteredSchema,
    RegistryClient,
    RegistryUnavailable,
    SubjectNotFound,
)
from notify_outbox.kafka.registry.codecs import (
    Codec,
    SchemaMismatch,
    UnsupportedSchema,
    codec_for,
    is_framed,
    unframe,
)

if TYPE_CHECKING:
    from notify_outbox.core.outbox import OutboxRow

__all__ = [
    "EventSchemas",
    "EventToCheck",
    "RegistryDeserializer",
    "RowEncoder",
    "SchemaCheck",
    "StaticSchema",
    "SubjectStrategy",
    "subject_name",
]

SubjectStrategy = Literal["topic", "record", "topic-record"]

# A subject found missing (or a schema that failed to load) is looked up again after this
# long: a schema registered after its first event is picked up before the row's retry.
_MISSING_RETRY_S = 1.0
# A mismatch against a schema older than this re-reads the subject once first: the producer
# may have registered a newer version since.
_RECHECK_AFTER_S = 1.0


try:
    # The schema-registry extra's parser: 5x json's speed, and parsing was a third of the
    # relay's Avro encoding. It reads an integer beyond 64 bits as a float, which changes no
    # outcome here: an Avro long refuses both, a double takes the same value, and a JSON
    # Schema record carries the event's own text.
    from orjson import loads as _fast_loads

    _loads: Callable[[str], Any] = _fast_loads
except ImportError:  # pragma: no cover (the extra installs it)
    _loads = json.loads


def subject_name(
    strategy: SubjectStrategy, topic: str, record: str | None, *, key: bool = False
) -> str:
    """The subject of a topic's values (or keys), as Confluent's strategies name it:
    ``topic``: ``<topic>-value``; ``record``: the record's full name; ``topic-record``:
    ``<topic>-<record>``. The record name is the event's ``event_type``. Keys always use
    ``<topic>-key``."""
    if key or strategy == "topic":
        return f"{topic}-{'key' if key else 'value'}"
    if not record:
        raise SchemaMismatch(
            f"the {strategy} subject strategy names the subject after the record: the event "
            "needs an event_type (the record's full name, e.g. com.acme.OrderPlaced)"
        )
    return record if strategy == "record" else f"{topic}-{record}"


@dataclass
class _Entry:
    codec: Codec | None
    error: Exception | None
    fetched: float


class _Subjects:
    """The latest schema of each subject, cached."""

    def __init__(self, client: RegistryClient, refresh: float) -> None:
        self.client = client
        self._refresh = refresh
        self._entries: dict[str, _Entry] = {}
        # Per schema id, the subjects it is registered under (an id never changes; a subject
        # a producer's id was not found under is looked up again after _MISSING_RETRY_S).
        self._ids: dict[int, tuple[set[str], float]] = {}

    async def ensure_ids(self, pairs: Iterable[tuple[str, int]]) -> None:
        """Learn the subjects of the ids in ``pairs`` (subject, id) not known to match yet.
        Raises ``RegistryUnavailable`` when the registry does not answer."""
        now = time.monotonic()
        for subject, schema_id in pairs:
            known = self._ids.get(schema_id)
            if known is not None and (subject in known[0] or now - known[1] < _MISSING_RETRY_S):
                continue
            self._ids[schema_id] = (await self.client.subjects_of(schema_id), now)

    def id_under(self, schema_id: int, subject: str) -> bool:
        """Whether the id is registered under the subject (after ``ensure_ids``)."""
        known = self._ids.get(schema_id)
        return known is not None and subject in known[0]

    def entry(self, subject: str) -> _Entry | None:
        return self._entries.get(subject)

    def _fresh(self, entry: _Entry | None, now: float) -> bool:
        if entry is None:
            return False
        ttl = self._refresh if entry.codec is not None else _MISSING_RETRY_S
        return now - entry.fetched < ttl

    async def ensure(self, subjects: Iterable[str], *, force: bool = False) -> None:
        """Load the subjects not known or expired. Raises ``RegistryUnavailable`` only for a
        subject whose schema was never loaded; a known one is kept through an outage."""
        now = time.monotonic()
        for subject in subjects:
            entry = self._entries.get(subject)
            if not force and self._fresh(entry, now):
                continue
            try:
                found = await self.client.latest(subject)
                if entry is not None and entry.codec is not None and entry.codec.schema == found:
                    entry.fetched = now
                    continue
                self._entries[subject] = _Entry(codec_for(found), None, now)
            except (SubjectNotFound, UnsupportedSchema) as e:
                self._entries[subject] = _Entry(None, e, now)
            except RegistryUnavailable:
                if entry is None or entry.codec is None:
                    raise
                entry.fetched = now - self._refresh + _MISSING_RETRY_S  # try again soon

    def codec(self, subject: str) -> Codec:
        """The cached codec (after ``ensure``). Raises what loading it raised."""
        entry = self._entries[subject]
        if entry.codec is None:
            assert entry.error is not None
            raise entry.error
        return entry.codec


def _framed_id(data: bytes) -> int | None:
    """The schema id of a record in the wire format, or None if it is not one."""
    return unframe(data)[0] if is_framed(data) else None


def _check_bytes(subjects: _Subjects, topic: str, data: bytes, subject: str) -> None:
    """Raise ``SchemaMismatch`` unless ``data`` is in the wire format with an id registered
    under ``subject`` (after ``ensure_ids``)."""
    schema_id = _framed_id(data)
    if schema_id is None:
        raise SchemaMismatch(
            f"topic {topic!r} is governed by the Schema Registry: its value_bytes must be in "
            "the registry's wire format (magic byte 0, schema id, body)"
        )
    if not subjects.id_under(schema_id, subject):
        raise SchemaMismatch(
            f"value_bytes for topic {topic!r} carry schema id {schema_id}, which is not "
            f"registered under subject {subject!r}"
        )


def _patterns(topics: str | Sequence[str]) -> tuple[str, ...]:
    items = topics.split(",") if isinstance(topics, str) else list(topics)
    return tuple(p.strip() for p in items if p.strip())


class _Governed:
    """Which topics a schema governs (glob patterns), remembered per topic."""

    def __init__(self, topics: str | Sequence[str]) -> None:
        self._patterns = _patterns(topics)
        self._known: dict[str, bool] = {}

    def __call__(self, topic: str) -> bool:
        known = self._known.get(topic)
        if known is None:
            known = self._known[topic] = any(fnmatch.fnmatchcase(topic, p) for p in self._patterns)
        return known


class RowEncoder:
    """The relay's side: outbox rows of governed topics become records in Confluent's wire
    format. A row's JSON payload is encoded with its subject's latest schema; ``value_bytes``
    must be in the wire format already (the producer encoded it). With ``keys``, the key
    (text) is encoded with the ``<topic>-key`` subject's schema too."""

    def __init__(
        self,
        client: RegistryClient,
        *,
        topics: str | Sequence[str] = "*",
        strategy: SubjectStrategy = "topic",
        keys: bool = False,
        refresh: float = 30.0,
    ) -> None:
        self.client = client
        self.governs = _Governed(topics)
        self._strategy = strategy
        self._keys = keys
        self._subjects = _Subjects(client, refresh)
        # The topic strategy's subjects, per topic: no string is built per event.
        self._topic_subjects: dict[str, str] | None = {} if strategy == "topic" else None
        # The record strategies name the record by the event_type: a Protobuf schema's
        # message is chosen by it (the topic strategy's event_type is free text).
        self._by_record = strategy != "topic"

    def _value_subject(self, row: OutboxRow) -> str:
        by_topic = self._topic_subjects
        if by_topic is None:
            return subject_name(self._strategy, row.topic, row.event_type)
        subject = by_topic.get(row.topic)
        if subject is None:
            subject = by_topic[row.topic] = subject_name("topic", row.topic, None)
        return subject

    async def prepare(self, rows: Sequence[OutboxRow]) -> None:
        """Load the schemas these rows need (most claims: none, they are cached). Raises
        ``RegistryUnavailable`` when one was never loaded and the registry does not answer.
        Once per claim: with the topic strategy, per topic rather than per row."""
        needed: set[str] = set()
        ids: set[tuple[str, int]] = set()
        if self._topic_subjects is not None and not self._keys:
            for topic in {row.topic for row in rows}:
                if self.governs(topic):
                    needed.add(subject_name("topic", topic, None))
            # The producers' pre-encoded rows: their ids are checked against the subject.
            rows = [row for row in rows if row.payload is None and row.payload_bytes is not None]
        for row in rows:
            if not self.governs(row.topic):
                continue
            if row.payload is not None:
                # No subject (no event_type under a record strategy): encode() says so.
                with contextlib.suppress(SchemaMismatch):
                    needed.add(self._value_subject(row))
            elif row.payload_bytes is not None:
                schema_id = _framed_id(row.payload_bytes)
                if schema_id is not None:
                    with contextlib.suppress(SchemaMismatch):
                        ids.add((self._value_subject(row), schema_id))
            if self._keys and row.key is not None:
                needed.add(subject_name(self._strategy, row.topic, None, key=True))
        if needed:
            await self._subjects.ensure(needed)
        if ids:
            await self._subjects.ensure_ids(ids)

    def encode(
        self, row: OutboxRow, key: bytes | None, value: bytes | None
    ) -> tuple[bytes | None, bytes | None]:
        """The row's key and value as records of its topic's schemas (after ``prepare``).

        Raises ``SchemaMismatch``/``UnsupportedSchema`` for a row that can never be encoded,
        ``SubjectNotFound`` while its subject has no schema (retry: it may be registered)."""
        if value is not None:
            if row.payload is not None:
                codec = self._subjects.codec(self._value_subject(row))
                record = row.event_type if self._by_record else None
                value = codec.encode(_loads(row.payload), value, record)
            else:
                _check_bytes(self._subjects, row.topic, value, self._value_subject(row))
        if self._keys and row.key is not None:
            codec = self._subjects.codec(subject_name(self._strategy, row.topic, None, key=True))
            key = codec.encode(row.key)
        return key, value

    async def encode_rechecked(
        self, row: OutboxRow, key: bytes | None, value: bytes | None
    ) -> tuple[bytes | None, bytes | None]:
        """``encode`` after a mismatch: once more with the subjects re-read if their schema is
        older than a second (a producer may have registered a newer version since)."""
        now = time.monotonic()
        subjects = []
        if row.payload is not None:
            subjects.append(self._value_subject(row))
        if self._keys and row.key is not None:
            subjects.append(subject_name(self._strategy, row.topic, None, key=True))
        stale = [
            s
            for s in subjects
            if (e := self._subjects.entry(s)) is not None and now - e.fetched >= _RECHECK_AFTER_S
        ]
        if stale:
            await self._subjects.ensure(stale, force=True)
        return self.encode(row, key, value)


@dataclass(frozen=True)
class EventToCheck:
    """What a schema check sees of an event: its topic, ``event_type`` (the record name of
    the record strategies), and its payload (a JSON value) or ``value_bytes``; neither for a
    tombstone."""

    topic: str
    event_type: str | None
    payload: Any = None
    value_bytes: bytes | None = None
    has_payload: bool = True


class SchemaCheck(Protocol):
    """What the producer API takes as ``schemas``: refuses events before they are written."""

    async def check_events(self, events: Sequence[EventToCheck]) -> None:
        """Raise ``SchemaMismatch`` (an ``EventValidationError``) for the first event that
        does not match its schema."""


def _check_one(codec_of: Any, event: EventToCheck, subject: str, record: str | None) -> None:
    if event.value_bytes is not None:
        if not is_framed(event.value_bytes):
            raise SchemaMismatch(
                f"event for topic {event.topic!r}: value_bytes must be in the Schema Registry's "
                "wire format (magic byte 0, schema id, body)"
            )
        return  # its id: checked by EventSchemas against the registry
    if not event.has_payload:
        return  # a tombstone
    try:
        codec_of(subject).check(event.payload, record)
    except SchemaMismatch as e:
        raise SchemaMismatch(f"event for topic {event.topic!r} {e}") from None


class EventSchemas:
    """Checks each event against the latest schema registered for its topic (by the same
    subject strategy as the relay's), before the producer's transaction writes it: a bad
    event raises here and never becomes a poison row.

    Topics outside ``topics`` (glob patterns) are not checked. An event whose subject has no
    schema is refused; a registry that does not answer raises ``RegistryUnavailable`` (the
    schemas already seen are cached for ``refresh`` seconds, and kept through an outage).
    """

    def __init__(
        self,
        client: RegistryClient,
        *,
        topics: str | Sequence[str] = "*",
        strategy: SubjectStrategy = "topic",
        refresh: float = 30.0,
    ) -> None:
        self.client = client
        self._governs = _Governed(topics)
        self._strategy = strategy
        self._subjects = _Subjects(client, refresh)

    async def check_events(self, events: Sequence[EventToCheck]) -> None:
        subjects: list[tuple[EventToCheck, str]] = []
        for event in events:
            if self._governs(event.topic):
                subjects.append(
                    (event, subject_name(self._strategy, event.topic, event.event_type))
                )
        if not subjects:
            return
        await self._subjects.ensure({s for e, s in subjects if e.value_bytes is None})
        ids = {
            (s, i)
            for e, s in subjects
            if e.value_bytes is not None and (i := _framed_id(e.value_bytes)) is not None
        }
        await self._subjects.ensure_ids(ids)
        for event, subject in subjects:
            if event.value_bytes is not None:
                _check_bytes(self._subjects, event.topic, event.value_bytes, subject)
                continue
            record = event.event_type if self._strategy != "topic" else None
            try:
                _check_one(self._subjects.codec, event, subject, record)
            except SubjectNotFound as e:
                raise SchemaMismatch(f"event for topic {event.topic!r}: {e}") from None


class StaticSchema:
    """One schema given in code (no registry): every event checked must match it. For a
    producer that owns its topic's schema, or for tests. ``schema_type``: ``AVRO``, ``JSON``
    or ``PROTOBUF`` (.proto text; events are checked against its first message)."""

    def __init__(self, schema: str | dict[str, Any], schema_type: str = "AVRO") -> None:
        text = schema if isinstance(schema, str) else json.dumps(schema)
        self.codec = codec_for(RegisteredSchema(id=0, schema=text, schema_type=schema_type))

    def check(self, payload: Any) -> None:
        """Raise ``SchemaMismatch`` unless ``payload`` matches."""
        self.codec.check(payload)

    def check_events_now(self, events: Sequence[EventToCheck]) -> None:
        """``check_events`` without awaiting (for synchronous producers)."""
        for event in events:
            _check_one(lambda _: self.codec, event, "", None)

    async def check_events(self, events: Sequence[EventToCheck]) -> None:
        self.check_events_now(events)


class RegistryDeserializer:
    """A consumer's side: the value of a record in Confluent's wire format (Avro, JSON Schema
    or Protobuf, as a dict by the proto3 JSON mapping), decoded with the writer's schema
    fetched by id (cached: ids never change). ``None`` stays ``None`` (a tombstone)."""

    def __init__(self, client: RegistryClient) -> None:
        self.client = client
        self._codecs: dict[int, Codec] = {}

    async def __call__(self, data: bytes | None) -> Any:
        if data is None:
            return None
        schema_id, body = unframe(data)
        codec = self._codecs.get(schema_id)
        if codec is None:
            codec = self._codecs[schema_id] = codec_for(await self.client.by_id(schema_id))
        return codec.decode(body)
