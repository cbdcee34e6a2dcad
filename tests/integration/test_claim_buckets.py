"""The bucket claim (migration 0005) against a real PostgreSQL: concurrent claims each get a
full batch of a keyed backlog, never share a key, and each takes a gapless prefix of every key
it touches; a key's rows wait while another claim holds its bucket; a quiet claim (migration
0009's path) holds only the buckets its batch needs and counts those others hold."""

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


async def _keys_in_distinct_buckets(conn: asyncpg.Connection, n: int) -> list[tuple[str, int]]:
    """``n`` keys and their buckets (hashtext(key) & 255, as the claim computes them), each
    bucket different."""
    rows = await conn.fetch(
        "SELECT k, hashtext(k) & 255 AS b FROM (SELECT 'q' || g AS k FROM generate_series(1, 50) g)"
        " AS x"
    )
    out: dict[int, str] = {}
    for r in rows:
        out.setdefault(r["b"], r["k"])
    assert len(out) >= n
    return [(k, b) for b, k in list(out.items())[:n]]


async def _claim_buckets(conn: asyncpg.Connection) -> list[int]:
    """The claim's key buckets ``conn``'s transaction holds."""
    # A lock on two int4 keys: classid the first (the namespace, as an unsigned oid), objid
    # the second, objsubid 2.
    rows = await conn.fetch(
        "SELECT objid::text::int AS b FROM pg_locks WHERE locktype = 'advisory' "
        "AND pid = pg_backend_pid() AND objsubid = 2 AND classid = $1::int::oid ORDER BY 1",
        OutboxNames().claim_namespace,
    )
    return [r["b"] for r in rows]


async def test_a_quiet_claim_locks_only_the_buckets_its_batch_needs(db_dsn: str) -> None:
    # Migration 0009's quiet path (no row waits, the whole queue in view): the head's buckets
    # are tried oldest first until they hold a batch, then read in one statement. A bucket
    # another claim holds is counted busy and its rows left; buckets past the batch stay free.
    conns = [await asyncpg.connect(db_dsn) for _ in range(4)]
    a, b, other, setup = conns
    try:
        (ka, ba), (kb, bb), (kc, bc) = await _keys_in_distinct_buckets(setup, 3)
        await setup.execute(
            "INSERT INTO outbox (topic, key) VALUES ('t', $1), ('t', $1), ('t', $2), ('t', $3)",
            ka,
            kb,
            kc,
        )
        ids = [r["id"] for r in await setup.fetch("SELECT id FROM outbox ORDER BY id")]
        async with other.transaction():
            # Another claim holds kc's bucket.
            await other.execute(
                "SELECT pg_advisory_xact_lock($1::int, $2::int)",
                OutboxNames().claim_namespace,
                bc,
            )
            async with a.transaction():
                rows = await a.fetch(
                    Queries(OutboxNames())["claim"], 2, claim_scan(2), *LowWaterMark().args()
                )
                assert [r["id"] for r in rows[:-1]] == ids[:2]  # ka's two rows fill the batch
                assert rows[-1]["busy"] == 0
                assert rows[-1]["changed"] is False
                assert await _claim_buckets(a) == [ba]  # kb's and kc's buckets left free
                async with b.transaction():
                    rows = await b.fetch(
                        Queries(OutboxNames())["claim"], 10, claim_scan(10), *LowWaterMark().args()
                    )
                    assert [r["id"] for r in rows[:-1]] == ids[2:3]  # kb's row; not kc's
                    assert rows[-1]["busy"] == 2  # ka's bucket (a) and kc's (other)
                    assert await _claim_buckets(b) == [bb]
        async with b.transaction():
            assert [r["id"] for r in await _claim(b)] == ids  # every lock gone with its claim
    finally:
        for c in conns:
            await c.close()
