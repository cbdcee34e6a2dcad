-- notify-outbox migration 0003: the claim locks keys, not rows.
--
-- Why: the claim of migration 0001 found "the earliest pending row of its key" with an anti-join
-- for every row it looked at. While a keyed backlog drained, every probe walked over the key's
-- rows published moments before (dead index entries until vacuum), and workers competed for
-- the same heads: 1,000 keys drained at 4k events/s against 31k without keys.
--
-- Now a claim walks the rows that never failed in id order and takes a transaction-scoped
-- advisory lock per key (per row for rows without a key) with a *try*: a key is owned by one
-- claim at a time, other claims pass it by, and the locks vanish with the claiming transaction
-- (commit, rollback, or a relay that died). Nothing is written to claim: no lease to expire,
-- and it works through a transaction-pooling PgBouncer. Rows that failed and wait for a retry
-- are kept in their own small index, so "does this key wait behind a failed row?" is a probe
-- into an index that is almost always empty.

DROP INDEX @schema@.@prefix@_pending_key_idx;
DROP INDEX @schema@.@prefix@_pending_idx;

-- Rows never tried yet or held back behind a failed row of their key: what a claim reads, in
-- id order (= commit order per key).
CREATE INDEX @prefix@_fresh_idx ON @table@ (id)
    WHERE published_at IS NULL AND next_attempt_at IS NULL;
-- Rows that failed and wait for their next attempt (usually none): which keys are blocked...
CREATE INDEX @prefix@_waiting_key_idx ON @table@ (key, id)
    WHERE published_at IS NULL AND next_attempt_at IS NOT NULL;
-- ...and which retries are due.
CREATE INDEX @prefix@_waiting_due_idx ON @table@ (next_attempt_at)
    WHERE published_at IS NULL AND next_attempt_at IS NOT NULL;

-- Claims up to `batch` rows for the calling transaction, in id order, looking at no more than
-- `scan` candidate rows (a claim that meets only rows of keys other claims own gives up early
-- rather than walk the whole table). Per key, the rows returned are the key's earliest pending
-- rows, with no gap: a key whose lock another claim holds is passed by for the whole claim,
-- even if that claim ends while this one is still walking (its rows may have changed since
-- this claim's snapshot). The final SELECT re-reads every row under a row lock, so a row
-- published by a claim that committed meanwhile is left out.
CREATE FUNCTION @schema@.@prefix@_claim(batch integer, scan integer)
RETURNS TABLE (id bigint, event_id uuid, topic text, key text, payload text, payload_bytes bytea,
               headers text, event_type text, aggregate_type text, aggregate_id text,
               attempts integer)
-- The walk's estimated cost covers the whole table (it stops early, the planner cannot know),
-- which would make PostgreSQL JIT-compile it at every call: 100+ ms for a 1 ms claim.
LANGUAGE plpgsql SET jit = off AS $fn$
#variable_conflict use_column
DECLARE
    r record;
    taken bigint[] := '{}';
    -- Keys refused in this claim, as a bitmap of their hash's low 16 bits: constant time to
    -- check (an array was linear, and long when many claims run at once). A collision passes
    -- over a key that could have been taken, which is always safe.
    refused bytea := decode(repeat('00', 8192), 'hex');
    lock_key integer;
    seen integer := 0;
BEGIN
    -- Retries that are due, each the earliest waiting row of its key (so each key once).
    FOR r IN
        SELECT o.id, o.key FROM @table@ AS o
        WHERE o.published_at IS NULL AND o.next_attempt_at <= now()
          AND NOT EXISTS (SELECT 1 FROM @table@ AS w
                          WHERE w.key = o.key AND w.published_at IS NULL
                            AND w.next_attempt_at IS NOT NULL AND w.id < o.id)
        ORDER BY o.id
    LOOP
        EXIT WHEN cardinality(taken) >= batch;
        IF pg_try_advisory_xact_lock(@claim_ns@, coalesce(hashtext(r.key), hashint8(r.id))) THEN
            taken := taken || r.id;
        END IF;
    END LOOP;
    -- Fresh rows, skipping keys that wait behind a failed row (those keys appeared above).
    IF cardinality(taken) < batch THEN
        FOR r IN
            SELECT o.id, o.key FROM @table@ AS o
            WHERE o.published_at IS NULL AND o.next_attempt_at IS NULL
              AND (o.key IS NULL OR NOT EXISTS (
                    SELECT 1 FROM @table@ AS w
                    WHERE w.key = o.key AND w.published_at IS NULL
                      AND w.next_attempt_at IS NOT NULL AND w.id < o.id))
            ORDER BY o.id
        LOOP
            seen := seen + 1;
            EXIT WHEN seen > scan;
            IF r.key IS NULL THEN
                CONTINUE WHEN NOT pg_try_advisory_xact_lock(@claim_ns@, hashint8(r.id));
            ELSE
                lock_key := hashtext(r.key);
                CONTINUE WHEN get_bit(refused, lock_key & 65535) = 1;
                IF NOT pg_try_advisory_xact_lock(@claim_ns@, lock_key) THEN
                    refused := set_bit(refused, lock_key & 65535, 1);
                    CONTINUE;
                END IF;
            END IF;
            taken := taken || r.id;
            EXIT WHEN cardinality(taken) >= batch;
        END LOOP;
    END IF;
    RETURN QUERY
        SELECT o.id, o.event_id, o.topic, o.key, o.payload::text, o.payload_bytes,
               o.headers::text, o.event_type, o.aggregate_type, o.aggregate_id, o.attempts
        FROM @table@ AS o
        WHERE o.id = ANY(taken) AND o.published_at IS NULL
        ORDER BY o.id
        FOR UPDATE OF o;
END
$fn$;
