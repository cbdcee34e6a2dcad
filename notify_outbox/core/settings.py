"""Settings of the relay, read from ``NOTIFY_OUTBOX_*`` environment variables or passed in code."""

from __future__ import annotations

import difflib
import logging
import os
from collections.abc import Iterable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Annotated, Any, Literal, Self, TypeVar

from pydantic import (
    BeforeValidator,
    Field,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from .errors import ConfigurationError
from .names import OutboxNames, validate_identifier
from .timespec import duration_seconds

__all__ = [
    "DatabaseSettings",
    "OutboxSettings",
    "Seconds",
    "load_settings",
    "read_secret_file",
    "unknown_variables",
    "warn_unknown_variables",
]

log = logging.getLogger("notify_outbox.settings")


def _to_seconds(value: Any) -> Any:
    # A plain number (or anything float() reads) is left to the field's own float parsing
    # and bounds, as before units were accepted: "0" and "-1" get the usual messages.
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, str):
        try:
            float(value)
        except ValueError:
            return duration_seconds(value)
    return value


#: A duration setting, in seconds: a number, a ``timedelta``, or a string with a unit
#: (``250ms``, ``5s``, ``1m``, ``1h``, ``2d``, ISO-8601 ``PT5S``). Bounds (``gt=0``) are the
#: field's, applied to the seconds.
Seconds = Annotated[float, BeforeValidator(_to_seconds)]


def _auto_or_seconds(value: Any) -> Any:
    if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
        return None
    seconds = _to_seconds(value)
    try:
        number = float(seconds)
    except (TypeError, ValueError):
        return seconds  # the float parsing's own message
    # PostgreSQL counts whole milliseconds, and 0 would switch the timeout off.
    if not number >= 0.01:
        raise ValueError("must be 'auto' or a duration of at least 10ms")
    return number


#: A duration setting that may also be ``auto`` (``None``): the relay chooses it.
AutoSeconds = Annotated[float | None, BeforeValidator(_auto_or_seconds)]


def _valid_dsn(v: SecretStr) -> SecretStr:
    value = v.get_secret_value()
    if not value.startswith(("postgresql://", "postgres://")):
        raise ValueError("must be a URL starting with postgresql:// (value not shown)")
    # An unencoded / ? or # in the password ends the URL's authority part early: the rest of
    # the password would then be parsed as the port, and echoed by the error.
    userinfo = value.split("://", 1)[1].rpartition("@")[0]
    if any(c in userinfo for c in "/?#"):
        raise ValueError(
            "has an unencoded /, ? or # before its @ (value not shown): percent-encode "
            "the user name and password"
        )
    return v


_FILE_SUFFIX = "_FILE"


def _secret_fields(cls: type[BaseSettings]) -> list[str]:
    """The fields a ``NOTIFY_OUTBOX_<FIELD>_FILE`` variable may give: the secrets."""
    return [
        name
        for name, field in cls.model_fields.items()
        if field.annotation is not None and "SecretStr" in str(field.annotation)
    ]


