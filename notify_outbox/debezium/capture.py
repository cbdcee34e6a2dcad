"""Debezium-compatible mode: relay a table laid out for Debezium's outbox event router.

A user coming from Debezium keeps the outbox table (``id``, ``aggregatetype``, ``aggregateid``,
``type``, ``payload``) and the consumers. ``install`` puts an AFTER INSERT trigger on that table
(``sql/debezium/capture.sql``) that copies each new row, in the producer's transaction, into
notify-outbox's own outbox table, mapped as ``io.debezium.transforms.outbox.EventRouter`` maps
it: the topic from ``route.topic.replacement``, the key from ``table.field.event.key``, the value
from ``table.field.event.payload``, and the ``id`` header plus the ``header`` fields of
``table.fields.additional.placement`` in the row's ``headers``. A relay run with
``NOTIFY_OUTBOX_HEADER_STYLE=debezium`` then sends exactly those headers and none of its own.

The options keep the router's names and defaults (taken from Debezium's
``EventRouterConfigDefinition``), and a connector configuration (``.properties`` or the JSON
posted to Kafka Connect) can be read as it is. Options that cannot be honoured are refused by
name, never ignored.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

import asyncpg

from notify_outbox.core.errors import ConfigurationError, MigrationError
from notify_outbox.core.names import OutboxNames
from notify_outbox.kafka.records import debezium_headers
from notify_outbox.pg.sqlfiles import render, sql_dir

log = logging.getLogger("notify_outbox.debezium")

__all__ = [
    "DEFAULT_OPTIONS",
    "CaptureReport",
    "DebeziumCapture",
    "HeaderField",
    "debezium_headers",
    "install_capture",
    "parse_connector_config",
    "render_capture",
    "verify_capture",
]

# The router's defaults, as EventRouterConfigDefinition declares them.
DEFAULT_OPTIONS: Mapping[str, str] = {
    "table.field.event.id": "id",
    "table.field.event.key": "aggregateid",
    "table.field.event.type": "type",
    "table.field.event.payload": "payload",
    "route.by.field": "aggregatetype",
    "route.topic.regex": "(?<routedByValue>.*)",
    "route.topic.replacement": "outbox.event.${routedByValue}",
    "route.tombstone.on.empty.payload": "false",
    "table.expand.json.payload": "false",
    "table.fields.additional.placement": "",
    "table.field.additional.missing": "error",
    "table.op.invalid.behavior": "warn",
}

# Options the router has whose effect notify-outbox does not reproduce: refused when set.
_UNSUPPORTED = {
    "table.field.event.timestamp": "the Kafka timestamp is the relay's send time",
    "table.field.event.schema.version": "there is no Connect schema to version",
    "table.json.payload.null.behavior": "table.expand.json.payload is not supported",
    "table.json.payload.empty.array.behavior": "table.expand.json.payload is not supported",
}

# Connector-level settings that decide the bytes on the wire. The raw converters are what the
# mapping reproduces; anything else (JsonConverter's quoting, Avro) is refused.
_RAW_CONVERTERS = {
    "org.apache.kafka.connect.storage.StringConverter",
    "org.apache.kafka.connect.converters.ByteArrayConverter",
    "io.debezium.converters.BinaryDataConverter",
    "io.debezium.converters.ByteBufferConverter",
}
_HEADER_CONVERTERS = {"org.apache.kafka.connect.storage.SimpleHeaderConverter"}

_ROUTER_CLASS = "io.debezium.transforms.outbox.EventRouter"
_COLUMN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_TABLE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,39}")
_HEADER_NAME = re.compile(r"[A-Za-z0-9._-]{1,200}")
_TOPIC_TEXT = re.compile(r"[A-Za-z0-9._-]*")
_DEFAULT_REGEX = "(?<routedByValue>.*)"
_GROUP_NAME = "routedByValue"

# Column types whose text form is the one Debezium's SimpleHeaderConverter / StringConverter
# writes (uuid and json are strings to Debezium; integers and booleans print alike). Others
# (timestamps, numerics, char(n) padding) would differ, so they are refused.
_TEXT_TYPES = {"text", "varchar", "uuid", "json", "jsonb", "int2", "int4", "int8", "bool"}
_ROUTE_TYPES = {"text", "varchar"}  # the router reads it with getString
_PAYLOAD_TYPES = {"jsonb", "json", "text", "varchar", "bytea"}


def _column(value: str, option: str) -> str:
    if not _COLUMN.fullmatch(value) or len(value.encode()) > 63:
        raise ConfigurationError(
            f"{option} must be a column name (letters, digits, underscores; got {value!r})"
        )
    return value


def _quote(name: str) -> str:
    # Validated to [A-Za-z0-9_]: quoting keeps the case (Debezium's names are case-sensitive)
    # and cannot be escaped.
    return f'"{name}"'


def _bool(value: str, option: str) -> bool:
    v = value.strip().lower()
    if v not in ("true", "false"):
        raise ConfigurationError(f"{option} must be true or false (got {value!r})")
    return v == "true"


@dataclass(frozen=True)
class HeaderField:
    """One ``column:header[:alias]`` entry of ``table.fields.additional.placement``."""

    column: str
    alias: str


def _parse_placement(value: str) -> tuple[HeaderField, ...]:
    # The router's own parsing: comma-separated entries, colon-separated parts, trimmed.
    found: list[HeaderField] = []
    for entry in value.split(","):
        if not entry.strip():
            continue
        parts = [p.strip() for p in entry.split(":")]
        if len(parts) not in (2, 3):
            raise ConfigurationError(
                f"table.fields.additional.placement: {entry.strip()!r} is not "
                "column:placement or column:placement:alias"
            )
        column = _column(parts[0], "table.fields.additional.placement")
        placement = parts[1].lower()
        if placement in ("envelope", "partition"):
            raise ConfigurationError(
                f"table.fields.additional.placement: {entry.strip()!r}: placement "
                f"{placement!r} is not supported (the value is the payload alone, and the "
                "partition comes from the key); only 'header' is"
            )
        if placement != "header":
            raise ConfigurationError(
                f"table.fields.additional.placement: {entry.strip()!r}: placement must be "
                "header, envelope or partition"
            )
        alias = parts[2] if len(parts) == 3 else column
        if not _HEADER_NAME.fullmatch(alias):
            raise ConfigurationError(
                f"table.fields.additional.placement: header name {alias!r} must be letters, "
                "digits, '.', '_' or '-'"
            )
        if alias == "id" or any(f.alias == alias for f in found):
            # The row's headers are a JSON object: one value per name.
            raise ConfigurationError(
                f"table.fields.additional.placement: header {alias!r} would appear twice "
                "('id' is the event id's)"
            )
        found.append(HeaderField(column, alias))
    return tuple(found)


def _parse_replacement(replacement: str) -> list[str | None]:
    """``route.topic.replacement`` as literal pieces and ``None`` for the routed value, with
    java.util.regex.Matcher's rules: ``\\`` escapes, ``${name}`` and ``$n`` refer to groups. With
    the default regex, group 0, group 1 and ``routedByValue`` are all the whole value."""
    pieces: list[str | None] = []
    text = ""
    i = 0
    while i < len(replacement):
        c = replacement[i]
        if c == "\\" and i + 1 < len(replacement):
            text += replacement[i + 1]
            i += 2
            continue
        if c == "$":
            rest = replacement[i + 1 :]
            named = re.match(r"\{([A-Za-z][A-Za-z0-9]*)\}", rest)
            if named:
                if named.group(1) != _GROUP_NAME:
                    raise ConfigurationError(
                        f"route.topic.replacement {replacement!r}: no group named "
                        f"{named.group(1)!r} (the regex defines only {_GROUP_NAME!r})"
                    )
                i += 1 + named.end()
            elif rest[:1] in ("0", "1"):
                i += 2  # Java reads further digits only while they name a group: none here
            else:
                raise ConfigurationError(
                    f"route.topic.replacement {replacement!r}: '$' must be followed by "
                    "${routedByValue}, $0 or $1 (write \\$ for a dollar sign)"
                )
            pieces.extend([text, None])
            text = ""
            continue
        text += c
        i += 1
    pieces.append(text)
    literal = "".join(p for p in pieces if p is not None)
    if not _TOPIC_TEXT.fullmatch(literal):
        raise ConfigurationError(
            f"route.topic.replacement {replacement!r}: its fixed text must be letters, digits, "
            "'.', '_' or '-' to make valid Kafka topic names"
        )
    return [p for p in pieces if p != ""]


@dataclass(frozen=True)
class DebeziumCapture:
    """The Debezium-shaped source table and the router options it is relayed with.

    Build it with ``DebeziumCapture.from_options`` from the router's option names; the fields
    are already validated names and parsed values.
    """

    schema: str = "public"
    table: str = "outbox"
    field_event_id: str = "id"
    field_event_key: str = "aggregateid"
    field_event_type: str = "type"
    field_payload: str = "payload"
    route_by_field: str = "aggregatetype"
    route_topic_replacement: str = "outbox.event.${routedByValue}"
    route_tombstone_on_empty_payload: bool = False
    additional_headers: tuple[HeaderField, ...] = ()
    ignore_missing_fields: bool = False

    def __post_init__(self) -> None:
        _column(self.schema, "the source schema")
        if not _TABLE.fullmatch(self.table):
            # The capture function's name appends it to a 22-byte prefix.
            raise ConfigurationError(
                "the source table must be letters, digits and underscores, at most 40 "
                f"(got {self.table!r})"
            )
        for option, value in (
            ("table.field.event.id", self.field_event_id),
            ("table.field.event.key", self.field_event_key),
            ("table.field.event.type", self.field_event_type),
            ("table.field.event.payload", self.field_payload),
            ("route.by.field", self.route_by_field),
        ):
            _column(value, option)
        _parse_replacement(self.route_topic_replacement)

    @classmethod
    def from_options(
        cls, options: Mapping[str, str], *, schema: str = "public", table: str = "outbox"
    ) -> DebeziumCapture:
        """The capture of ``schema.table`` with the router's options (its own names, such as
        ``route.topic.replacement``); unset options take the router's defaults. Raises
        ``ConfigurationError`` for an unknown, unsupported or malformed option."""
        for name in options:
            if name in _UNSUPPORTED:
                raise ConfigurationError(f"{name} is not supported: {_UNSUPPORTED[name]}")
            if name not in DEFAULT_OPTIONS:
                raise ConfigurationError(
                    f"unknown outbox event router option {name!r} (known: "
                    f"{', '.join(sorted(DEFAULT_OPTIONS))})"
                )
        o = {**DEFAULT_OPTIONS, **options}
        if o["route.topic.regex"] != _DEFAULT_REGEX:
            raise ConfigurationError(
                f"route.topic.regex: only the default {_DEFAULT_REGEX!r} is supported; shape "
                "the topic with route.topic.replacement"
            )
        if _bool(o["table.expand.json.payload"], "table.expand.json.payload"):
            raise ConfigurationError(
                "table.expand.json.payload=true is not supported: the value is the payload "
                "column's text as it is (the router's default)"
            )
        missing = o["table.field.additional.missing"].strip().lower()
        if missing not in ("error", "ignore"):
            raise ConfigurationError("table.field.additional.missing must be error or ignore")
        behaviour = o["table.op.invalid.behavior"].strip().lower()
        if behaviour not in ("warn", "error"):
            raise ConfigurationError(
                "table.op.invalid.behavior: only warn or error (updates are ignored) is supported"
            )
        return cls(
            schema=schema,
            table=table,
            field_event_id=o["table.field.event.id"].strip(),
            field_event_key=o["table.field.event.key"].strip(),
            field_event_type=o["table.field.event.type"].strip(),
            field_payload=o["table.field.event.payload"].strip(),
            route_by_field=o["route.by.field"].strip(),
            route_topic_replacement=o["route.topic.replacement"].strip(),
            route_tombstone_on_empty_payload=_bool(
                o["route.tombstone.on.empty.payload"], "route.tombstone.on.empty.payload"
            ),
            additional_headers=_parse_placement(o["table.fields.additional.placement"]),
            ignore_missing_fields=missing == "ignore",
        )

    @property
    def qualified_table(self) -> str:
        """The source table, schema-qualified and quoted."""
        return f"{_quote(self.schema)}.{_quote(self.table)}"

    @property
    def function(self) -> str:
        """The capture trigger's function, next to the source table."""
        return f"{_quote(self.schema)}.{_quote('notify_outbox_capture_' + self.table)}"

    def topic_for(self, routed: str) -> str:
        """The topic the router picks for this ``route.by.field`` value (for tests and docs)."""
        pieces = _parse_replacement(self.route_topic_replacement)
        return "".join(routed if p is None else p for p in pieces)


