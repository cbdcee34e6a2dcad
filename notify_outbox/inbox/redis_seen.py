"""The inbox's optional fast path: ``RedisSeen`` remembers applied event ids in Redis, so a
repeat is skipped without a database round trip (the database stays the truth).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import anyio

from notify_outbox.core.errors import ConfigurationError

from .errors import InboxError

if TYPE_CHECKING:
    import redis.asyncio

    from .core import Inbox

__all__ = [
    "RedisSeen",
]

log = logging.getLogger("notify_outbox.inbox")


class RedisSeen:
    """An optional pre-check in front of the inbox table: ids Redis has seen are skipped
    without a database transaction. The database stays the source of truth:

    - an id is written to Redis only after its database transaction committed, so "seen" in
      Redis implies the id is committed in the database;
    - Redis unreachable, slow (``timeout``), or emptied: the check answers "not seen" and the
      database decides, as without Redis. Losing Redis costs speed, never a double apply.

    Keys are ``{prefix}:{scope}:{inbox target}:{consumer}:{event id}``; ``scope`` is a hash of
    the database's identity (the cluster's system identifier and the database's oid) and the
    inbox table, so services sharing one Redis never see each other's ids. They expire after
    ``ttl``, which must be shorter than the inbox table's retention (otherwise nothing is lost,
    but Redis would skip what the database no longer knows; that is the same trade-off as
    retention). After restoring the consumer's database from a backup, delete these keys:
    Redis would otherwise vouch for ids the restored database no longer has. Needs
    ``pip install 'notify-outbox[redis]'``.
    """

    def __init__(
        self,
        client: redis.asyncio.Redis,
        *,
        ttl: timedelta = timedelta(days=1),
        prefix: str = "notify-outbox",
        timeout: float = 0.25,
    ) -> None:
        if ttl <= timedelta(0):
            raise ConfigurationError("ttl must be a positive duration")
        self.client = client
        self.ttl = ttl
        self.prefix = prefix
        self.timeout = timeout
        self.errors = 0
        self._down = False

    def key(self, inbox: Inbox, event_id: str, scope: str | None = None) -> str:
        """The Redis key of one id of one inbox and consumer, in the database ``scope``
        (default: the one ``inbox`` last used with Redis)."""
        scope = scope or inbox.last_scope
        if scope is None:
            raise InboxError("the inbox has not been used with a database yet: pass scope")
        return f"{self.prefix}:{scope}:{inbox.names.target}:{inbox.consumer}:{event_id}"

    async def seen(self, inbox: Inbox, event_id: str, scope: str) -> bool:
        """True only if Redis answered that it has the id; False on any trouble."""
        result = await self._call(self.client.exists, self.key(inbox, event_id, scope))
        return bool(result)

    async def seen_many(self, inbox: Inbox, event_ids: Sequence[str], scope: str) -> set[str]:
        """The ids Redis has (one round trip); none on any trouble."""
        if not event_ids:
            return set()
        keys = [self.key(inbox, e, scope) for e in event_ids]
        found = await self._call(self.client.mget, keys)
        if not found:
            return set()
        return {e for e, v in zip(event_ids, found, strict=True) if v is not None}

    async def remember(self, inbox: Inbox, event_id: str, scope: str | None = None) -> None:
        """Record an id whose database transaction has committed (best effort)."""
        await self._call(self.client.set, self.key(inbox, event_id, scope), b"1", ex=self.ttl)

    async def remember_many(self, inbox: Inbox, event_ids: Sequence[str], scope: str) -> None:
        """Record committed ids in one pipelined round trip (best effort)."""
        if not event_ids:
            return

        async def write() -> None:
            pipe = self.client.pipeline(transaction=False)
            for e in event_ids:
                pipe.set(self.key(inbox, e, scope), b"1", ex=self.ttl)
            await pipe.execute()

        await self._call(write)

    async def _call(self, fn: Callable[..., Awaitable[Any]], *args: Any, **kwargs: Any) -> Any:
        from redis.exceptions import RedisError

        try:
            with anyio.fail_after(self.timeout):
                result = await fn(*args, **kwargs)
        except (RedisError, OSError, TimeoutError) as e:
            self.errors += 1
            if not self._down:
                # One line per outage: the database check carries on meanwhile.
                log.warning("Redis fast path unavailable (%s); checking the database only", e)
                self._down = True
            return None
        if self._down:
            log.info("Redis fast path available again")
            self._down = False
        return result
