-- notify-outbox migration 0005: the claim owns key buckets and reads each one as an index range.
--
-- Why: 0003's claim walked the never-tried rows one by one in id order and try-locked each key.
-- While a keyed backlog drained, a claim walked past every row that sibling claims held, and
-- with 1,000 keys and batches of 200 only five claims could find a free key at all: the others
-- walked up to their scan bound for nothing. More workers or relay processes made the drain
-- slower (issue 10: 4 relays drained 100,000 keys at 0.70x of one relay).
--
-- Now every row belongs to one of 256 buckets: its key's hash (rows without a key: their id),
-- so all rows of a key share a bucket. A claim takes a transaction-scoped advisory lock per
-- bucket with a *try*, and reads a bucket it owns as one range of an index on (bucket, id):
-- the bucket's earliest claimable rows, in id order, no per-row lock and nothing of other
-- claims to step over. Which buckets to try comes from the head of the queue (the buckets of
-- the oldest claimable rows), so the oldest events go first. A bucket is owned by one claim at
-- a time, which is what keeps each key's rows in commit order across workers and relays. As
-- with 0003, nothing is written to claim, the locks vanish with the transaction (commit,
-- rollback, a relay that died), and it works through a transaction-pooling PgBouncer.
--
-- Upgrading while old relays run is safe but pointless: a 0003 claim and a 0005 claim can both
-- pick a row of the same key, and the final SELECT ... FOR UPDATE (no SKIP LOCKED) makes the
-- later one wait for the earlier and leave out what it published. Stop them anyway.
--
-- The bucket expression below appears in the index and in the function; they must stay equal
-- for the index to be used.

CREATE INDEX @prefix@_bucket_idx ON @table@
    ((CASE WHEN key IS NULL THEN (id & 255)::integer ELSE hashtext(key) & 255 END), id)
    WHERE published_at IS NULL AND next_attempt_at IS NULL;

-- Claims up to `batch` rows for the calling transaction, looking at no more than `scan` rows at
-- the head of the queue to choose buckets. Per key, the rows returned are the key's earliest
-- pending rows with no gap. The final SELECT re-reads every row under a row lock, so a row
-- published by a claim that committed meanwhile is left out.
CREATE OR REPLACE FUNCTION @schema@.@prefix@_claim(batch integer, scan integer)
RETURNS TABLE (id bigint, event_id uuid, topic text, key text, payload text, payload_bytes bytea,
               headers text, event_type text, aggregate_type text, aggregate_id text,
               attempts integer, created_at timestamptz)
-- The head scan's estimated cost covers the whole table (it stops early, the planner cannot
-- know), which would make PostgreSQL JIT-compile it at every call.
LANGUAGE plpgsql SET jit = off AS $fn$
#variable_conflict use_column
DECLARE
    r record;
    b integer;
    taken bigint[] := '{}';
BEGIN
    -- Retries that are due, each the earliest waiting row of its key (so each key once). Few.
    -- A try on a bucket this transaction owns already succeeds (the lock is re-entrant).
    FOR r IN
        SELECT o.id,
               CASE WHEN o.key IS NULL THEN (o.id & 255)::integer ELSE hashtext(o.key) & 255 END AS b
        FROM @table@ AS o
        WHERE o.published_at IS NULL AND o.next_attempt_at <= now()
          AND NOT EXISTS (SELECT 1 FROM @table@ AS w
                          WHERE w.key = o.key AND w.published_at IS NULL
                            AND w.next_attempt_at IS NOT NULL AND w.id < o.id)
        ORDER BY o.id
    LOOP
        EXIT WHEN cardinality(taken) >= batch;
        IF pg_try_advisory_xact_lock(@claim_ns@, r.b) THEN
            taken := taken || r.id;
        END IF;
    END LOOP;
    -- Fresh rows: the buckets of the oldest claimable rows, in order of their oldest row; each
    -- bucket won is read as a range, skipping keys that wait behind a failed row.
    FOR b IN
        SELECT h.b FROM (
            SELECT CASE WHEN o.key IS NULL THEN (o.id & 255)::integer
                        ELSE hashtext(o.key) & 255 END AS b,
                   o.id
            FROM @table@ AS o
            WHERE o.published_at IS NULL AND o.next_attempt_at IS NULL
            ORDER BY o.id
            LIMIT scan
        ) AS h
        GROUP BY h.b
        ORDER BY min(h.id)
    LOOP
        EXIT WHEN cardinality(taken) >= batch;
        CONTINUE WHEN NOT pg_try_advisory_xact_lock(@claim_ns@, b);
        -- A new statement, so a new snapshot taken after the lock: rows the bucket's previous
        -- owner published before it committed are seen as published.
        taken := taken || ARRAY(
            SELECT o.id FROM @table@ AS o
            WHERE (CASE WHEN o.key IS NULL THEN (o.id & 255)::integer
                        ELSE hashtext(o.key) & 255 END) = b
              AND o.published_at IS NULL AND o.next_attempt_at IS NULL
              AND (o.key IS NULL OR NOT EXISTS (
                    SELECT 1 FROM @table@ AS w
                    WHERE w.key = o.key AND w.published_at IS NULL
                      AND w.next_attempt_at IS NOT NULL AND w.id < o.id))
            ORDER BY o.id
            LIMIT batch - cardinality(taken));
    END LOOP;
    RETURN QUERY
        SELECT o.id, o.event_id, o.topic, o.key, o.payload::text, o.payload_bytes,
               o.headers::text, o.event_type, o.aggregate_type, o.aggregate_id, o.attempts,
               o.created_at
        FROM @table@ AS o
        WHERE o.id = ANY(taken) AND o.published_at IS NULL
        ORDER BY o.id
        FOR UPDATE OF o;
END
$fn$;