def parse_connector_config(text: str) -> dict[str, str]:
    """The outbox event router options of a Kafka Connect connector configuration, given as
    ``.properties`` lines or as the JSON posted to Connect (``{"name":..., "config": {...}}``
    or the bare config object). The ``transforms.<alias>.`` prefix of the EventRouter transform
    is removed; connector settings are skipped, except the converters, which are checked."""
    stripped = text.strip()
    raw: dict[str, str] = {}
    if stripped.startswith("{"):
        try:
            loaded = json.loads(stripped)
        except json.JSONDecodeError as e:
            raise ConfigurationError(f"connector configuration is not valid JSON: {e}") from None
        if isinstance(loaded, dict) and isinstance(loaded.get("config"), dict):
            loaded = loaded["config"]
        if not isinstance(loaded, dict):
            raise ConfigurationError("connector configuration JSON must be an object")
        raw = {str(k): str(v) for k, v in loaded.items()}
    else:
        for number, line in enumerate(text.splitlines(), 1):
            line = line.strip()
            if not line or line.startswith(("#", "!")):
                continue
            sep = min((i for i in (line.find("="), line.find(":")) if i >= 0), default=-1)
            if sep < 0:
                raise ConfigurationError(f"connector configuration line {number}: no '='")
            raw[line[:sep].strip()] = line[sep + 1 :].strip()
    routers = [
        k.removeprefix("transforms.").removesuffix(".type")
        for k, v in raw.items()
        if k.startswith("transforms.") and k.endswith(".type") and v.strip() == _ROUTER_CLASS
    ]
    if len(routers) > 1:
        raise ConfigurationError(f"connector configuration has several outbox routers: {routers}")
    for name in ("key.converter", "value.converter"):
        if name in raw and raw[name].strip() not in _RAW_CONVERTERS:
            raise ConfigurationError(
                f"{name}={raw[name]} is not supported: notify-outbox writes the bytes of "
                "StringConverter / ByteArrayConverter / BinaryDataConverter"
            )
    unset = [name for name in ("key.converter", "value.converter") if name not in raw]
    if unset and routers:
        # The Connect worker's defaults apply to these, and they are not in this file: often
        # JsonConverter with schemas.enable=true, whose bytes differ from the relay's.
        log.warning(
            "%s not set in the connector configuration: Debezium used the Connect worker's "
            "default there, which this file does not show. If that is JsonConverter, "
            'consumers written for it expect {"schema": ..., "payload": ...} and will '
            "see the relay's raw key and payload instead (docs/debezium-costs.md)",
            " and ".join(unset),
        )
    if "header.converter" in raw and raw["header.converter"].strip() not in _HEADER_CONVERTERS:
        raise ConfigurationError(
            f"header.converter={raw['header.converter']} is not supported (SimpleHeaderConverter)"
        )
    if not routers:
        return {}
    prefix = f"transforms.{routers[0]}."
    return {
        k.removeprefix(prefix): v
        for k, v in raw.items()
        if k.startswith(prefix) and k != prefix + "type"
    }