def read_secret_file(variable: str, path: str) -> str:
    """The secret in the file a ``*_FILE`` variable names (as Kubernetes mounts a Secret),
    without its trailing newline; a ConfigurationError naming the variable and the path (never
    the content) when it does not read."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().rstrip("\r\n")
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else type(e).__name__
        raise ConfigurationError(f"{variable}: cannot read {path}: {reason}") from None


class _SecretFiles(PydanticBaseSettingsSource):
    """``NOTIFY_OUTBOX_<FIELD>_FILE=/path``: the secret ``<field>`` read from that file. Setting
    a secret both directly and through its file is an error (which one wins would be a guess)."""

    def __init__(self, settings_cls: type[BaseSettings], given: Iterable[str] = ()) -> None:
        super().__init__(settings_cls)
        self._prefix = str(settings_cls.model_config.get("env_prefix", "")).upper()
        self._given = set(given)  # passed in code: neither file nor variable is read

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # all the work is in __call__

    def __call__(self) -> dict[str, Any]:
        env = {k.upper(): v for k, v in os.environ.items()}
        values: dict[str, Any] = {}
        for name in _secret_fields(self.settings_cls):
            if name in self._given:
                continue
            variable = f"{self._prefix}{name.upper()}"
            path = env.get(variable + _FILE_SUFFIX)
            if not path:
                continue
            if env.get(variable):
                raise ConfigurationError(
                    f"{variable} and {variable}{_FILE_SUFFIX} are both set: set one of them"
                )
            values[name] = read_secret_file(variable + _FILE_SUFFIX, path)
        return values


class DatabaseSettings(BaseSettings):
    """Where the outbox lives: enough for ``migrate``, ``verify`` and ``status``.
    Every field maps to ``NOTIFY_OUTBOX_<FIELD>``.

    The DSN may hold a password, so it is a ``SecretStr``: it prints as ``**********`` and
    validation errors never echo any input value.
    """

    model_config = SettingsConfigDict(
        env_prefix="NOTIFY_OUTBOX_",
        extra="ignore",
        hide_input_in_errors=True,
        frozen=True,
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Keywords first, then the secrets' ``*_FILE`` variables, then the environment."""
        return (
            init_settings,
            _SecretFiles(settings_cls, getattr(init_settings, "init_kwargs", {})),
            env_settings,
            dotenv_settings,
            file_secret_settings,
        )

    dsn: SecretStr = Field(
        description="PostgreSQL URL, postgresql://user:password@host/db; it may list several "
        "hosts (high availability: add target_session_attrs=read-write). A secret: never "
        "logged or echoed"
    )
    db_schema: str = Field(
        "public", description="Schema of the outbox table (a lower-case identifier)"
    )
    table: str = Field(
        "outbox", description="Name of the outbox table (a lower-case identifier, at most 40 bytes)"
    )
    channel: str = Field(
        "notify_outbox", description="LISTEN/NOTIFY channel (a lower-case identifier)"
    )
    statement_cache_size: int | None = Field(
        None,
        ge=0,
        description="asyncpg's prepared-statement cache per connection; unset: 100 on a direct "
        "connection, 0 behind a connection pooler (PgBouncer), which is detected at connect",
    )
    connect_timeout: Seconds = Field(
        10.0,
        gt=0,
        description="How long a command (migrate, status, dead-letters, ...) waits for "
        "PostgreSQL to accept its connection before it gives up with exit code 2 and one line "
        "naming the host:port and the timeout; the relay (run) keeps retrying its connections "
        "instead",
    )

    def __init__(self, **values: Any) -> None:
        # ``extra="ignore"`` is for the environment (other NOTIFY_OUTBOX_* variables are the
        # commands' and the tools': ``warn_unknown_variables`` names the unknown ones). A
        # keyword argument is code: a misspelt one would leave its setting at the default.
        fields = type(self).model_fields
        unknown = sorted(k for k in values if k not in fields and not k.startswith("_"))
        if unknown:
            hints = []
            for name in unknown:
                close = difflib.get_close_matches(name, sorted(fields), n=1, cutoff=0.6)
                hints.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
            raise ConfigurationError(
                f"{type(self).__name__}: unknown setting {', '.join(hints)}; the settings are "
                "listed in docs/reference/configuration.md"
            )
        super().__init__(**values)

    @field_validator("dsn")
    @classmethod
    def _dsn_scheme(cls, v: SecretStr) -> SecretStr:
        return _valid_dsn(v)

    @field_validator("db_schema", "table", "channel")
    @classmethod
    def _identifier(cls, v: str, info: ValidationInfo) -> str:
        # The table name is shorter because derived names append suffixes to it.
        limit = 40 if info.field_name == "table" else 63
        try:
            validate_identifier(v, "the name", max_length=limit)
        except ConfigurationError as e:
            raise ValueError(str(e).removeprefix("the name ")) from None
        return v

    @property
    def names(self) -> OutboxNames:
        """The validated schema, table and channel names."""
        return OutboxNames(self.db_schema, self.table, self.channel)


