"""The claim's low-water mark (migration 0006) against a real PostgreSQL: claims that start at
the mark never skip a row, however late its transaction commits, and their work does not grow
with the dead tuples a held snapshot keeps.

The claimers here are the relay's claim as SQL (the same query and mark keeper as
``PgOutboxStore``), so every interleaving the mark's proof covers can be driven from a test:
transactions held open across many claims, commits in the opposite order of their ids,
rollbacks, savepoints, every isolation level, and two-phase commit."""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta

import anyio
import asyncpg
import pytest

from notify_outbox import OutboxNames, migrate
from notify_outbox.core.outbox import BatchOutcome
from notify_outbox.pg.sqlfiles import Queries
from notify_outbox.pg.store import LowWaterMark, MarkKeeper, PgOutboxStore, claim_scan

pytestmark = pytest.mark.anyio

Q = Queries(OutboxNames())
INSERT = "INSERT INTO outbox (topic, key, payload) VALUES ('t', $1, '{}') RETURNING id"


async def claim_once(
    conn: asyncpg.Connection,
    marks: MarkKeeper,
    batch: int,
    *,
    commit: bool = True,
    claimed: Callable[[list[asyncpg.Record]], None] | None = None,
) -> list[asyncpg.Record]:
    """One claim as the relay makes it: the rows are deleted (published) if ``commit``, else
    the claim rolls back and they stay pending. ``claimed`` is told the rows of a claim that
    commits before its COMMIT, as the relay sends them before its own: told after it, two
    claimers' rows could be told in another order than they were claimed in (one claimer's
    COMMIT answered late while the next owner of the bucket claimed and committed; seen once,
    on a loaded host)."""
    await conn.execute("BEGIN ISOLATION LEVEL READ COMMITTED")
    try:
        mark, token = marks.take()
        records = await conn.fetch(Q["claim"], batch, claim_scan(batch), *mark.args())
        last = records[-1]
        marks.offer(LowWaterMark(last[12], tuple(last[13]), tuple(last[14])), token)
        rows = list(records[:-1])
        if rows and commit:
            await conn.execute("DELETE FROM outbox WHERE id = ANY($1)", [r["id"] for r in rows])
            if claimed is not None:
                claimed(rows)
        await conn.execute("COMMIT" if commit else "ROLLBACK")
    except BaseException:
        await conn.execute("ROLLBACK")
        raise
    return rows


def assert_claimed_once_in_order(
    claimed: Sequence[tuple[int, str | None]], committed: Mapping[int, str | None]
) -> None:
    """Every committed row claimed once, and each key's rows in id order (which the
    producers' key locks make commit order)."""
    ids = [i for i, _ in claimed]
    assert len(ids) == len(set(ids)), "a row was claimed twice"
    assert set(ids) == set(committed), "claimed rows differ from the committed ones"
    by_key: dict[str | None, list[int]] = defaultdict(list)
    for row_id, key in claimed:
        by_key[key].append(row_id)
    for key, key_ids in by_key.items():
        if key is not None:
            assert key_ids == sorted(key_ids), f"key {key} claimed out of commit order"