# --- rendering and installing -----------------------------------------------------------------


@dataclass(frozen=True)
class _Rendered:
    tokens: dict[str, str]

    def substitutions(self) -> dict[str, str]:
        return self.tokens


def _literal(text: str) -> str:
    # Only validated text reaches here ([A-Za-z0-9._-] and names); doubling quotes anyway.
    return "'" + text.replace("'", "''") + "'"


def render_capture(
    capture: DebeziumCapture, names: OutboxNames, column_types: Mapping[str, str] | None = None
) -> str:
    """The capture's SQL (function and trigger) for one source table and one outbox.

    ``column_types`` (column name to PostgreSQL type name, from the source table) decides how
    the id and the payload are read; without it the router's default table is assumed (uuid id,
    jsonb payload) and the ``type`` column is taken to exist."""
    types = (
        dict(column_types)
        if column_types is not None
        else {
            capture.field_event_id: "uuid",
            capture.field_payload: "jsonb",
            capture.field_event_type: "varchar",
            capture.field_event_key: "varchar",
            capture.route_by_field: "varchar",
            **{f.column: "varchar" for f in capture.additional_headers},
        }
    )

    def new(column: str) -> str:
        return f"NEW.{_quote(column)}"

    pieces = _parse_replacement(capture.route_topic_replacement)
    topic_parts = ["routed" if p is None else _literal(p) for p in pieces]
    topic_expr = " || ".join(topic_parts) if topic_parts else "''"
    id_col = new(capture.field_event_id)
    event_id = id_col if types.get(capture.field_event_id) == "uuid" else "gen_random_uuid()"
    payload = new(capture.field_payload)
    if types.get(capture.field_payload) == "bytea":
        payload_expr = payload
        # A byte array is never "empty" to the router (its toString is never blank).
        empty = f"{payload} IS NULL"
    else:
        payload_expr = f"convert_to({payload}::text, 'UTF8')"
        # Java's String.trim() strips every char <= U+0020.
        empty = f"coalesce({payload}::text ~ '^[\\x01-\\x20]*$', true)"
    if capture.route_tombstone_on_empty_payload:
        payload_expr = f"CASE WHEN {empty} THEN NULL ELSE {payload_expr} END"
    headers = [(h.alias, h.column) for h in capture.additional_headers if h.column in types]
    pairs = [f"'id', {id_col}::text"] + [f"{_literal(a)}, {new(c)}::text" for a, c in headers]
    # A header may be null (the router sends it so), but the event id may not.
    id_name, source = capture.field_event_id, f"{capture.schema}.{capture.table}"
    checks = [
        f"    IF {id_col} IS NULL THEN\n"
        "        RAISE EXCEPTION USING ERRCODE = 'not_null_violation',\n"
        f"            MESSAGE = 'notify-outbox Debezium capture: column {id_name} '\n"
        f"                || '(table.field.event.id) is NULL in a new row of {source}; '\n"
        "                || 'it is the event id';\n"
        "    END IF;"
    ]
    key_expr = f"{new(capture.field_event_key)}::text"
    type_expr = (
        f"{new(capture.field_event_type)}::text" if capture.field_event_type in types else "NULL"
    )
    template = (sql_dir() / "debezium" / "capture.sql").read_text(encoding="utf-8")
    tokens = {
        "@function@": capture.function,
        "@source@": capture.qualified_table,
        "@source_name@": f"{capture.schema}.{capture.table}",
        "@outbox@": names.qualified_table,
        "@route_column@": _quote(capture.route_by_field),
        "@route_name@": capture.route_by_field,
        "@topic_expr@": topic_expr,
        "@null_checks@": "\n".join(checks),
        "@event_id_expr@": event_id,
        "@key_expr@": key_expr,
        "@payload_expr@": payload_expr,
        "@header_pairs@": ", ".join(pairs),
        "@type_expr@": type_expr,
    }
    return render(template, _Rendered(tokens))


