"""The bucket claim (migration 0005) against a real PostgreSQL: concurrent claims each get a
full batch of a keyed backlog, never share a key, and each takes a gapless prefix of every key
it touches; a key's rows wait while another claim holds its bucket."""

from __future__ import annotations

from contextlib import AsyncExitStack
from typing import Any

import asyncpg
import pytest

from notify_outbox import OutboxNames
from notify_outbox.pg.sqlfiles import Queries
from notify_outbox.pg.store import LowWaterMark, claim_scan

pytestmark = pytest.mark.anyio

BATCH = 50


async def _claim(conn: asyncpg.Connection, batch: int = BATCH) -> list[Any]:
    """The claimed rows, without the last row (the next low-water mark)."""
    rows = await conn.fetch(
        Queries(OutboxNames())["claim"], batch, claim_scan(batch), *LowWaterMark().args()
    )
    assert rows[-1]["id"] is None
    return list(rows[:-1])


async def test_sixteen_open_claims_split_a_keyed_backlog_without_sharing_a_key(
    db_dsn: str,
) -> None:
    # 1,000 keys, 10 rows each, interleaved. Under migration 0003's per-key walk the 11th open
    # claim found only keys that earlier claims held within its scan bound, and got nothing.
    setup = await asyncpg.connect(db_dsn)
    async with AsyncExitStack() as stack:
        stack.push_async_callback(setup.close)
        await setup.execute(
            "INSERT INTO outbox (topic, key) "
            "SELECT 't', 'k' || (g % 1000) FROM generate_series(0, 9999) g"
        )
        by_key: dict[str, list[int]] = {}
        for r in await setup.fetch("SELECT id, key FROM outbox ORDER BY id"):
            by_key.setdefault(r["key"], []).append(r["id"])

        owner: dict[str, int] = {}
        for n in range(16):
            conn = await asyncpg.connect(db_dsn)
            stack.push_async_callback(conn.close)
            tx = conn.transaction()
            await tx.start()  # held open: the claim's locks stay taken
            stack.push_async_callback(tx.rollback)
            rows = await _claim(conn)
            assert len(rows) == BATCH, f"claim {n} got {len(rows)} rows while others held theirs"
            mine: dict[str, list[int]] = {}
            for r in rows:
                mine.setdefault(r["key"], []).append(r["id"])
            for key, ids in mine.items():
                assert owner.setdefault(key, n) == n, f"key {key} claimed by {owner[key]} and {n}"
                # A gapless prefix of the key's rows, in id order.
                assert ids == by_key[key][: len(ids)]


async def test_a_key_waits_while_another_claim_holds_its_bucket(db_dsn: str) -> None:
    a = await asyncpg.connect(db_dsn)
    b = await asyncpg.connect(db_dsn)
    try:
        await a.execute("INSERT INTO outbox (topic, key) VALUES ('t', 'x'), ('t', 'x')")
        ids = [r["id"] for r in await a.fetch("SELECT id FROM outbox ORDER BY id")]
        async with a.transaction():
            first = await _claim(a, 1)  # holds x's bucket with x's first row only
            assert [r["id"] for r in first] == ids[:1]
            async with b.transaction():
                # x's second row must not go out while its first is in flight.
                assert [r["key"] for r in await _claim(b)] == []
            await a.execute("UPDATE outbox SET published_at = now() WHERE id = $1", first[0]["id"])
        async with b.transaction():
            second = await _claim(b)
        assert [r["id"] for r in second] == ids[1:]
    finally:
        await a.close()
        await b.close()