async def test_claims_from_the_mark_never_skip_a_late_commit(db_dsn: str) -> None:
    """Producers commit in every order and at every pace while two claimers share one mark;
    a row left below the floor would never be claimed again, and the drain at the end would
    stall. Per key, rows must be claimed in id order (the producers' key locks make id order
    the commit order)."""
    rng = random.Random(17)
    committed: dict[int, str | None] = {}
    claimed: list[tuple[int, str | None]] = []
    marks = MarkKeeper()
    stop_producing = anyio.Event()

    async def produce(conn: asyncpg.Connection, n: int) -> None:
        while not stop_producing.is_set():
            isolation = rng.choice(["READ COMMITTED", "REPEATABLE READ", "SERIALIZABLE"])
            ids: dict[int, str | None] = {}
            await conn.execute(f"BEGIN ISOLATION LEVEL {isolation}")
            # Several keys in one transaction go in one global order (the docs), or producers
            # deadlock on the per-key ordering locks.
            keys = sorted(
                (
                    rng.choice([None, *(f"k{i}" for i in range(8))])
                    for _ in range(rng.randint(1, 3))
                ),
                key=lambda k: k or "",
            )
            for key in keys:
                if rng.random() < 0.2:
                    # A row of a savepoint rolled back: it must never be claimed.
                    await conn.execute("SAVEPOINT s")
                    await conn.fetchval(INSERT, key)
                    await conn.execute("ROLLBACK TO SAVEPOINT s")
                ids[await conn.fetchval(INSERT, key)] = key
                # Hold the transaction open across claims, sometimes for long.
                await anyio.sleep(rng.choice([0, 0, 0.001, 0.005, 0.02, 0.2]))
            if rng.random() < 0.1:
                await conn.execute("ROLLBACK")
            elif n == 0 and rng.random() < 0.3:
                # Two-phase commit: invisible while prepared, claims run meanwhile.
                gid = f"claim-mark-{rng.getrandbits(32)}"
                await conn.execute(f"PREPARE TRANSACTION '{gid}'")
                await anyio.sleep(0.05)
                await conn.execute(f"COMMIT PREPARED '{gid}'")
                committed.update(ids)
            else:
                await conn.execute("COMMIT")
                committed.update(ids)

    def note(rows: list[asyncpg.Record]) -> None:
        claimed.extend((r["id"], r["key"]) for r in rows)

    async def claim_while_producing(conn: asyncpg.Connection) -> None:
        while not stop_producing.is_set():
            # A claim that rolls back leaves its rows pending, as a relay's failed batch does.
            commit = rng.random() > 0.1
            await claim_once(conn, marks, 20, commit=commit, claimed=note)
            await anyio.sleep(rng.choice([0, 0.001, 0.003]))

    conns = [await asyncpg.connect(db_dsn) for _ in range(7)]
    try:
        producers, claimers = conns[:5], conns[5:]
        # PostgreSQL cannot PREPARE a transaction that sent a NOTIFY: no wake-ups here.
        await claimers[0].execute(Q["set_notify_mode"], "off")
        async with anyio.create_task_group() as tg:
            for n, conn in enumerate(producers):
                tg.start_soon(produce, conn, n)
            for conn in claimers:
                tg.start_soon(claim_while_producing, conn)
            await anyio.sleep(6)
            stop_producing.set()

        # Everything committed must now come out of claims that start at the mark.
        with anyio.fail_after(30):
            while len(claimed) < len(committed):
                rows = await claim_once(claimers[0], marks, 50, claimed=note)
                if not rows:
                    left = await claimers[1].fetch("SELECT id, key, xmin FROM outbox")
                    assert not left, f"rows below the mark {marks.mark}: {left}"
    finally:
        for conn in conns:
            await conn.close()

    assert_claimed_once_in_order(claimed, committed)
    assert len(committed) > 200  # the run did produce a real mix


async def _index_entries_read(conn: asyncpg.Connection) -> int:
    """Index entries the outbox's indexes have returned so far, dead ones included (a dead
    tuple's entry is read, then its heap tuple found invisible): the work a scan does."""
    await conn.execute("SET stats_fetch_consistency = none")
    return int(
        await conn.fetchval(
            "SELECT sum(idx_tup_read) FROM pg_stat_user_indexes WHERE relname = 'outbox'"
        )
    )