_COLUMNS = """
SELECT a.attname, t.typname
FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid
WHERE a.attrelid = to_regclass($1) AND a.attnum > 0 AND NOT a.attisdropped
"""


async def _column_types(
    conn: asyncpg.Connection, capture: DebeziumCapture, names: OutboxNames
) -> dict[str, str]:
    """Check the source table against the options; the types of the columns the capture
    reads. Raises ConfigurationError naming what is wrong."""
    source = f"{capture.schema}.{capture.table}"
    if (capture.schema, capture.table) == (names.schema, names.table):
        raise ConfigurationError(
            f"the Debezium outbox table and notify-outbox's own outbox are both {source}: give "
            "notify-outbox's its own name (NOTIFY_OUTBOX_TABLE, --table), e.g. relay_outbox"
        )
    if not await conn.fetchval("SELECT to_regclass($1) IS NOT NULL", names.qualified_table):
        raise MigrationError(
            f"notify-outbox's outbox table {names.schema}.{names.table} does not exist: run "
            "`notify-outbox migrate` (with the same --schema/--table) first"
        )
    if not await conn.fetchval("SELECT to_regclass($1) IS NOT NULL", capture.qualified_table):
        raise ConfigurationError(
            f"the Debezium outbox table {source} does not exist (--source-schema, --source-table)"
        )
    rows = await conn.fetch(_COLUMNS, capture.qualified_table)
    present = {r["attname"]: r["typname"] for r in rows}
    wanted: list[tuple[str, str, set[str], bool]] = [
        ("table.field.event.id", capture.field_event_id, _TEXT_TYPES, True),
        ("table.field.event.key", capture.field_event_key, _TEXT_TYPES, True),
        ("table.field.event.payload", capture.field_payload, _PAYLOAD_TYPES, True),
        ("route.by.field", capture.route_by_field, _ROUTE_TYPES, True),
        ("table.field.event.type", capture.field_event_type, _TEXT_TYPES, False),
    ] + [
        (f"header {h.alias!r}", h.column, _TEXT_TYPES, not capture.ignore_missing_fields)
        for h in capture.additional_headers
    ]
    types: dict[str, str] = {}
    for option, column, allowed, required in wanted:
        typ = present.get(column)
        if typ is None:
            if required:
                raise ConfigurationError(
                    f"the Debezium outbox table {source} has no column {column!r} ({option}); "
                    f"its columns: {', '.join(sorted(present))}"
                )
            continue
        if typ not in allowed:
            raise ConfigurationError(
                f"column {column!r} of {source} ({option}) has type {typ}, which is not "
                f"supported here; use one of: {', '.join(sorted(allowed))}"
            )
        types[column] = typ
    return types


