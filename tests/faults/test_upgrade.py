"""Scenario 30: the online upgrade 0005 -> 0006 with relays of 0005 still running.

docs/operations/upgrading.md promises: run ``migrate`` while relays of 0005 run, then restart
them one by one; meanwhile claims of both versions share the table safely (they own the same
key buckets, and the final ``SELECT ... FOR UPDATE`` of either makes it wait for the other).

What an "old relay" is here. The relay code of 0005 is not at hand in a test (CI runs from a
clean checkout, and running another commit's code from git is fragile), so the old relays are
the part of a 0005 relay that the database sees, and that the upgrade has to get along with:
its statements, copied from ``sql/queries.sql`` as it was at migration 0005 (``claim``: the
two-argument claim function, which 0006 keeps; ``mark_published``), in its transaction (one
per batch: claim, send, wait for every ack, mark, commit), publishing with an idempotent
producer (acks=all) and the same partitioner (murmur2 of the key). Its wake-up is a short poll
rather than LISTEN and the gated notify of 0005: after 0006 producers no longer look at the
old relays' awake marker, so they notify anyway, and an old relay's wake-up decides when it
claims, never what. The new relays are real relay processes of this tree.

The upgrade runs as an operator would: ``notify-outbox migrate`` while two old relays and the
writers go on; then a new relay starts beside them (the two versions claim side by side), the
first old relay stops, a second new relay starts, the second old relay stops. The checker
then requires: none lost, none rolled back published, each key in commit order, and no
duplicate at all (nothing crashed). A relay of this version started before ``migrate`` must
refuse the old schema.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
from collections import defaultdict

import anyio
import asyncpg
import pytest
from aiokafka import AIOKafkaProducer

from devstack.relayproc import child_env, cli_argv
from notify_outbox import OutboxNames, migrate
from tests.conftest import Services
from tests.faults.checker import OutboxChecker
from tests.faults.harness import (
    FaultRelay,
    KafkaTail,
    connect,
    eventually,
    relays,
    task_group,
)
from tests.support import ROOT

pytestmark = pytest.mark.anyio

# The statements of a relay of migration 0005 (sql/queries.sql at that migration).
OLD_CLAIM = "SELECT * FROM public.outbox_claim($1, $2)"
OLD_MARK = "UPDATE public.outbox SET published_at = now() WHERE id = ANY($1::bigint[])"


class OldRelay:
    """A relay of migration 0005 as the database sees it (see the module's docstring)."""

    def __init__(self, dsn: str, bootstrap: str, name: str, *, batch: int = 50) -> None:
        self.dsn = dsn
        self.bootstrap = bootstrap
        self.name = name
        self.batch = batch
        self.published = 0
        self.sent: set[str] = set()  # event ids this old relay published
        self.after_upgrade = 0
        self.upgraded = False
        self.stop = anyio.Event()
        self.stopped = anyio.Event()

    async def run(self) -> None:
        producer = AIOKafkaProducer(
            bootstrap_servers=self.bootstrap, acks="all", enable_idempotence=True
        )
        await producer.start()
        conn = await asyncpg.connect(self.dsn)
        try:
            while not self.stop.is_set():
                async with conn.transaction():
                    rows = await conn.fetch(OLD_CLAIM, self.batch, self.batch * 10)
                    if rows:
                        acks = [
                            await producer.send(
                                r["topic"],
                                r["payload_bytes"] or r["payload"].encode(),
                                key=r["key"].encode() if r["key"] is not None else None,
                                headers=[("outbox-event-id", str(r["event_id"]).encode())],
                            )
                            for r in rows
                        ]
                        await asyncio.gather(*acks)
                        await conn.execute(OLD_MARK, [r["id"] for r in rows])
                self.published += len(rows)
                self.sent.update(str(r["event_id"]) for r in rows)
                if self.upgraded:
                    self.after_upgrade += len(rows)
                if not rows:
                    with anyio.move_on_after(0.05):  # the old relay's poll, not a sync point
                        await self.stop.wait()
        finally:
            await conn.close()
            await producer.stop()
            self.stopped.set()

    async def halt(self) -> None:
        """A graceful stop: the batch in hand is finished (sent, acked, marked) first."""
        self.stop.set()
        with anyio.fail_after(30):
            await self.stopped.wait()


async def _at_least(get: object, target: int) -> bool:
    return bool(get() >= target)  # type: ignore[operator]


async def test_30_upgrade_while_relays_of_the_previous_migration_run(
    empty_db_dsn: str, services: Services, topic: str
) -> None:
    """See the module's docstring."""
    dsn, bootstrap = empty_db_dsn, services.bootstrap
    async with connect(dsn) as conn:
        assert await migrate(conn, OutboxNames(), up_to=5) == [1, 2, 3, 4, 5]
    checker = await OutboxChecker(dsn, bootstrap, [topic], "30 upgrade, old relays").setup()
    # A relay of this version refuses the schema of 0005 (its claim does not exist there).
    async with relays(FaultRelay(dsn, bootstrap, name="too-early")) as (early,):
        code = await early.exited(60)
    assert code != 0, early.output()
    assert "not up to date" in early.output(), early.output()

    old = [OldRelay(dsn, bootstrap, f"old-{i}") for i in range(2)]
    load = checker.writers(writers=3, keys=20, pause=0.01)
    debug = ("--log-level", "DEBUG")  # "claimed N rows" lines
    claimed = r"claimed \d+ rows"
    async with (
        contextlib.AsyncExitStack() as stack,
        KafkaTail(bootstrap, [topic]) as tail,
        task_group() as tg,
    ):

        async def start_new(name: str) -> FaultRelay:
            (relay,) = await stack.enter_async_context(
                relays(FaultRelay(dsn, bootstrap, *debug, name=name))
            )
            await relay.ready()
            return relay

        for o in old:
            tg.start_soon(o.run)
        tg.start_soon(load.run)
        for o in old:
            await eventually(
                lambda o=o: _at_least(lambda: o.published, 50),  # type: ignore[misc]
                within=60,
                what=f"{o.name} publishes before the upgrade",
            )
        # The operator's upgrade, under writers and old relays.
        result = await anyio.run_process(
            cli_argv("migrate"),
            cwd=ROOT,
            env=child_env(NOTIFY_OUTBOX_DSN=dsn),
            check=False,
            stderr=subprocess.STDOUT,
        )
        out = result.stdout.decode(errors="replace")
        assert result.returncode == 0, out
        assert "applied migrations [6, 7, 8, 9]" in out, out
        for o in old:
            o.upgraded = True
        # The old claim keeps working on the new schema.
        for o in old:
            await eventually(
                lambda o=o: _at_least(lambda: o.after_upgrade, 50),  # type: ignore[misc]
                within=60,
                what=f"{o.name} publishes after the upgrade",
            )
        # Restart one by one: a new relay starts beside the old ones; both versions claim.
        new_a = await start_new("new-a")
        marks = [o.after_upgrade for o in old]
        await new_a.line(claimed, count=5)
        for o, mark in zip(old, marks, strict=True):
            await eventually(
                lambda o=o, mark=mark: _at_least(lambda: o.after_upgrade, mark + 30),  # type: ignore[misc]
                within=60,
                what=f"{o.name} publishes beside the new relay",
            )
        await old[0].halt()
        new_b = await start_new("new-b")
        await new_b.line(claimed, count=3)
        await old[1].halt()
        seen = len(tail.first_seen)
        await eventually(
            lambda: _at_least(lambda: len(tail.first_seen), seen + 200),
            within=60,
            what="the new relays alone publish",
        )
        await load.halt()
        report = await checker.drain_and_check(within=90)
        await new_a.stop_ok()
        await new_b.stop_ok()
    print(report.text())
    # Evidence that the two versions really shared keys: per key, records of old relays
    # after records of new ones (in partition order) while both ran.
    by_old = old[0].sent | old[1].sent
    sources: dict[str, list[str]] = defaultdict(list)
    for r in sorted(report.records, key=lambda r: (r.partition, r.offset)):
        if r.key is not None:
            sources[r.key].append("old" if r.event_id in by_old else "new")
    mixed = [k for k, s in sources.items() if "new" in s and "old" in s[s.index("new") :]]
    print(
        f"old relays published {[o.published for o in old]} "
        f"({[o.after_upgrade for o in old]} after the upgrade); keys whose rows went from a "
        f"new relay back to an old one: {len(mixed)} of {len(sources)}"
    )
    assert mixed, "old and new relays never alternated on a key: the mixed period tested nothing"
    report.assert_ok()
    assert report.duplicates == 0
