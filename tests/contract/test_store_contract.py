"""One contract for every ``OutboxStore`` (River's driver conformance suite is the model): the
unit tests' ``FakeStore`` and ``PgOutboxStore`` on a real PostgreSQL pass the same cases, so the
fake that the relay's logic is tested on cannot drift from the store it runs on.

Every case runs once per store of ``stores.STORES``. What the cases hold a store to:

- a claim takes pending rows, at most ``limit``, in id order, each key's earliest rows with
  no gap; two claims at once never share a row nor a key (rows whose transaction has not
  committed exist only in PostgreSQL: ``tests/integration/test_claim_mark.py``);
- ``complete`` commits the outcome: published rows are never claimed again; a retried row
  stays pending with one more attempt, is not claimed before its delay and is claimed alone
  after it, and its key's later rows wait (parked) until it is published or dead-lettered; a
  dead-lettered row leaves the outbox and lets its key's later rows go;
- a claim left without ``complete``, or by an error, leaves its rows as they were;
- ``more_due``, ``has_due``, ``poll``, ``count_pending`` and ``delete_expired`` agree with the
  rows.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest

from notify_outbox.core.outbox import BatchOutcome, ClaimedBatch
from tests.contract.stores import STORES, Harness, RowState, open_harness

pytestmark = pytest.mark.anyio

PENDING = RowState("pending", 0, None)


@pytest.fixture(
    params=[
        pytest.param(kind, marks=pytest.mark.integration if kind.startswith("pg") else ())
        for kind in STORES
    ]
)
def store_kind(request: pytest.FixtureRequest) -> str:
    kind: str = request.param
    return kind


@pytest.fixture
def store_dsn(store_kind: str, request: pytest.FixtureRequest) -> str | None:
    """A migrated database for the PostgreSQL stores, one for the module (each case empties
    the outbox first); none for the fake, which then needs no services."""
    if not store_kind.startswith("pg"):
        return None
    dsn: str = request.getfixturevalue("module_db_dsn")
    return dsn


@pytest.fixture
async def h(store_kind: str, store_dsn: str | None) -> AsyncIterator[Harness]:
    async with open_harness(store_kind, store_dsn) as harness:
        yield harness


def ids(batch: ClaimedBatch) -> list[int]:
    return [r.id for r in batch.rows]


async def complete(h: Harness, batch: ClaimedBatch, limit: int, outcome: BatchOutcome) -> None:
    """``batch.complete(outcome)``, and what it then says about more, every time: a full claim
    whose rows were all settled says more without a look (the worker claims again anyway);
    otherwise it says exactly whether anything is due after the commit."""
    assert batch.more_due is None
    await batch.complete(outcome)
    settled = len(outcome.published) + len(outcome.retry) + len(outcome.dead)
    if len(batch.rows) >= limit and settled == len(batch.rows):
        assert batch.more_due is True
    else:
        assert batch.more_due is await h.store.has_due()


async def claimed(h: Harness, limit: int = 100) -> list[int]:
    """The rows a claim gets, left without ``complete`` (which changes nothing)."""
    async with h.store.claim(limit) as batch:
        return ids(batch)


async def publish(h: Harness, limit: int = 100) -> list[int]:
    """Claim, and publish every row the claim gets; their ids."""
    async with h.store.claim(limit) as batch:
        got = ids(batch)
        await complete(h, batch, limit, BatchOutcome(published=got))
    return got


async def test_an_empty_outbox_gives_an_empty_claim_and_nothing_is_due(h: Harness) -> None:
    async with h.store.claim(10) as batch:
        assert list(batch.rows) == []
        assert (batch.busy, batch.parked) == (0, False)
    assert await h.store.has_due() is False
    assert await h.store.poll() == (False, None)
    assert await h.store.count_pending(100) == 0


async def test_a_claim_takes_each_keys_earliest_pending_rows_in_id_order_at_most_limit(
    h: Harness,
) -> None:
    keys = ["a", "b", "a", None, "b", "a", None, "c", "a"]
    rows = {await h.add(key): key for key in keys}
    oldest = min(rows)
    for limit in (1, 2, 3, 5):
        async with h.store.claim(limit) as batch:
            got = ids(batch)
            assert 1 <= len(got) <= limit, (limit, got)
            assert got == sorted(got)
            assert oldest in got  # a claim alone takes the oldest row
            for key in {r.key for r in batch.rows if r.key is not None}:
                of_key = [i for i, k in rows.items() if k == key]
                taken = [r.id for r in batch.rows if r.key == key]
                assert taken == of_key[: len(taken)], (key, limit, got)
            for r in batch.rows:
                assert (r.topic, r.key, r.payload, r.payload_bytes, r.headers, r.attempts) == (
                    "t",
                    rows[r.id],
                    "{}",
                    None,
                    None,
                    0,
                )
                assert isinstance(r.event_id, uuid.UUID)
    # None of those claims completed: every row is still there to claim, in order.
    assert await claimed(h) == list(rows)
    assert [await h.state(i) for i in rows] == [PENDING] * len(rows)


async def test_published_rows_are_never_claimed_again(h: Harness) -> None:
    a1, a2, b1, n1 = [await h.add(key) for key in ("a", "a", "b", None)]
    async with h.store.claim(100) as batch:
        assert ids(batch) == [a1, a2, b1, n1]
        # a2 is left as it was (as a row held back behind a failed one would be).
        await complete(h, batch, 100, BatchOutcome(published=[a1, b1, n1]))
    for row_id in (a1, b1, n1):
        assert await h.state(row_id) == RowState("published", 0, None)
    assert await h.state(a2) == PENDING
    assert await publish(h) == [a2]
    assert await claimed(h) == []
    assert await h.store.has_due() is False
    assert await h.store.count_pending(100) == 0


async def test_a_retry_waits_for_its_delay_and_holds_its_keys_later_rows_back(
    h: Harness,
) -> None:
    k1, k2, j1 = await h.add("k"), await h.add("k"), await h.add("j")
    async with h.store.claim(100) as batch:
        assert ids(batch) == [k1, k2, j1]
        # k1 failed; k2, after it, is left as it was; j1 went out.
        outcome = BatchOutcome(published=[j1], retry=[(k1, "broker said no", 60.0)])
        await complete(h, batch, 100, outcome)
    assert await h.state(k1) == RowState("pending", 1, "broker said no")
    assert await h.state(k2) == PENDING
    k3, j2, n1 = await h.add("k"), await h.add("j"), await h.add(None)

    # Other keys flow; k's rows wait behind k1, and the claim that meets them parks them.
    async with h.store.claim(100) as batch:
        assert ids(batch) == [j2, n1]
        assert batch.parked
        await complete(h, batch, 100, BatchOutcome(published=[j2, n1]))
    async with h.store.claim(100) as batch:
        assert ids(batch) == []
        assert not batch.parked
    assert await h.store.has_due() is False
    due, wait = await h.store.poll()
    assert due is False
    assert wait is not None
    assert 50 < wait <= 60
    assert await h.store.count_pending(100) == 3

    await h.advance(50)  # 10 s early
    assert await claimed(h) == []
    assert await h.store.has_due() is False
    await h.advance(11)
    assert await h.store.poll() == (True, None)
    # A due retry is claimed alone (it may fail again): k's later rows wait for its outcome.
    async with h.store.claim(100) as batch:
        assert [(r.id, r.attempts) for r in batch.rows] == [(k1, 1)]
        await complete(h, batch, 100, BatchOutcome(retry=[(k1, "still no", 30.0)]))
    assert await h.state(k1) == RowState("pending", 2, "still no")
    assert await claimed(h) == []
    assert await h.store.has_due() is False
    await h.advance(31)
    async with h.store.claim(100) as batch:
        assert [(r.id, r.attempts) for r in batch.rows] == [(k1, 2)]
        await complete(h, batch, 100, BatchOutcome(published=[k1]))
    assert await h.state(k1) == RowState("published", 2, "still no")
    # Then the key's later rows, in order.
    assert await h.store.has_due() is True
    assert await publish(h) == [k2, k3]
    assert await claimed(h) == []


async def test_a_failed_row_without_a_key_holds_nothing_back(h: Harness) -> None:
    n1, n2 = await h.add(None), await h.add(None)
    async with h.store.claim(100) as batch:
        assert ids(batch) == [n1, n2]
        await complete(h, batch, 100, BatchOutcome(retry=[(n1, "no", 60.0)]))
    async with h.store.claim(100) as batch:
        assert ids(batch) == [n2]
        assert not batch.parked
        await complete(h, batch, 100, BatchOutcome(published=[n2]))
    await h.advance(61)
    assert await publish(h) == [n1]


async def test_a_dead_letter_leaves_the_outbox_and_lets_its_keys_later_rows_go(
    h: Harness,
) -> None:
    k1, k2, n1 = await h.add("k"), await h.add("k"), await h.add(None)
    async with h.store.claim(100) as batch:
        assert ids(batch) == [k1, k2, n1]
        outcome = BatchOutcome(published=[n1], dead=[(k1, "malformed headers")])
        await complete(h, batch, 100, outcome)
    # The dead letter counts the attempt that killed it.
    assert await h.state(k1) == RowState("dead", 1, "malformed headers")
    assert await h.store.count_pending(100) == 1
    assert await publish(h) == [k2]
    assert await claimed(h) == []


async def test_a_retry_dead_lettered_at_last_lets_its_parked_rows_go(h: Harness) -> None:
    k1, k2, k3 = [await h.add("k") for _ in range(3)]
    async with h.store.claim(100) as batch:
        assert ids(batch) == [k1, k2, k3]
        await complete(h, batch, 100, BatchOutcome(retry=[(k1, "no", 60.0)]))
    async with h.store.claim(100) as batch:
        assert ids(batch) == []
        assert batch.parked
    await h.advance(61)
    async with h.store.claim(100) as batch:
        assert ids(batch) == [k1]
        await complete(h, batch, 100, BatchOutcome(dead=[(k1, "no (after 2 attempts)")]))
    assert await h.state(k1) == RowState("dead", 2, "no (after 2 attempts)")
    assert await publish(h) == [k2, k3]


async def test_a_keys_parked_rows_follow_in_order_a_claim_at_a_time(h: Harness) -> None:
    k = [await h.add("k") for _ in range(5)]
    async with h.store.claim(100) as batch:
        assert ids(batch) == k
        await complete(h, batch, 100, BatchOutcome(retry=[(k[0], "no", 60.0)]))
    async with h.store.claim(100) as batch:
        assert ids(batch) == []
        assert batch.parked
    await h.advance(61)
    assert await publish(h) == k[:1]
    # Each claim takes the next rows of the key, as many as it may, and lets the rest follow
    # in the next one (no fallback poll in between).
    assert await publish(h, limit=2) == k[1:3]
    assert await publish(h, limit=2) == k[3:5]
    assert await claimed(h) == []


@pytest.mark.parametrize("leave", ["without_complete", "by_an_error"])
async def test_a_claim_not_completed_leaves_its_rows_as_they_were(h: Harness, leave: str) -> None:
    a1, a2, b1, k1, k2 = [await h.add(key) for key in ("a", "a", "b", "k", "k")]
    async with h.store.claim(100) as batch:
        # b1 failed and is due again at once; k1 failed for a minute (k2 left behind it).
        outcome = BatchOutcome(published=[a1], retry=[(b1, "no", 0.0), (k1, "not now", 60.0)])
        await complete(h, batch, 100, outcome)
    before = {i: await h.state(i) for i in (a1, a2, b1, k1, k2)}

    class Boom(Exception):
        pass

    async def claim_and_leave() -> None:
        async with h.store.claim(100) as batch:
            assert ids(batch) == [a2, b1]
            assert batch.parked  # k2, behind k1
            if leave == "by_an_error":
                raise Boom

    if leave == "by_an_error":
        with pytest.raises(Boom):
            await claim_and_leave()
    else:
        await claim_and_leave()
    assert {i: await h.state(i) for i in before} == before
    # The rows are claimed again as they were. The parking is a claim's own work: kept by a
    # claim that ends normally, undone by an error (and the next claim does it again).
    async with h.store.claim(100) as batch:
        assert [(r.id, r.attempts) for r in batch.rows] == [(a2, 0), (b1, 1)]
        assert batch.parked is (leave == "by_an_error")


async def test_complete_commits_an_error_after_it_undoes_nothing(h: Harness) -> None:
    a1 = await h.add("a")

    async def complete_then_fail() -> None:
        async with h.store.claim(100) as batch:
            await complete(h, batch, 100, BatchOutcome(published=[a1]))
            raise RuntimeError("after the outcome was written")

    with pytest.raises(RuntimeError):
        await complete_then_fail()
    assert await h.state(a1) == RowState("published", 0, None)
    assert await claimed(h) == []


async def test_more_due_says_whether_rows_are_due_after_the_commit(h: Harness) -> None:
    a1 = await h.add("a")
    async with h.store.claim(10) as batch:
        await complete(h, batch, 10, BatchOutcome(published=[a1]))
    assert batch.more_due is False

    b1 = await h.add("b")
    async with h.store.claim(10) as batch:
        c1 = await h.add("c")  # committed while the claim was open
        await complete(h, batch, 10, BatchOutcome(published=[b1]))
    assert batch.more_due is True
    assert await publish(h) == [c1]

    rows = [await h.add(key) for key in ("d", "e", "f")]
    async with h.store.claim(2) as batch:
        await complete(h, batch, 2, BatchOutcome(published=ids(batch)))
    assert batch.more_due is True
    assert await publish(h) == [i for i in rows if i not in ids(batch)]


async def test_claims_at_once_never_share_a_row_nor_a_key(h: Harness) -> None:
    keys = ["a", "a", "b", "b", "c", None, None]
    rows = {await h.add(key): key for key in keys}
    async with h.store.claim(3) as first:
        mine = ids(first)
        assert len(mine) == 3
        later_a = await h.add("a")  # a key the first claim holds gets a row
        rows[later_a] = "a"
        async with h.store.claim(100) as second:
            theirs = ids(second)
            assert theirs  # other keys were free
            assert not set(mine) & set(theirs)
            first_keys = {r.key for r in first.rows if r.key is not None}
            assert not first_keys & {r.key for r in second.rows if r.key is not None}
            assert later_a not in theirs
            # It met keys held by the other claim, and says so.
            assert second.busy >= 1
            # The look takes no locks: rows that claims hold still count.
            assert await h.store.has_due() is True
        await complete(h, first, 3, BatchOutcome(published=mine))
    # The second claim left without completing: everything not published is claimed next.
    rest = await publish(h)
    assert rest == sorted(set(rows) - set(mine))
    assert await claimed(h) == []


async def test_count_pending_and_poll_agree_with_the_rows(h: Harness) -> None:
    p1, d1, r1, r2, f1, n1 = [await h.add(key) for key in ("p", "d", "r", "r", "f", None)]
    async with h.store.claim(100) as batch:
        outcome = BatchOutcome(published=[p1], dead=[(d1, "bad")], retry=[(r1, "later", 30.0)])
        await complete(h, batch, 100, outcome)
    # Pending: r1 (waiting), r2 (behind it), f1 and n1; counted up to the limit, never past it.
    assert await h.state(r2) == PENDING
    assert await h.store.count_pending(100) == 4
    for limit in (1, 2, 3):
        assert await h.store.count_pending(limit) == limit
    due, wait = await h.store.poll()
    assert due is True
    assert wait is not None
    assert 20 < wait <= 30
    assert await publish(h) == [f1, n1]
    due, wait = await h.store.poll()
    assert due is False
    assert wait is not None
    assert 20 < wait <= 30
    assert await h.store.count_pending(100) == 2
    await h.advance(31)
    assert await h.store.poll() == (True, None)


async def test_expire_dead_letters_removes_only_dead_letters_older_than_the_limit(
    h: Harness,
) -> None:
    """The relay's dead-letter retention (``dead_letter_retention``) through the store: all
    the dead letters older than the limit go, in statements of ``limit`` rows; younger ones,
    and rows still in the outbox, stay."""
    old = [await h.add(key) for key in ("a", "b", "c")]
    async with h.store.claim(100) as batch:
        await complete(h, batch, 100, BatchOutcome(dead=[(i, "bad") for i in old]))
    await h.advance(100)
    young, pending = await h.add("y"), await h.add("p")
    async with h.store.claim(1) as batch:
        await complete(h, batch, 1, BatchOutcome(dead=[(young, "bad")]))
    assert await h.store.expire_dead_letters(150, 2) == 0  # none is that old
    assert await h.store.expire_dead_letters(50, 2) == 3  # every old one, two at a time
    assert [await h.state(i) for i in old] == [None, None, None]
    assert await h.state(young) == RowState("dead", 1, "bad")
    assert await h.state(pending) == PENDING


async def test_delete_expired_removes_only_published_rows_older_than_the_limit(
    h: Harness,
) -> None:
    old = [await h.add(key) for key in ("a", "b", None)]
    dead, waiting = await h.add("d"), await h.add("w")
    async with h.store.claim(100) as batch:
        outcome = BatchOutcome(
            published=old, dead=[(dead, "bad")], retry=[(waiting, "later", 1000.0)]
        )
        await complete(h, batch, 100, outcome)
    await h.advance(100)
    recent = await h.add("r")
    assert await publish(h) == [recent]
    fresh = await h.add("f")
    assert await h.store.delete_expired(150, 10) == 0  # none is that old
    assert await h.store.delete_expired(50, 2) == 2
    assert await h.store.delete_expired(50, 2) == 1
    assert await h.store.delete_expired(50, 2) == 0
    assert [await h.state(i) for i in old] == [None, None, None]
    assert await h.state(recent) == RowState("published", 0, None)
    assert await h.state(dead) == RowState("dead", 1, "bad")
    assert await h.state(waiting) == RowState("pending", 1, "later")
    assert await h.state(fresh) == PENDING