async def install_capture(
    conn: asyncpg.Connection, capture: DebeziumCapture, names: OutboxNames
) -> str:
    """Check the source table and (re)install its capture trigger; returns the SQL applied.
    Idempotent; run it again after changing the options."""
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock($1::bigint)", names.lock_namespace)
        sql = render_capture(capture, names, await _column_types(conn, capture, names))
        await conn.execute(sql)
    return sql


@dataclass
class CaptureReport:
    """What ``verify_capture`` found."""

    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when the installed trigger is the one these options render."""
        return not self.problems

    def describe(self) -> str:
        """One line per finding."""
        if self.ok:
            return "Debezium capture up to date"
        return "\n".join([*self.problems, "(run `notify-outbox debezium install`)"])


_BODY = re.compile(r"\$fn\$(.*)\$fn\$", re.DOTALL)


async def verify_capture(
    conn: asyncpg.Connection, capture: DebeziumCapture, names: OutboxNames
) -> CaptureReport:
    """Whether the installed capture matches these options, without changing anything."""
    report = CaptureReport()
    try:
        types = await _column_types(conn, capture, names)
    except (ConfigurationError, MigrationError) as e:
        report.problems.append(str(e))
        return report
    match = _BODY.search(render_capture(capture, names, types))
    assert match is not None
    body = await conn.fetchval(
        "SELECT prosrc FROM pg_proc WHERE oid = to_regprocedure($1 || '()')", capture.function
    )
    enabled = await conn.fetchval(
        "SELECT tgenabled FROM pg_trigger WHERE tgrelid = to_regclass($1) "
        "AND tgname = 'notify_outbox_capture'",
        capture.qualified_table,
    )
    if body is None:
        report.problems.append(f"capture function {capture.function} is missing")
    elif body != match.group(1):
        report.problems.append(
            f"capture function {capture.function} differs from these options (stale options?)"
        )
    if enabled is None:
        report.problems.append(
            f"trigger notify_outbox_capture on {capture.qualified_table} is missing"
        )
    elif enabled == "D":
        report.problems.append(
            f"trigger notify_outbox_capture on {capture.qualified_table} is disabled"
        )
    return report
