"""A quiet claim's round trip: the outbox's claim function against a bare claim (issue #31).

Every ``pace`` seconds one row is inserted (autocommit), then claimed in a transaction (the
BEGIN apart: the relay primes it), then deleted with the COMMIT; the claim's round trip is timed
at the client. Variants, alternating per round:

- ``ours``: ``outbox_claim``, the shipped function (with its low-water mark carried over);
- ``bare``: ``SELECT ... FOR UPDATE SKIP LOCKED`` of the pending rows in id order, no per-key
  order and no mark: the floor of any claim;
- the name of a probe function created on the database with the claim's signature
  (``outbox_claim_<x>(batch, scan, low, xids, lows)``), to time a part of the claim.

Usage: ``NOTIFY_OUTBOX_DSN=postgresql://.../scratch .venv/bin/python scripts/claim_cost.py
[--pace 0.01] [--claims 200] [--rounds 4] [--variants ours,bare]`` on a migrated scratch
database: it deletes every row of ``public.outbox``. Prints each variant's median round trip
(ms) per round and over the rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

import asyncpg
import uvloop

BARE = """
SELECT id, event_id, topic, key, payload::text, payload_bytes, headers::text, event_type,
       aggregate_type, aggregate_id, attempts, created_at
FROM public.outbox
WHERE published_at IS NULL AND next_attempt_at IS NULL
ORDER BY id LIMIT $1
FOR UPDATE SKIP LOCKED
"""
INSERT = "INSERT INTO public.outbox (topic, key, payload) VALUES ('claim-cost', $1, '{}')"

Mark = tuple[int, list[int], list[int]]


async def _claim(conn: asyncpg.Connection, variant: str, marks: dict[str, Mark]) -> list[int]:
    if variant == "bare":
        return [r["id"] for r in await conn.fetch(BARE, 100)]
    function = "outbox_claim" if variant == "ours" else variant
    low, xids, lows = marks.get(variant, (0, [], []))
    records = await conn.fetch(
        f"SELECT * FROM public.{function}($1, $2, $3, $4, $5)", 100, 1000, low, xids, lows
    )
    last = records[-1]  # the claim's last row carries the next mark
    marks[variant] = (last["next_low"], list(last["next_xids"]), list(last["next_lows"]))
    return [r["id"] for r in records[:-1]]


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pace", type=float, default=0.01)
    parser.add_argument("--claims", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--variants", default="ours,bare")
    args = parser.parse_args()
    variants = args.variants.split(",")
    writer = await asyncpg.connect(os.environ["NOTIFY_OUTBOX_DSN"])
    relay = await asyncpg.connect(os.environ["NOTIFY_OUTBOX_DSN"])
    try:
        await relay.execute("DELETE FROM public.outbox")
        marks: dict[str, Mark] = {}
        medians: dict[str, list[float]] = {v: [] for v in variants}
        for round_no in range(args.rounds):
            for variant in variants if round_no % 2 == 0 else variants[::-1]:
                trips = []
                for i in range(args.claims):
                    await writer.execute(INSERT, f"k{i % 100}")
                    await relay.execute("BEGIN")
                    began = time.perf_counter()
                    ids = await _claim(relay, variant, marks)
                    trips.append(time.perf_counter() - began)
                    literal = "{" + ",".join(map(str, ids)) + "}"
                    await relay.execute(
                        f"DELETE FROM public.outbox WHERE id = ANY('{literal}'::bigint[]); COMMIT"
                    )
                    await asyncio.sleep(args.pace)
                medians[variant].append(1e3 * statistics.median(trips))
        for variant, values in medians.items():
            rounds = " / ".join(f"{v:.3f}" for v in values)
            print(f"{variant}: {rounds} ms; median {statistics.median(values):.3f} ms")
    finally:
        await writer.close()
        await relay.close()


if __name__ == "__main__":
    uvloop.run(main())
