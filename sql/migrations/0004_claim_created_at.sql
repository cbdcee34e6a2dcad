-- notify-outbox migration 0004: the claim function also returns each row's created_at, read
-- under the same row lock as the rest of the row, for the commit-to-ack metric. (Read by a
-- separate look-up in the claim statement, rows committed after that statement began came back
-- without it, and went unmeasured.) Otherwise the function is 0003's, unchanged.

DROP FUNCTION @schema@.@prefix@_claim(integer, integer);

CREATE FUNCTION @schema@.@prefix@_claim(batch integer, scan integer)
RETURNS TABLE (id bigint, event_id uuid, topic text, key text, payload text, payload_bytes bytea,
               headers text, event_type text, aggregate_type text, aggregate_id text,
               attempts integer, created_at timestamptz)
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
               o.headers::text, o.event_type, o.aggregate_type, o.aggregate_id, o.attempts,
               o.created_at
        FROM @table@ AS o
        WHERE o.id = ANY(taken) AND o.published_at IS NULL
        ORDER BY o.id
        FOR UPDATE OF o;
END
$fn$;
