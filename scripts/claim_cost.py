"""A quiet claim's round trip: the outbox's claim function against a bare claim (issue #31).

Every ``pace`` seconds one row is inserted (autocommit), then claimed in a transaction (the
BEGIN apart: the relay primes it), then deleted with the COMMIT; the claim's round trip is timed
at the client. Variants, alternating per round:

- ``ours``: ``outbox_claim``, the shipped function (with its low-water mark carried over);
- ``bare``: ``SELECT ... FOR UPDATE SKIP LOCKED`` of the pending rows in id order, no per-key
  order and no mark: the floor of any claim;
- ``outbox_claim_lockrow`` (created by ``--create-probe``; a probe, not a correct claim): one
  scan of the pending rows in id order from the mark, each row's key bucket try-locked in the
  scan's filter, ``FOR UPDATE``, the mark moved past the last row taken. What a quiet-path
  claim without the held-back check and without a true mark could cost;
- the name of any other probe function created on the database with the claim's signature
  (``outbox_claim_<x>(batch, scan, low, xids, lows)``), to time a part of the claim.

Usage: ``NOTIFY_OUTBOX_DSN=postgresql://.../scratch .venv/bin/python scripts/claim_cost.py
[--pace 0.01] [--claims 200] [--rounds 4] [--rows 1] [--variants ours,bare] [--create-probe]``
on a migrated scratch database: it deletes every row of ``public.outbox``. ``--rows N``
commits N rows (of N keys) before each claim. Prints each variant's median round trip (ms) per
round and over the rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

import asyncpg
import uvloop

from notify_outbox.core.names import OutboxNames

BARE = """
SELECT id, event_id, topic, key, payload::text, payload_bytes, headers::text, event_type,
       aggregate_type, aggregate_id, attempts, created_at
FROM public.outbox
WHERE published_at IS NULL AND next_attempt_at IS NULL
ORDER BY id LIMIT $1
FOR UPDATE SKIP LOCKED
"""
# The claim's namespace of advisory locks for public.outbox (OutboxNames().claim_namespace).
PROBE = """
CREATE OR REPLACE FUNCTION public.outbox_claim_lockrow(
    batch integer, scan integer, low bigint, wait_xids bigint[], wait_lows bigint[])
RETURNS TABLE (id bigint, event_id uuid, topic text, key text, payload text, payload_bytes bytea,
               headers text, event_type text, aggregate_type text, aggregate_id text,
               attempts integer, created_at timestamptz, next_low bigint, next_xids bigint[],
               next_lows bigint[], changed boolean, busy integer)
LANGUAGE plpgsql SET jit = off SET enable_seqscan = off SET plan_cache_mode = force_generic_plan
AS $fn$
#variable_conflict use_column
DECLARE
    top bigint := low;
BEGIN
    FOR id, event_id, topic, key, payload, payload_bytes, headers, event_type, aggregate_type,
        aggregate_id, attempts, created_at IN
        SELECT o.id, o.event_id, o.topic, o.key, o.payload::text, o.payload_bytes,
               o.headers::text, o.event_type, o.aggregate_type, o.aggregate_id, o.attempts,
               o.created_at
        FROM public.outbox AS o
        WHERE o.published_at IS NULL AND o.next_attempt_at IS NULL
          AND o.id >= least(low, (SELECT min(x) FROM unnest(wait_lows) AS x))
          AND pg_try_advisory_xact_lock(
                {namespace}, CASE WHEN o.key IS NULL THEN (o.id & 255)::integer
                                  ELSE hashtext(o.key) & 255 END)
        ORDER BY o.id LIMIT batch
        FOR UPDATE OF o
    LOOP
        top := greatest(top, id + 1);
        RETURN NEXT;
    END LOOP;
    RETURN QUERY SELECT NULL::bigint, NULL::uuid, NULL::text, NULL::text, NULL::text,
        NULL::bytea, NULL::text, NULL::text, NULL::text, NULL::text, NULL::integer,
        NULL::timestamptz, top, wait_xids, wait_lows, false, 0;
END
$fn$
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
    parser.add_argument("--rows", type=int, default=1, help="rows committed before each claim")
    parser.add_argument("--variants", default="ours,bare")
    parser.add_argument("--create-probe", action="store_true", help="(re)create the lockrow probe")
    args = parser.parse_args()
    variants = args.variants.split(",")
    writer = await asyncpg.connect(os.environ["NOTIFY_OUTBOX_DSN"])
    relay = await asyncpg.connect(os.environ["NOTIFY_OUTBOX_DSN"])
    try:
        if args.create_probe:
            await relay.execute(PROBE.format(namespace=OutboxNames().claim_namespace))
        await relay.execute("DELETE FROM public.outbox")
        marks: dict[str, Mark] = {}
        medians: dict[str, list[float]] = {v: [] for v in variants}
        for round_no in range(args.rounds):
            for variant in variants if round_no % 2 == 0 else variants[::-1]:
                trips = []
                for i in range(args.claims):
                    for j in range(args.rows):
                        await writer.execute(INSERT, f"k{(i * args.rows + j) % 100}")
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