class OutboxSettings(DatabaseSettings):
    """Everything the relay needs to know. Every field maps to ``NOTIFY_OUTBOX_<FIELD>``.

    The Kafka passwords are ``SecretStr`` too.
    """

    # --- where they go ------------------------------------------------------------------------
    kafka_bootstrap_servers: str = Field(
        description="Comma-separated host:port list of Kafka brokers (required by run and replay)"
    )
    kafka_client_id: str = Field(
        "notify-outbox", description="client.id of the relay's Kafka producer"
    )
    kafka_security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = Field(
        "PLAINTEXT", description="How the producer talks to the brokers"
    )
    kafka_sasl_mechanism: (
        Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER"] | None
    ) = Field(None, description="SASL mechanism; required with a SASL_* security protocol")
    kafka_sasl_oauth_token_provider: str | None = Field(
        None,
        description="OAUTHBEARER: where the relay gets its tokens, as `package.module:function`; "
        "the function takes no argument and returns the token (or an awaitable of it), and is "
        "called at each authentication. In code, `Relay(kafka_token_provider=...)` takes the "
        "function itself",
    )
    kafka_sasl_username: str | None = Field(None, description="SASL user name")
    kafka_sasl_password: SecretStr | None = Field(
        None, description="SASL password. A secret: never logged"
    )
    kafka_ssl_cafile: Path | None = Field(
        None, description="TLS: CA certificate file that verifies the brokers"
    )
    kafka_ssl_certfile: Path | None = Field(
        None, description="TLS: the relay's client certificate file"
    )
    kafka_ssl_keyfile: Path | None = Field(None, description="TLS: the client certificate's key")
    kafka_ssl_password: SecretStr | None = Field(
        None, description="TLS: password of the key file. A secret: never logged"
    )
    kafka_compression_type: Literal["gzip", "snappy", "lz4", "zstd"] | None = Field(
        None, description="Producer compression; unset: none"
    )
    kafka_linger_ms: int = Field(
        0,
        ge=0,
        le=1000,
        description="Producer linger.ms, milliseconds: how long it waits to fill a batch",
    )
    kafka_batch_size: int = Field(
        262_144,
        ge=1024,
        description="Producer batch.size, bytes: the largest record batch per partition. "
        "aiokafka sends one request per broker at a time, with one batch per partition, so "
        "this bounds a drain's rate (16 KiB, the Java client's default, took 1.5x the CPU per "
        "event). Keep it below the topics' max.message.bytes",
    )
    kafka_max_request_size: int = Field(
        1_048_576,
        ge=1024,
        description="Producer max.request.size, bytes: a larger row fails (too_large), is "
        "retried, then dead-lettered",
    )
    kafka_request_timeout_ms: int = Field(
        10_000, ge=100, description="Producer request.timeout.ms, milliseconds"
    )
    kafka_idle_check_interval: Seconds = Field(
        5.0,
        gt=0,
        description="How often a relay with nothing to send asks Kafka whether it still "
        "answers (a metadata request), so that an outage is seen when it starts",
    )
    kafka_send_timeout: Seconds = Field(
        15.0, gt=0, description="Deadline in seconds for a batch's acks (aiokafka can wait forever)"
    )
    # --- Schema Registry (the schema-registry extra) --------------------------------------------
    schema_registry_url: str | None = Field(
        None,
        description="Base URL of a Confluent-compatible Schema Registry (Confluent, Karapace, "
        "Apicurio's /apis/ccompat/v7). Set: the JSON events of the governed topics are sent "
        "as Avro or JSON Schema records in Confluent's wire format, encoded with their "
        "subject's latest schema; an event that does not match it is dead-lettered at once",
    )
    schema_registry_username: str | None = Field(
        None, description="Schema Registry: HTTP basic user (Confluent Cloud: the API key)"
    )
    schema_registry_password: SecretStr | None = Field(
        None, description="Schema Registry: HTTP basic password (the API secret). A secret"
    )
    schema_registry_cafile: Path | None = Field(
        None, description="Schema Registry: the CA that verifies an https registry"
    )
    schema_registry_topics: str = Field(
        "*",
        description="Schema Registry: the governed topics, comma-separated glob patterns "
        "(orders.*,payments); other topics are sent as before",
    )
    schema_registry_subject_strategy: Literal["topic", "record", "topic-record"] = Field(
        "topic",
        description="Schema Registry: the value subject of an event: <topic>-value; its "
        "event_type (the record's full name); or <topic>-<event_type>",
    )
    schema_registry_keys: bool = Field(
        False,
        description="Schema Registry: encode keys too, with the <topic>-key subject's schema "
        "(else keys stay UTF-8 text)",
    )
    schema_registry_refresh: Seconds = Field(
        30.0,
        gt=0,
        description="Schema Registry: how long a subject's latest schema is used before it is "
        "read again (a mismatch re-reads it at once)",
    )
    claim_idle_timeout: AutoSeconds = Field(
        2.0,
        description="A claim's transaction left idle this long is ended by PostgreSQL "
        "(idle_in_transaction_session_timeout), which frees its keys for the other relays: a "
        "relay frozen (a VM stall, a debugger) holds its keys this long at most, and a relay "
        "only slower than this loses its claim and may publish its rows twice. 'auto': three "
        "times the relay's worst recent stall (its event loop's plus its round trip to "
        "PostgreSQL), between 0.1 and 2 s: a frozen relay's keys wait about 0.1 s on a "
        "healthy host, at the price of duplicates when a relay's host goes from quiet to "
        "starved at once. A working relay renews it while it waits for Kafka's acks",
    )
    frozen_relay_timeout: Seconds = Field(
        0.15,
        ge=0,
        description="A relay whose process did not run this long (its pulse, a thread with a "
        "connection of its own, silent: SIGSTOP, a VM pause, a debugger) while a claim of it "
        "sat idle as long has that claim ended by another relay (pg_terminate_backend), so its "
        "keys wait about this long instead of claim_idle_timeout. A busy event loop does not "
        "silence the pulse; a process starved of CPU (a container at its CPU limit) does, for "
        "a while: a relay whose pulse ran late recently is given three times its worst recent "
        "delay (up to 2 s) instead, and so is every relay by one that ran late itself; a relay "
        "under a CPU quota (cgroup) at least two of its periods. Needs "
        "the relays to see and signal each other's sessions (one role, or pg_signal_backend); "
        "off behind a connection pooler; 0 turns it off",
    )

    # --- how the relay works ------------------------------------------------------------------
    workers: int = Field(4, ge=1, le=256, description="Worker coroutines claiming in parallel")
    batch_size: int = Field(
        1000,
        ge=1,
        le=10_000,
        description="Rows per claim: one transaction, held open while Kafka acknowledges them",
    )
    poll_interval: Seconds = Field(
        5.0,
        gt=0,
        description="Fallback poll: a cheap EXISTS check for rows a missed NOTIFY left behind, "
        "so the idle cost stays low",
    )
    poll_only: bool = Field(
        False,
        description="Never LISTEN: claim on the fallback poll only (then set a short "
        "poll_interval)",
    )
    outboxes: str | None = Field(
        None,
        description="Serve many outboxes of the database in one process (a schema per tenant): "
        "`*` for every migrated outbox, re-checked while running (a new one is served without a "
        "restart, a dropped one let go), or a comma-separated list of schema.table; unset: the "
        "one outbox of db_schema and table. At-least-once delivery only",
    )
    fleet_file: Path | None = Field(
        None,
        description="Serve the outboxes of several databases in one process: a TOML file of "
        "[[database]] tables, each with its DSN (dsn_env, dsn_file or dsn; none: "
        "NOTIFY_OUTBOX_DSN) and outboxes (* or a list of schema.table); see "
        "docs/operations/many-outboxes.md",
    )
    outbox_schemas_like: str | None = Field(
        None,
        description="With outboxes=*: only schemas whose name matches this SQL LIKE pattern "
        "(tenant\\_%)",
    )
    outbox_workers: int | None = Field(
        None,
        ge=1,
        le=256,
        description="With outboxes: workers per outbox (default: half of workers, at least 1); "
        "workers then bounds the database's pool (workers + 2 connections)",
    )
    outbox_drain_share: float = Field(
        0.15,
        gt=0,
        le=1,
        description="With outboxes: the share of the time an outbox draining a backlog may "
        "claim while other outboxes of its database had events in the last second (after "
        "each full claim its worker pauses for the rest, and its claims take at most 100 "
        "rows); alone, it drains at full speed. 1: never paused. A drain's claims and marks "
        "slow every commit of its database: at 0.15 the others' p99 during a 100,000-row "
        "drain was 12-18 ms in four runs (0.25: 15-22 ms, above 20 ms in three runs of six) "
        "against 52-364 ms at 1, the drain at about 0.08x its speed "
        "(docs/operations/many-outboxes.md)",
    )
    discovery_interval: Seconds = Field(
        60.0,
        gt=0,
        description="With outboxes=*: how often the catalog is looked at for new and dropped "
        "outboxes (riding on a fallback poll: it costs no statement of its own)",
    )
    listen_dsn: SecretStr | None = Field(
        None,
        description="DSN of the one listening connection, when NOTIFY_OUTBOX_DSN goes through "
        "a transaction-pooling PgBouncer (LISTEN needs a session: point this at PostgreSQL "
        "itself or at a session-pooling pooler); unset: NOTIFY_OUTBOX_DSN",
    )
    listen_health_interval: Seconds = Field(
        10.0,
        gt=0,
        description="How often the listening connection proves itself: it NOTIFYs a token and "
        "must hear the echo",
    )
    listen_health_timeout: Seconds = Field(
        5.0,
        gt=0,
        description="How long that echo may take before the listener reconnects (also the "
        "proof of LISTEN through a pooler at start)",
    )
    reconnect_min_delay: Seconds = Field(
        0.05,
        gt=0,
        description="Floor of the backoff, with jitter, between attempts to reach PostgreSQL "
        "(and Kafka at start)",
    )
    reconnect_max_delay: Seconds = Field(
        0.5,
        gt=0,
        description="Cap of the backoff between attempts to reach PostgreSQL (and Kafka at "
        "start): short, so that delivery resumes within about a second of a server's return; "
        "a refused connection costs the server nothing, and the log stays quiet meanwhile",
    )
    db_command_timeout: Seconds = Field(
        30.0,
        gt=0,
        description="Deadline of every statement the relay sends: the workers' claims and marks, "
        "LISTEN, the health probe, the table gauges. It is what bounds a silently dead "
        "connection (a network cut that closes nothing): the relay gives it up after this long "
        "and reconnects, while claim_idle_timeout frees that claim's rows for the other relays",
    )
    gate_linger: Seconds = Field(
        0.01,
        ge=0,
        description="Gated notify: how long an idle, awake relay keeps looking for rows before "
        "it lets producers NOTIFY again (seconds)",
    )
    gate_poll_interval: Seconds = Field(
        0.002, gt=0, description="Gated notify: seconds between looks while lingering"
    )
    gate_awake_after: Seconds = Field(
        0.02,
        ge=0,
        description="Gated notify: seconds of unbroken draining before the relay marks itself "
        "awake and producers stop notifying (at low load it never does, and producers simply "
        "notify); 0 marks it at the first claim",
    )
    gate_awake_rate: int = Field(
        500,
        ge=0,
        description="Gated notify: rows per second the relay must be claiming before it marks "
        "itself awake (and producers stop notifying); below half of it an awake relay lets "
        "producers notify again at once instead of lingering. An awake relay finds rows by "
        "looking every gate_poll_interval, which costs latency and statements; a NOTIFY costs "
        "producers a cluster-wide lock at commit, which matters only when many commit at once. "
        "Measured here: at 100 ev/s notifying is faster, at 1,000 ev/s the gate is. 0: awake "
        "whenever gate_awake_after allows",
    )

    header_style: Literal["native", "debezium"] = Field(
        "native",
        description="Kafka headers: native (outbox-event-id, ...) or debezium (the 'id' header "
        "and the fields the Debezium capture put in the row's headers, as Debezium's outbox "
        "event router; see notify_outbox/debezium/)",
    )

    # --- delivery -----------------------------------------------------------------------------
    delivery: Literal["at-least-once", "exactly-once"] = Field(
        "at-least-once",
        description="at-least-once (the default: a crash can send an event twice; consumers "
        "drop repeats by outbox-event-id) or exactly-once (Kafka transactions: a read_committed "
        "consumer sees each event once; see docs/concepts/exactly-once.md). The outbox must be "
        "set to the same mode (`notify-outbox delivery`)",
    )
    eos_slots: int = Field(
        8,
        ge=1,
        le=1024,
        description="exactly-once: the transactional slots of this outbox, shared by every relay "
        "(each worker holds one; a relay's workers beyond the free slots wait). Keep it the same "
        "on every relay of the outbox",
    )
    eos_lease: Seconds = Field(
        10.0,
        gt=0,
        description="exactly-once: how long a slot stays a relay's without renewal (renewed "
        "every third of it). A relay frozen for longer loses its slots: another relay fences "
        "its producer and settles its batch in flight",
    )
    eos_transaction_timeout: Seconds = Field(
        10.0,
        ge=1,
        description="exactly-once: Kafka's transaction.timeout.ms for the relay's transactions. "
        "A transaction left open by a frozen relay holds back read_committed consumers (its "
        "partitions' last stable offset) until the broker aborts it, at its next expiry check "
        "after this (every 10 s by default), or another relay takes the slot after eos_lease: "
        "to shorten that stall, shorten eos_lease (docs/benchmarks.md). Must exceed a healthy "
        "batch's send and commit, seconds when a broker fails over",
    )
    eos_marker_topic: str = Field(
        "notify_outbox.eos_markers",
        pattern=r"^[A-Za-z0-9._-]{1,249}$",
        description="exactly-once: the compacted topic of batch markers (created by the relay "
        "if missing): recovery reads it to learn whether a batch's transaction committed",
    )
    eos_transactional_id_prefix: str | None = Field(
        None,
        description="exactly-once: prefix of the slots' transactional.id (slot number "
        "appended), unique to this outbox in the Kafka cluster (it also keys the markers); "
        "unset: notify-outbox.<database>.<schema>.<table>. Set it where two PostgreSQL "
        "servers have a database and outbox of the same names and share one Kafka",
    )

    # --- failures -----------------------------------------------------------------------------
    max_attempts: int = Field(10, ge=1, description="Attempts before a row is dead-lettered")
    retry_base_delay: Seconds = Field(
        1.0, ge=0, description="First per-row retry delay; it doubles, with jitter, per attempt"
    )
    retry_max_delay: Seconds = Field(300.0, ge=0, description="Cap of the per-row retry delay")

    # --- retention and shutdown ---------------------------------------------------------------
    keep_published: Seconds = Field(
        0.0, ge=0, description="Seconds to keep published rows; 0 deletes them on publish"
    )
    cleanup_interval: Seconds = Field(
        60.0,
        gt=0,
        description="How often the retention cleanup runs (kept published rows, dead letters)",
    )
    cleanup_batch: int = Field(5000, ge=1, description="Rows the cleanup deletes per statement")
    dead_letter_retention: Seconds | None = Field(
        None,
        gt=0,
        description="How long dead letters are kept, from their dead-lettering: seconds or a "
        "duration (30d, 12h, P7D); unset: forever. Applied by the relay's cleanup",
    )
    shutdown_timeout: Seconds = Field(
        30.0,
        gt=0,
        description="How long a graceful stop waits for in-flight batches (then exit code 3)",
    )

    # --- monitoring (notify_outbox/ops/http.py) -----------------------------------------------
    http_host: str = Field("127.0.0.1", description="Address of /metrics, /livez and /readyz")
    http_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="Port of /metrics, /livez and /readyz; unset: no server. A port in use "
        "exits 2 with one line",
    )

    @field_validator("listen_dsn")
    @classmethod
    def _listen_dsn_scheme(cls, v: SecretStr | None) -> SecretStr | None:
        return None if v is None or not v.get_secret_value() else _valid_dsn(v)

    @field_validator("dead_letter_retention", mode="before")
    @classmethod
    def _retention(cls, v: Any) -> Any:
        # An empty variable means "keep forever"; "30d" is read by Seconds.
        return None if isinstance(v, str) and not v.strip() else v

    @field_validator("kafka_bootstrap_servers")
    @classmethod
    def _servers(cls, v: str) -> str:
        servers = [s.strip() for s in v.split(",") if s.strip()]
        if not servers or any(":" not in s for s in servers):
            raise ValueError("must be a comma-separated list of host:port")
        return ",".join(servers)

    @field_validator("outboxes")
    @classmethod
    def _outboxes(cls, v: str | None) -> str | None:
        if v is None or v.strip() == "*":
            return None if v is None else "*"
        targets = [t.strip() for t in v.split(",") if t.strip()]
        for target in targets:
            schema, dot, table = target.partition(".")
            try:
                if not dot:
                    raise ConfigurationError("")
                OutboxNames(schema, table)
            except ConfigurationError:
                raise ValueError(
                    "must be * or a comma-separated list of schema.table (lower-case identifiers)"
                ) from None
        if not targets:
            raise ValueError("must be * or a comma-separated list of schema.table")
        return ",".join(targets)

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        # Errors about several fields name each one with its variable (the model-level
        # error has no single field that format_validation_error could name).
        if self.kafka_security_protocol.startswith("SASL_"):
            if self.kafka_sasl_mechanism is None:
                raise ValueError(
                    f"{_var('kafka_sasl_mechanism')} is required with a SASL_* "
                    f"{_var('kafka_security_protocol')}"
                )
            oauth = self.kafka_sasl_mechanism == "OAUTHBEARER"
            # OAUTHBEARER's tokens come from a provider (the setting, or one given in code).
            if not oauth and (not self.kafka_sasl_username or self.kafka_sasl_password is None):
                raise ValueError(
                    f"{_var('kafka_sasl_username')} and {_var('kafka_sasl_password')} are "
                    "required for SASL"
                )
        if self.outboxes is not None and self.delivery == "exactly-once":
            raise ValueError(
                f"{_var('outboxes')} serves many outboxes with at-least-once delivery only: "
                f"run one relay per outbox with {_var('delivery')} exactly-once"
            )
        if self.fleet_file is not None and self.outboxes is not None:
            raise ValueError(
                f"{_var('fleet_file')} names the outboxes of each database: unset "
                f"{_var('outboxes')}"
            )
        if self.fleet_file is not None and self.delivery == "exactly-once":
            raise ValueError(
                f"{_var('fleet_file')} serves many outboxes with at-least-once delivery only"
            )
        if self.outbox_schemas_like is not None and self.outboxes != "*":
            raise ValueError(
                f"{_var('outbox_schemas_like')} is used only with NOTIFY_OUTBOX_OUTBOXES=*"
            )
        for low, high in (
            ("retry_base_delay", "retry_max_delay"),
            ("reconnect_min_delay", "reconnect_max_delay"),
        ):
            if getattr(self, high) < getattr(self, low):
                raise ValueError(f"{_var(high)} must be >= {_var(low)}")
        return self

    @property
    def delete_on_publish(self) -> bool:
        """Whether published rows are deleted at once rather than kept for a while."""
        return self.keep_published == 0