async def test_claims_do_not_walk_the_dead_tuples_of_a_held_snapshot(db_dsn: str) -> None:
    """While another session holds a snapshot, every published row stays a dead tuple whose
    index entries cannot be removed. A claim from the mark reads as many index entries after
    20,000 of them as after none; a claim from the start of the table (what 0005 did) reads
    them all."""
    holder = await asyncpg.connect(db_dsn)
    conn = await asyncpg.connect(db_dsn)
    try:
        marks = MarkKeeper()
        held = holder.transaction(isolation="repeatable_read")
        await held.start()
        await holder.fetchval("SELECT count(*) FROM outbox")

        async def publish(n: int) -> None:
            await conn.execute(
                "INSERT INTO outbox (topic, key, payload) "
                "SELECT 't', 'k' || (g % 40), '{}' FROM generate_series(1, $1) g",
                n,
            )
            while await claim_once(conn, marks, 200):
                pass

        async def claim_cost(mark: LowWaterMark) -> int:
            """Index entries one claim of 200 fresh rows reads, starting at ``mark``."""
            await conn.execute(
                "INSERT INTO outbox (topic, key, payload) "
                "SELECT 't', 'k' || (g % 40), '{}' FROM generate_series(1, 200) g"
            )
            # A session's counters reach the shared statistics when it goes idle, at most
            # once a second unless forced: first everything before the claim, then the
            # claim's own.
            await conn.execute("SELECT pg_stat_force_next_flush()")
            read = await _index_entries_read(holder)
            async with conn.transaction():
                rows = await conn.fetch(Q["claim"], 200, claim_scan(200), *mark.args())
                assert len(rows) == 201
                await conn.execute("SELECT pg_stat_force_next_flush()")
            return await _index_entries_read(holder) - read

        await publish(400)
        before = await claim_cost(marks.mark)
        await publish(20_000)
        after = await claim_cost(marks.mark)
        from_start = await claim_cost(LowWaterMark())
        await held.rollback()
    finally:
        await holder.close()
        await conn.close()
    print(
        f"index entries read by a claim: {before} before, {after} after 20,000 dead tuples; "
        f"{from_start} from the start of the table"
    )
    # The scenario is real: read from the start, the claim meets the 20,000 dead tuples.
    assert from_start > 20_000
    # From the mark it does not: the same work as before them, within a claim's worth.
    assert after < before + 400, (before, after, from_start)


async def test_an_upgrade_while_old_claims_run_loses_and_reorders_nothing(
    empty_db_dsn: str,
) -> None:
    """The online upgrade path: producers and claims of migration 0005 (old relays) run while
    0006 is applied; then new claims run beside the old ones, as while relays restart one by
    one, and finally alone. Every committed row is claimed once, each key's in id order."""
    names = OutboxNames()
    rng = random.Random(6)
    committed: dict[int, str | None] = {}
    claimed: list[tuple[int, str | None]] = []
    marks = MarkKeeper()
    stop_producing, stop_old = anyio.Event(), anyio.Event()
    migrated = anyio.Event()
    # Rows claimed so far by each kind of claim, and an event per change: each phase lasts
    # until its claims have made progress, not for a fixed time (a slow host would otherwise
    # end a phase before its claims ran side by side).
    rows_by = {"old": 0, "new": 0}
    progress = anyio.Event()

    def claimed_by(kind: str, rows: list[asyncpg.Record]) -> None:
        nonlocal progress
        claimed.extend((r["id"], r["key"]) for r in rows)
        if rows:
            rows_by[kind] += len(rows)
            progress.set()
            progress = anyio.Event()

    async def until(kind: str, rows: int) -> None:
        with anyio.fail_after(60):
            while rows_by[kind] < rows:
                await progress.wait()

    async def produce(conn: asyncpg.Connection) -> None:
        while not stop_producing.is_set():
            keys = sorted(f"k{rng.randrange(12)}" for _ in range(rng.randint(1, 2)))
            async with conn.transaction():
                ids = {await conn.fetchval(INSERT, key): key for key in keys}
                await anyio.sleep(rng.choice([0, 0.002, 0.02]))
            committed.update(ids)

    async def old_claims(conn: asyncpg.Connection) -> None:
        while not stop_old.is_set():
            async with conn.transaction():
                rows = await conn.fetch(
                    f"SELECT id, key FROM {names.schema}.{names.table}_claim($1, $2)", 20, 200
                )
                if rows:
                    await conn.execute(
                        "DELETE FROM outbox WHERE id = ANY($1)", [r["id"] for r in rows]
                    )
                claimed_by("old", rows)  # before the COMMIT (see claim_once)
            await anyio.sleep(0.002)

    async def new_claims(conn: asyncpg.Connection) -> None:
        await migrated.wait()
        while not stop_producing.is_set():
            await claim_once(conn, marks, 20, claimed=lambda rows: claimed_by("new", rows))
            await anyio.sleep(0.002)

    setup = await asyncpg.connect(empty_db_dsn)
    conns = [await asyncpg.connect(empty_db_dsn) for _ in range(6)]
    try:
        assert await migrate(setup, names, up_to=5) == [1, 2, 3, 4, 5]
        async with anyio.create_task_group() as tg:
            for conn in conns[:2]:
                tg.start_soon(produce, conn)
            for conn in conns[2:4]:
                tg.start_soon(old_claims, conn)
            for conn in conns[4:]:
                tg.start_soon(new_claims, conn)
            await until("old", 200)
            assert await migrate(setup, names) == [6, 7, 8, 9]  # while all of them run
            migrated.set()
            # Old and new claims side by side, then the new ones alone.
            old_then = rows_by["old"]
            await until("new", 200)
            await until("old", old_then + 200)
            stop_old.set()
            await until("new", rows_by["new"] + 200)
            stop_producing.set()
        with anyio.fail_after(30):
            while len(claimed) < len(committed):
                rows = await claim_once(
                    conns[4],
                    marks,
                    50,
                    claimed=lambda rows: claimed.extend((r["id"], r["key"]) for r in rows),
                )
                if not rows:
                    assert not await setup.fetch("SELECT id FROM outbox"), marks.mark
    finally:
        for conn in (setup, *conns):
            await conn.close()
    assert_claimed_once_in_order(claimed, committed)
    assert len(committed) > 100


