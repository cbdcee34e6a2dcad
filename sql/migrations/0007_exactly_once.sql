-- notify-outbox migration 0007: exactly-once delivery (opt-in; docs/concepts/exactly-once.md).
--
-- At-least-once relays do not read anything added here, apart from the configured delivery
-- mode at start (a relay of the other mode refuses to start). A relay in exactly-once mode
-- sends each claimed batch in one Kafka transaction of a slot (its own transactional.id) with a
-- marker record (slot, sequence, ids), and records *before* that transaction that the batch's
-- rows are in flight in (slot, sequence): the stamp. Its next step confirms the batch (marks the
-- rows published) in the same database transaction that stamps the next one. A new owner of a
-- slot fences the old producer, reads the slot's markers read_committed, and settles the one
-- batch that can be outstanding: published if its marker committed, given back if not.

ALTER TABLE @config@
    ADD COLUMN delivery text NOT NULL DEFAULT 'at-least-once'
        CHECK (delivery IN ('at-least-once', 'exactly-once'));

-- One row per slot: who holds it, until when (the database's clock: a relay frozen past its
-- lease loses the slot even if its sessions live on), and the last sequence it stamped.
CREATE TABLE @eos_slot@ (
    slot       integer PRIMARY KEY CHECK (slot >= 0),
    owner      text,
    expires_at timestamptz NOT NULL DEFAULT now(),
    seq        bigint NOT NULL DEFAULT 0
);

-- The rows in flight: stamped with the slot and sequence of the Kafka transaction that carries
-- them. At most one sequence per slot at a time. A stamped row holds its key's later rows back.
CREATE TABLE @eos_stamp@ (
    id   bigint PRIMARY KEY,
    key  text,
    slot integer NOT NULL,
    seq  bigint NOT NULL
);
CREATE INDEX @prefix@_eos_stamp_key_idx ON @eos_stamp@ (key) WHERE key IS NOT NULL;
CREATE INDEX @prefix@_eos_stamp_slot_idx ON @eos_stamp@ (slot, seq);

-- One step of a slot, in one transaction: settle the slot's outstanding batch (p_settle: its
-- sequence, or NULL), then stamp up to p_batch rows as the slot's next batch and return them
-- with its sequence. Raises SQLSTATE NO001 when the slot is no longer p_owner's.
--
-- Settling: p_committed says whether the batch's Kafka transaction committed. If it did, its
-- rows are published (marked, or deleted with p_delete). If not, the rows with an error of
-- their own are retried later (p_retry_*) or dead-lettered (p_dead_*), and the others are
-- simply given back.
--
-- Stamping takes a row only if no earlier row of its key is unpublished and outside this
-- batch (stamped by any slot, or waiting for a retry): per-key order across slots and relays.
-- Stamping claims are serialized by one transaction-scoped advisory lock (a claim is one short
-- transaction here, never held through a Kafka send), and each statement reads with a snapshot
-- taken after the lock, so every earlier claim's stamps are seen.
CREATE FUNCTION @schema@.@prefix@_eos_step(
    p_slot integer, p_owner text, p_lease_ms integer,
    p_settle bigint, p_committed boolean,
    p_retry_ids bigint[], p_retry_errors text[], p_retry_delays float8[],
    p_dead_ids bigint[], p_dead_errors text[],
    p_delete boolean, p_batch integer, p_scan integer)
RETURNS TABLE(id bigint, event_id uuid, topic text, key text, payload text, payload_bytes bytea,
              headers text, event_type text, aggregate_type text, aggregate_id text,
              attempts integer, created_at timestamp with time zone, seq bigint)
    LANGUAGE plpgsql
    SET jit TO 'off'
    AS $$
#variable_conflict use_column
DECLARE
    cur bigint;
    settled bigint[];