_S = TypeVar("_S", bound=DatabaseSettings)


def load_settings(
    cls: type[_S], /, *, flags: Mapping[str, str] | None = None, **overrides: Any
) -> _S:
    """Build settings of type ``cls`` from the environment plus ``overrides`` (None values are
    ignored, so unset CLI flags fall back to the environment).

    Raises ConfigurationError with one line per wrong setting, naming the environment variable
    and never quoting a value (so a password in a DSN cannot leak into logs). ``flags`` maps
    a field to the command-line flag its override came from (``{"poll_interval":
    "--poll-interval"}``): an error about a field set that way names the flag instead.
    """
    given = {k: v for k, v in overrides.items() if v is not None}
    try:
        return cls(**given)
    except ValidationError as e:
        named = {field: flag for field, flag in (flags or {}).items() if field in given}
        raise ConfigurationError(format_validation_error(e, flags=named)) from None


def _var(field: str) -> str:
    return f"{field} (NOTIFY_OUTBOX_{field.upper()})"


def format_validation_error(
    error: ValidationError, *, flags: Mapping[str, str] | None = None
) -> str:
    """One line per problem: ``NOTIFY_OUTBOX_X: message`` (or ``--x: message`` for a field in
    ``flags``, which maps fields to the flags that set them), without input values."""
    lines = []
    for item in error.errors(include_input=False, include_url=False):
        loc = [str(p) for p in item["loc"] if p != "__root__"]
        if not loc:
            field = "settings"
        elif flags and loc[0] in flags:
            field = flags[loc[0]]
        else:
            field = f"NOTIFY_OUTBOX_{loc[0].upper()}"
        msg = str(item["msg"]).removeprefix("Value error, ")
        if item["type"] == "missing":
            msg = "is required but not set"
        lines.append(f"{field}: {msg}")
    return "invalid settings:\n  " + "\n  ".join(lines)


