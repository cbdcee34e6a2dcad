"""The consumer side: an idempotent consumer ("inbox") for events the relay delivered.

The relay delivers at least once, so a consumer sees repeats after crashes, restarts and
rebalances. The inbox makes applying them exactly-once *in the consumer's own database*: each
event id is recorded in a processed-events table in the same transaction as the consumer's
business change, so a repeat finds its id and is skipped, and a failure rolls both back::

    inbox = Inbox(consumer="billing")

    async with conn.transaction():
        async with inbox.process(conn, message) as fresh:
            if fresh:
                await conn.execute("INSERT INTO invoices ...")
    # After the database commit, and only what was processed (a bare commit() would also
    # commit records getmany() returned that are not processed yet):
    await kafka_consumer.commit({TopicPartition(message.topic, message.partition):
                                 message.offset + 1})

or let ``consume`` (a handler per message) or ``consume_batches`` (a handler per batch of
fresh messages) run that loop: one transaction per fetched partition batch, its ids claimed
in one statement, offsets committed after the database commit, a rebalance listener, an
optional Redis fast path. The table comes from its own migration track: ``notify-outbox migrate
--inbox`` (or ``migrate_inbox``), printed by ``notify-outbox sql --inbox``.

The package: ``core.py`` (the ``Inbox``), ``schema.py`` (its table's names, migrations and
queries), ``loop.py`` (the aiokafka loops), ``redis_seen.py`` (the Redis fast path), ``errors.py``.
It re-exports the public names of the former ``notify_outbox.inbox`` module.
"""

from .core import (
    OUTBOX_EVENT_ID_HEADER,
    BatchHandler,
    BatchResult,
    Inbox,
    InboxMessage,
    MessageHandler,
    OnError,
)
from .errors import (
    BadEventId,
    HandlerFailed,
    InboxError,
    InboxNotMigrated,
    InTransaction,
    NotInTransaction,
)
from .loop import InboxRebalanceListener, consume, consume_batches
from .redis_seen import RedisSeen
from .schema import (
    INBOX_TRACK,
    InboxNames,
    migrate_inbox,
    purge_inbox,
    render_inbox_migrations,
    verify_inbox,
)

__all__ = [
    "INBOX_TRACK",
    "OUTBOX_EVENT_ID_HEADER",
    "BadEventId",
    "BatchHandler",
    "BatchResult",
    "HandlerFailed",
    "InTransaction",
    "Inbox",
    "InboxError",
    "InboxMessage",
    "InboxNames",
    "InboxNotMigrated",
    "InboxRebalanceListener",
    "MessageHandler",
    "NotInTransaction",
    "OnError",
    "RedisSeen",
    "consume",
    "consume_batches",
    "migrate_inbox",
    "purge_inbox",
    "render_inbox_migrations",
    "verify_inbox",
]
