"""Where the relay's ports come from when it is not given them: the PostgreSQL store (its
workers' pool, the schema check, the gated notify's configuration, the pulse) and the Kafka
publisher. The relay itself works through the ports only (``OutboxStore``, ``Publisher``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import asyncpg

from notify_outbox.core.errors import ConfigurationError, MigrationError
from notify_outbox.core.settings import OutboxSettings
from notify_outbox.kafka.publisher import KafkaPublisher, Publisher, TokenProvider
from notify_outbox.pg.db import connect_worker_pool
from notify_outbox.pg.sqlfiles import Queries, render
from notify_outbox.pg.store import PgOutboxStore

from .listener import Listener
from .outage import Outage
from .pulse import Pulse, worker_app

__all__ = [
    "PostgresPorts",
    "SharedPorts",
    "connect_pool",
    "kafka_publisher",
    "open_postgres",
    "require_schema",
]


@dataclass
class SharedPorts:
    """What the relays of one database's outboxes share when one process serves many
    (``fleet.py``): the workers' pool, the listening connection, the pulse, the Kafka
    producer, the outage tracking. The fleet owns them; a relay given them only uses them."""

    pool: asyncpg.Pool
    behind_pooler: bool
    publisher: Publisher
    #: The listener of the outbox's channel (None: poll-only); already listening.
    listener: Listener | None
    pulse: Pulse | None
    relay_id: str
    #: Kafka's outage is the fleet's; PostgreSQL's is each outbox's own (a failing
    #: statement, a permission, a broken schema, is one tenant's problem).
    kafka_outage: Outage
    #: Awaited by a worker after each full claim (a backlog), with the seconds that claim
    #: took: the fleet's pause that leaves the other outboxes their share (None: none).
    pace: Callable[[float], Awaitable[None]] | None = None
    #: Asked before each claim: a smaller claim size for now (None: ``batch_size``).
    limit: Callable[[], int | None] | None = None


@dataclass
class PostgresPorts:
    """The PostgreSQL side of a relay: the store and what came with it."""

    pool: asyncpg.Pool
    store: PgOutboxStore
    #: Whether NOTIFY_OUTBOX_DSN goes through a connection pooler (no primed claims then).
    behind_pooler: bool
    #: The database's ``notify_mode`` (gated, always, off) and the awake marker's epoch.
    notify_mode: str
    awake_epoch_ms: int
    #: The frozen relays' reaper, not started (None: off, or behind a pooler).
    pulse: Pulse | None


async def require_schema(pool: asyncpg.Pool, settings: OutboxSettings) -> None:
    """Raise MigrationError when the outbox is missing or older than this relay, and
    ConfigurationError when its id sequence caches values (the claim's low-water mark needs
    ids handed out one at a time: migration 0006)."""
    names = settings.names
    # The newest migration's claim function: older schemas lack it.
    claim_fn = render(
        "@schema@.@prefix@_claim(integer, integer, bigint, bigint[], bigint[])", names
    )
    if not await pool.fetchval("SELECT to_regprocedure($1) IS NOT NULL", claim_fn):
        raise MigrationError(
            f"outbox {names.target} is missing or not up to date: run `notify-outbox migrate` first"
        )
    # Migration 0007: the delivery mode the outbox is set to (none before it: at-least-once).
    mode = await pool.fetchval(Queries(names)["delivery"])
    if mode is None and settings.delivery == "exactly-once":
        raise MigrationError(
            f"outbox {names.target} predates exactly-once delivery (migration 0007): run "
            "`notify-outbox migrate` first"
        )
    mode = mode or "at-least-once"
    if mode != settings.delivery:
        raise ConfigurationError(
            f"outbox {names.target} is set to {mode} delivery and this relay to "
            f"{settings.delivery} (NOTIFY_OUTBOX_DELIVERY): the two must agree. To switch, stop "
            f"every relay of the outbox, run `notify-outbox delivery {settings.delivery}`, and "
            "start relays of that mode only"
        )
    sequence = render("@id_seq@", names)
    cache = await pool.fetchval(
        "SELECT seqcache FROM pg_sequence WHERE seqrelid = to_regclass($1)", sequence
    )
    if cache is not None and cache != 1:
        raise ConfigurationError(
            f"the id sequence {sequence} caches {cache} values per session; notify-outbox "
            f"needs ALTER SEQUENCE {sequence} CACHE 1 (ids must be handed out one at a time "
            "for the claim to know where fresh rows start)"
        )


async def connect_pool(settings: OutboxSettings, relay_id: str) -> tuple[asyncpg.Pool, bool]:
    """The workers' pool (``db.connect_worker_pool``), and whether a pooler sits in between."""
    return await connect_worker_pool(settings, worker_app(relay_id))


async def open_postgres(
    pool: asyncpg.Pool,
    behind_pooler: bool,
    settings: OutboxSettings,
    relay_id: str,
    *,
    begin_round_trip: Callable[[float], None],
    on_reaped: Callable[[int], None],
    shared: bool = False,
) -> PostgresPorts:
    """Over the workers' ``pool``: check the schema, read the notify configuration, and
    build the store (and the pulse, not started). ``shared``: the pool serves many outboxes'
    relays, so the store primes no transaction (a primed connection waits for this outbox's
    next claim, out of the others' reach), and the pulse is the fleet's."""
    s = settings
    await require_schema(pool, s)
    queries = Queries(s.names)
    config = await pool.fetchrow(queries["notify_mode"])
    assert config is not None
    store = PgOutboxStore(
        pool,
        queries,
        delete_on_publish=s.delete_on_publish,
        command_timeout=s.db_command_timeout,
        begin_round_trip=begin_round_trip,
        # Not behind a transaction pooler: a primed transaction would pin a server connection
        # while it waits for the next claim.
        prime=not behind_pooler and not shared,
        server_started=config["server_started"],
    )
    pulse = None
    if s.frozen_relay_timeout > 0 and not behind_pooler and not shared:
        pulse = Pulse(
            s.dsn.get_secret_value(),
            relay_id,
            s.frozen_relay_timeout,
            command_timeout=s.db_command_timeout,
            on_reaped=on_reaped,
        )
        store.reaped_after = s.frozen_relay_timeout
    return PostgresPorts(
        pool=pool,
        store=store,
        behind_pooler=behind_pooler,
        notify_mode=config["notify_mode"],
        awake_epoch_ms=config["awake_epoch_ms"],
        pulse=pulse,
    )


def kafka_publisher(
    settings: OutboxSettings, token_provider: TokenProvider | None = None
) -> KafkaPublisher:
    """The Kafka publisher of the settings, not started."""
    return KafkaPublisher(settings, token_provider=token_provider)