# --- unknown variables ------------------------------------------------------------------------

_PREFIX = "NOTIFY_OUTBOX_"
# Read by name outside the settings classes (suffixes after the prefix), with what they mean:
# the configuration reference (tools/docgen.py) lists them after the settings.
_OTHER_VARIABLES: Mapping[str, str] = {
    # cli/app.py / core/logs.py
    "LOG_FORMAT": "Log format of the daemon and the commands: text (the default) or json, one "
    "JSON object per line; secrets are redacted in both",
    # cli/inbox.py
    "INBOX_SCHEMA": "Schema of the consumer's inbox table for migrate/verify/sql --inbox and "
    "inbox purge (default public; --schema wins)",
    "INBOX_TABLE": "Name of the consumer's inbox table (default inbox; --table wins)",
    # cli/debezium.py
    "DEBEZIUM_CONFIG": "Debezium mode: a Kafka Connect connector configuration (.properties or "
    "JSON) whose EventRouter options are read (--connector-config wins)",
    "DEBEZIUM_SCHEMA": "Debezium mode: schema of the Debezium-shaped outbox table (default "
    "public; --source-schema wins)",
    "DEBEZIUM_TABLE": "Debezium mode: the Debezium-shaped outbox table (default outbox; "
    "--source-table wins)",
}
# The tools' own variables (fault suite, devstack, bench), set around commands in tests and on
# developers' machines: known, so they cause no warning, but never suggested to a user. Any
# NOTIFY_OUTBOX_TEST_* is the test suites' too (TEST_DSN, TEST_CRASH_AT, ...).
_TOOL_VARIABLES = frozenset(
    {
        "FAULT_SEED",
        "FAULT_SOAK",
        "PG_BINDIR",
        "PG_VERSION",
        "REDIS_SERVER",
        "STACK_DIR",
        "CACHE_DIR",
        # The relay's per-claim stage log for the bench's --stages (stagelog.py): not a setting.
        "STAGE_LOG",
    }
)
_TOOL_PREFIX = "TEST_"