BEGIN
    SELECT s.seq INTO cur FROM @eos_slot@ AS s
    WHERE s.slot = p_slot AND s.owner = p_owner
    FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'exactly-once slot % is no longer held by %', p_slot, p_owner
            USING ERRCODE = 'NO001';
    END IF;
    UPDATE @eos_slot@ AS s SET expires_at = now() + make_interval(secs => p_lease_ms / 1000.0)
    WHERE s.slot = p_slot;

    IF p_settle IS NOT NULL THEN
        WITH gone AS (
            DELETE FROM @eos_stamp@ AS st WHERE st.slot = p_slot AND st.seq = p_settle
            RETURNING st.id
        )
        SELECT coalesce(array_agg(gone.id), '{}') INTO settled FROM gone;
        IF p_committed THEN
            IF p_delete THEN
                DELETE FROM @table@ AS o WHERE o.id = ANY(settled);
            ELSE
                UPDATE @table@ AS o SET published_at = now()
                WHERE o.id = ANY(settled) AND o.published_at IS NULL;
            END IF;
        ELSE
            UPDATE @table@ AS o
            SET attempts = o.attempts + 1,
                last_error = f.error,
                next_attempt_at = now() + make_interval(secs => f.delay)
            FROM unnest(p_retry_ids, p_retry_errors, p_retry_delays) AS f(id, error, delay)
            WHERE o.id = f.id AND o.id = ANY(settled);
            WITH moved AS (
                DELETE FROM @table@ AS o
                USING unnest(p_dead_ids, p_dead_errors) AS f(id, error)
                WHERE o.id = f.id AND o.id = ANY(settled)
                RETURNING o.id, o.event_id, o.topic, o.key, o.payload, o.payload_bytes,
                          o.headers, o.event_type, o.aggregate_type, o.aggregate_id,
                          o.idempotency_key, o.created_at, o.attempts, f.error
            )
            INSERT INTO @dead_letter@ (id, event_id, topic, key, payload, payload_bytes,
                                       headers, event_type, aggregate_type, aggregate_id,
                                       idempotency_key, created_at, attempts, error)
            SELECT m.id, m.event_id, m.topic, m.key, m.payload, m.payload_bytes, m.headers,
                   m.event_type, m.aggregate_type, m.aggregate_id, m.idempotency_key,
                   m.created_at, m.attempts + 1, m.error
            FROM moved AS m;
        END IF;
    END IF;

    IF p_batch <= 0 THEN
        RETURN;
    END IF;
    IF EXISTS (SELECT 1 FROM @eos_stamp@ AS st WHERE st.slot = p_slot) THEN
        RAISE EXCEPTION 'exactly-once slot % still has a batch in flight', p_slot
            USING ERRCODE = 'NO002';
    END IF;
    PERFORM pg_advisory_xact_lock(@eos_key@);

    -- Candidates: the earliest fresh rows not in flight, and rows whose retry time came (or
    -- parked by an at-least-once claim before the switch). Then each one whose key has no
    -- earlier unpublished row outside the candidates and nothing in flight.
    INSERT INTO @eos_stamp@ (id, key, slot, seq)
    WITH fresh AS (
        SELECT o.id, o.key FROM @table@ AS o
        WHERE o.published_at IS NULL AND o.next_attempt_at IS NULL
          AND NOT EXISTS (SELECT 1 FROM @eos_stamp@ AS st WHERE st.id = o.id)
        ORDER BY o.id
        LIMIT p_scan
    ),
    due AS (
        SELECT o.id, o.key FROM @table@ AS o
        WHERE o.published_at IS NULL AND o.next_attempt_at IS NOT NULL
          AND (o.next_attempt_at <= now() OR o.next_attempt_at = 'infinity')
          AND NOT EXISTS (SELECT 1 FROM @eos_stamp@ AS st WHERE st.id = o.id)
        ORDER BY o.next_attempt_at
        LIMIT p_scan
    ),
    cand AS MATERIALIZED (
        SELECT fresh.id, fresh.key FROM fresh UNION ALL SELECT due.id, due.key FROM due
    )
    SELECT c.id, c.key, p_slot, cur + 1
    FROM cand AS c
    WHERE c.key IS NULL
       OR (NOT EXISTS (SELECT 1 FROM @eos_stamp@ AS st WHERE st.key = c.key)
           AND NOT EXISTS (
               SELECT 1 FROM @table@ AS w
               WHERE w.key = c.key AND w.published_at IS NULL AND w.next_attempt_at IS NOT NULL
                 AND w.id < c.id
                 AND (w.next_attempt_at > now() AND w.next_attempt_at < 'infinity'
                      OR NOT EXISTS (SELECT 1 FROM cand AS c2 WHERE c2.id = w.id))))
    ORDER BY c.id
    LIMIT p_batch;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    UPDATE @eos_slot@ AS s SET seq = cur + 1 WHERE s.slot = p_slot;
    RETURN QUERY
        SELECT o.id, o.event_id, o.topic, o.key, o.payload::text, o.payload_bytes,
               o.headers::text, o.event_type, o.aggregate_type, o.aggregate_id, o.attempts,
               o.created_at, cur + 1
        FROM @eos_stamp@ AS st JOIN @table@ AS o ON o.id = st.id
        WHERE st.slot = p_slot AND st.seq = cur + 1
        ORDER BY o.id;
END
$$;