async def test_a_new_server_start_drops_the_mark_so_rows_left_below_it_are_claimed(
    db_dsn: str,
) -> None:
    """After a failover to an asynchronous standby, a row whose claim's mark the standby never
    received is pending again, below the relay's low-water mark: claims from that mark never
    read it, nor does the fallback poll's look. The store learns at its start when the server
    started (``server_started``); a poll that finds another start time drops the mark, and
    the row is claimed. Here the store believes it started on a server that started an hour
    earlier (the old primary)."""
    pool = await asyncpg.create_pool(db_dsn, min_size=1, max_size=2)
    assert pool is not None
    try:
        started = await pool.fetchval("SELECT pg_postmaster_start_time()")
        store = PgOutboxStore(
            pool,
            Q,
            delete_on_publish=False,
            command_timeout=10,
            server_started=started - timedelta(hours=1),
        )

        async def claim_and_publish() -> list[int]:
            async with store.claim(100) as batch:
                ids = [r.id for r in batch.rows]
                await batch.complete(BatchOutcome(published=ids))
            return ids

        first = [await pool.fetchval(INSERT, f"k{n}") for n in range(5)]
        assert sorted(await claim_and_publish()) == first
        later = await pool.fetchval(INSERT, "k9")
        assert await claim_and_publish() == [later]
        assert store.marks.mark.low > first[0]
        # The lost mark: the first row is pending again, below the mark.
        await pool.execute("UPDATE outbox SET published_at = NULL WHERE id = $1", first[0])
        assert await store.has_due() is False, "the look from the mark should not see it"
        assert await claim_and_publish() == [], "a claim from the mark should not see it"
        due, _ = await store.poll()  # another server's start time: the mark is dropped
        assert due is True
        assert store.marks.mark == LowWaterMark()
        assert await claim_and_publish() == [first[0]]
        # The same server at the next poll: the mark stays.
        await claim_and_publish()
        kept = store.marks.mark
        assert kept != LowWaterMark()
        due, _ = await store.poll()
        assert due is False
        assert store.marks.mark == kept
    finally:
        await pool.close()