def _setting_suffixes(classes: Iterable[type[BaseSettings]]) -> set[str]:
    names: set[str] = set()
    for cls in classes:
        prefix = str(cls.model_config.get("env_prefix", "")).upper()
        if prefix == _PREFIX:
            names.update(field.upper() for field in cls.model_fields)
            names.update(field.upper() + _FILE_SUFFIX for field in _secret_fields(cls))
    return names


def unknown_variables(
    env: Mapping[str, str] | None = None,
    *,
    settings: Iterable[type[BaseSettings]] = (DatabaseSettings, OutboxSettings),
) -> list[tuple[str, str | None]]:
    """The ``NOTIFY_OUTBOX_*`` variables of ``env`` (default: the environment) that neither a
    class of ``settings`` nor the command line reads, each with the closest known name (or
    None), in name order. Only names are looked at, never values."""
    source = os.environ if env is None else env
    offered = _setting_suffixes(settings) | set(_OTHER_VARIABLES)
    found = []
    for name in sorted(source):
        upper = name.upper()  # pydantic-settings reads names in any case
        if not upper.startswith(_PREFIX):
            continue
        suffix = upper.removeprefix(_PREFIX)
        if suffix in offered or suffix in _TOOL_VARIABLES or suffix.startswith(_TOOL_PREFIX):
            continue
        # Matched without the common prefix, which would make every name look alike.
        close = difflib.get_close_matches(suffix, sorted(offered), n=1, cutoff=0.6)
        found.append((name, _PREFIX + close[0] if close else None))
    return found


def warn_unknown_variables(
    env: Mapping[str, str] | None = None,
    *,
    settings: Iterable[type[BaseSettings]] = (DatabaseSettings, OutboxSettings),
) -> list[str]:
    """Log a WARNING for every unknown ``NOTIFY_OUTBOX_*`` variable (see ``unknown_variables``)
    with a did-you-mean; returns their names. A typo would otherwise leave a setting at its
    default without a word. The value is never logged: it may be a secret."""
    found = unknown_variables(env, settings=settings)
    for name, suggestion in found:
        hint = f"; did you mean {suggestion}?" if suggestion else ""
        log.warning("unknown environment variable %s is ignored%s", name, hint)
    return [name for name, _ in found]
