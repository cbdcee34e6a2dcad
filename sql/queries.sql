-- Runtime queries of notify-outbox, one per "-- name:" block. Words between at-signs are
-- replaced by validated, quoted names once at start-up; values are always $n parameters.

-- name: claim
-- Locks up to $1 rows in per-key commit order until the claiming transaction ends, looking at no
-- more than $2 rows at the head of the queue to choose key buckets; $3..$5 are the relay's
-- low-water mark (low, running transactions, their marks), and the last row returned (id NULL)
-- is the next one. Migrations 0005 (buckets) and 0006 (the mark, parking) explain it.
SELECT * FROM @schema@.@prefix@_claim($1, $2, $3, $4, $5);

-- name: has_due
-- Whether a claim would get something ($1..$3: the low-water mark); see migration 0006.
SELECT @schema@.@prefix@_due($1, $2, $3);

-- name: poll
-- The fallback poll's look, in one statement: has_due; seconds until the earliest retry that is
-- not due yet (NULL: none), to wake the relay then; whether a parked row is left first of its
-- key, which only promote_stuck releases (migration 0006); and when the server started, which
-- changes when it restarted or another server took over (the relay then drops its low-water
-- mark: a failover to an asynchronous standby can lose marks, and leave rows below it).
SELECT @schema@.@prefix@_due($1, $2, $3),
       (SELECT extract(epoch FROM min(next_attempt_at) - now())::float8 FROM @table@
        WHERE published_at IS NULL AND next_attempt_at > now()
          AND next_attempt_at < 'infinity'),
       EXISTS (SELECT FROM @schema@.@prefix@_stuck()),
       pg_postmaster_start_time();

-- name: promote_stuck
-- Promotes the parked rows left first of their key. A row some claim holds is skipped: that
-- claim promotes what follows it.
UPDATE @table@ AS o SET next_attempt_at = now()
WHERE o.id = ANY(ARRAY(
        SELECT t.id FROM @table@ AS t
        WHERE t.id = ANY(ARRAY(SELECT @schema@.@prefix@_stuck()))
          AND t.next_attempt_at = 'infinity'
        FOR UPDATE SKIP LOCKED));

-- name: promote_next
-- After a retried row of each key $1 was published or dead-lettered (same transaction; $2 its
-- id): each key's earliest waiting row after it, if parked, is due now, so the key's later rows
-- follow (migration 0006). "After it": a published row is marked only later in the
-- transaction, and would otherwise be its own key's earliest waiting row.
UPDATE @table@ AS o SET next_attempt_at = now()
WHERE o.id = ANY(ARRAY(
        SELECT (SELECT w.id FROM @table@ AS w
                WHERE w.key = k.key AND w.id > k.after
                  AND w.published_at IS NULL AND w.next_attempt_at IS NOT NULL
                ORDER BY w.key, w.id LIMIT 1)
        FROM unnest($1::text[], $2::bigint[]) AS k(key, after)))
  AND o.next_attempt_at = 'infinity';

-- name: count_pending
-- Pending rows, counted up to $1 (bounded work at any table size): fresh rows at or above the
-- floor of the low-water mark $2..$4, and waiting ones (each part capped, then the sum).
SELECT least($1, (SELECT count(*) FROM (SELECT 1 FROM @table@
                                        WHERE published_at IS NULL AND next_attempt_at IS NULL
                                          AND id >= @schema@.@prefix@_floor($2, $3, $4)
                                        LIMIT $1) AS f)
               + (SELECT count(*) FROM (SELECT 1 FROM @table@
                                        WHERE published_at IS NULL
                                          AND next_attempt_at IS NOT NULL
                                        LIMIT $1) AS w));

-- name: mark_published
-- <ids> is an integer array literal built by the relay from the claimed ids, never from user
-- data: this statement is sent in the simple protocol (no parameters), followed by
-- the COMMIT and the look, so that mark, commit and look share one round trip.
UPDATE @table@ SET published_at = now() WHERE id = ANY('<ids>'::bigint[]);

-- name: delete_published
DELETE FROM @table@ WHERE id = ANY('<ids>'::bigint[]);

-- name: look
-- Sent after a claim's COMMIT (in the same round trip): whether more is due (the command tag
-- "SELECT 1" or "SELECT 0" says it). <horizon> is the low-water mark as literals rendered by
-- the relay from integers (simple protocol: no parameters).
SELECT 1 WHERE @schema@.@prefix@_due(<horizon>);

-- name: record_failures
-- $1 ids, $2 errors, $3 seconds until the next attempt.
UPDATE @table@ AS o
SET attempts = o.attempts + 1,
    last_error = f.error,
    next_attempt_at = now() + make_interval(secs => f.delay)
FROM unnest($1::bigint[], $2::text[], $3::float8[]) AS f(id, error, delay)
WHERE o.id = f.id;

-- name: dead_letter
-- Moves rows to the dead-letter table with their error ($1 ids, $2 errors) in one statement.
WITH moved AS (
    DELETE FROM @table@ AS o
    USING unnest($1::bigint[], $2::text[]) AS f(id, error)
    WHERE o.id = f.id
    RETURNING o.id, o.event_id, o.topic, o.key, o.payload, o.payload_bytes, o.headers,
              o.event_type, o.aggregate_type, o.aggregate_id, o.idempotency_key, o.created_at,
              o.attempts, f.error
)
INSERT INTO @dead_letter@ (id, event_id, topic, key, payload, payload_bytes, headers, event_type,
                           aggregate_type, aggregate_id, idempotency_key, created_at, attempts,
                           error)
SELECT id, event_id, topic, key, payload, payload_bytes, headers, event_type, aggregate_type,
       aggregate_id, idempotency_key, created_at, attempts + 1, error
FROM moved;

-- name: delete_expired
-- Retention: removes up to $2 rows published more than $1 seconds ago.
DELETE FROM @table@
WHERE id IN (
    SELECT id FROM @table@
    WHERE published_at < now() - make_interval(secs => $1)
    LIMIT $2
    FOR UPDATE SKIP LOCKED
);

-- name: insert_events
-- The Python producer API: one round trip for any number of events.
INSERT INTO @table@ (event_id, topic, key, payload, payload_bytes, headers, event_type,
                     aggregate_type, aggregate_id, idempotency_key)
SELECT * FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[]::jsonb[], $5::bytea[],
                     $6::text[]::jsonb[], $7::text[], $8::text[], $9::text[], $10::text[]);

-- name: requeue_dead
-- Moves one dead letter ($1) back into the outbox as a new row at the end of its key's order: a
-- new id, drawn by the ordering trigger under the key's lock (keyless rows: the identity), and
-- the same event id, payload and headers, attempts reset. Returns the new id; no row when the
-- dead letter is gone, or when its idempotency key is held by a row now in the outbox (it then
-- stays a dead letter). notify_outbox/deadletters.py explains the order.
WITH moved AS (
    DELETE FROM @dead_letter@ AS d
    WHERE d.id = $1
      AND (d.idempotency_key IS NULL OR NOT EXISTS (
            SELECT 1 FROM @table@ AS o WHERE o.idempotency_key = d.idempotency_key))
    RETURNING d.event_id, d.topic, d.key, d.payload, d.payload_bytes, d.headers, d.event_type,
              d.aggregate_type, d.aggregate_id, d.idempotency_key
)
INSERT INTO @table@ (event_id, topic, key, payload, payload_bytes, headers, event_type,
                     aggregate_type, aggregate_id, idempotency_key)
SELECT * FROM moved
RETURNING id;

-- name: stats
-- `notify-outbox status`: bounded work at any table size (through the partial indexes of
-- migration 0003 and the published index): every count stops at $1; the oldest pending row is
-- the one with the smallest id (ids follow insert order; of the waiting rows, up to $1 are
-- looked at).
SELECT
    (SELECT count(*) FROM (
        (SELECT 1 FROM @table@ WHERE published_at IS NULL AND next_attempt_at IS NULL LIMIT $1)
        UNION ALL
        (SELECT 1 FROM @table@ WHERE published_at IS NULL AND next_attempt_at IS NOT NULL
         LIMIT $1)
        LIMIT $1) AS p) AS pending,
    (SELECT count(*) FROM (SELECT 1 FROM @table@
                           WHERE published_at IS NULL AND next_attempt_at IS NOT NULL
                             AND next_attempt_at < 'infinity'
                           LIMIT $1) AS w) AS retrying,
    -- Rows parked behind a failed row of their key (migration 0006).
    (SELECT count(*) FROM (SELECT 1 FROM @table@
                           WHERE published_at IS NULL AND next_attempt_at = 'infinity'
                           LIMIT $1) AS h) AS held_back,
    (SELECT extract(epoch FROM now() - o.created_at)::float8 FROM @table@ AS o
     WHERE o.id = LEAST(
        (SELECT min(id) FROM @table@ WHERE published_at IS NULL AND next_attempt_at IS NULL),
        (SELECT min(w.id) FROM (SELECT id FROM @table@
                                WHERE published_at IS NULL AND next_attempt_at IS NOT NULL
                                LIMIT $1) AS w))) AS oldest_pending_seconds,
    (SELECT count(*) FROM (SELECT 1 FROM @table@ WHERE published_at IS NOT NULL LIMIT $1) AS k)
        AS published_kept,
    (SELECT count(*) FROM (SELECT 1 FROM @dead_letter@ LIMIT $1) AS d) AS dead_lettered;

-- name: notify_mode
-- Read at a relay's start; with the server's start time (see poll).
SELECT notify_mode, awake_epoch_ms, pg_postmaster_start_time() AS server_started FROM @config@;

-- name: set_notify_mode
UPDATE @config@ SET notify_mode = $1 RETURNING notify_mode;

-- name: hold_awake
-- The awake marker (migration 0006): an awake relay that is making progress holds the locks of
-- the current and the next epoch of $2 ms. $1: the epochs held now; the older ones are let go.
-- Returns the epochs held after. Never blocks (a try; another relay may hold an epoch already,
-- which marks it awake just as well). The CASEs fix the order of evaluation: a lock call must
-- only run for the epochs it is meant for (the planner may reorder ANDed conditions).
WITH c AS MATERIALIZED (SELECT @schema@.@prefix@_awake_epoch($2) AS cur),
took AS MATERIALIZED (
    SELECT e FROM c, generate_series(c.cur, c.cur + 1) AS e
    WHERE CASE WHEN e = ANY($1::integer[]) THEN false
               ELSE pg_try_advisory_lock(@awake_ns@, e) END
),
freed AS MATERIALIZED (
    SELECT e FROM c, unnest($1::integer[]) AS e
    WHERE CASE WHEN e < c.cur THEN pg_advisory_unlock(@awake_ns@, e) ELSE false END
)
SELECT ARRAY(SELECT e FROM c, unnest($1::integer[]) AS e WHERE e >= c.cur
             UNION ALL SELECT e FROM took ORDER BY 1)
FROM (SELECT count(*) FROM freed) AS f;

-- name: try_sleep
-- Releases the marker's locks $1 only while no producer is in flight (G free), in one statement
-- so that nothing can land between the check and the release. Never blocks: a relay waiting on
-- G would queue every new producer behind it. False means "producers in flight: stay awake,
-- claim again". (The release, in the THEN branch, runs only when G was taken.)
SELECT CASE WHEN pg_try_advisory_xact_lock(@gate_key@)
            THEN (SELECT count(*) FROM unnest($1::integer[]) AS e
                  WHERE pg_advisory_unlock(@awake_ns@, e)) >= 0
            ELSE false END;

-- name: release_awake
-- Lets producers NOTIFY again at once ($1: the epochs held), while some producer transaction
-- stays open (so try_sleep keeps failing), or while Kafka is away. Producers that skipped their
-- NOTIFY before this are still in flight: the relay watches gate_free and looks once more when
-- it is.
SELECT (SELECT count(*) FROM unnest($1::integer[]) AS e
        WHERE pg_advisory_unlock(@awake_ns@, e)) >= 0;

-- name: gate_free
-- True when no producer is in flight (G taken and, the statement being its own transaction,
-- released at once). Never blocks.
SELECT pg_try_advisory_xact_lock(@gate_key@);

-- name: listener_identity
-- Who this listening session is: pid and start time identify it even after pid reuse.
SELECT pid, backend_start FROM pg_stat_activity WHERE pid = pg_backend_pid();

-- name: end_old_listener
-- After a reconnect: make sure the previous listening session is gone, and with it the awake
-- marker it may hold, before the catch-up claim (waits up to $3 ms for it to exit).
SELECT pg_terminate_backend(pid, $3) FROM pg_stat_activity
WHERE pid = $1 AND backend_start = $2;

-- name: metrics_stats
-- The gauges of /metrics (notify_outbox/metrics.py), bounded work at any table size, through
-- the partial indexes of migrations 0003 and 0006: pending rows (fresh, from the floor of the
-- relay's low-water mark $2..$4, and waiting for a retry or parked) and dead-lettered rows
-- counted up to $1 each; the age of the pending row with the smallest id (a cheap proxy for
-- the oldest: ids follow insert order, created_at is its transaction's start; of the waiting
-- rows, up to $1 are looked at).
SELECT
    (SELECT count(*) FROM (SELECT 1 FROM @table@
                           WHERE published_at IS NULL AND next_attempt_at IS NULL
                             AND id >= @schema@.@prefix@_floor($2, $3, $4) LIMIT $1) AS f)
    + (SELECT count(*) FROM (SELECT 1 FROM @table@
                             WHERE published_at IS NULL AND next_attempt_at IS NOT NULL
                             LIMIT $1) AS w)
        AS pending,
    (SELECT extract(epoch FROM now() - o.created_at)::float8 FROM @table@ AS o
     WHERE o.id = LEAST(
        (SELECT min(id) FROM @table@ WHERE published_at IS NULL AND next_attempt_at IS NULL
                                       AND id >= @schema@.@prefix@_floor($2, $3, $4)),
        (SELECT min(w.id) FROM (SELECT id FROM @table@
                                WHERE published_at IS NULL AND next_attempt_at IS NOT NULL
                                LIMIT $1) AS w)))
        AS oldest_pending_seconds,
    (SELECT count(*) FROM (SELECT 1 FROM @dead_letter@ LIMIT $1) AS d) AS dead_lettered;

-- name: dead_letters_match
-- Dead letters (notify_outbox/deadletters.py). Every dead_letters_* query takes the same filter
-- as $1..$7, each NULL for "any": $1 ids, $2 topic, $3 key (exact), $4 text in the error (any
-- case), $5 dead-lettered at or after, $6 dead-lettered before, $7 dead-lettered more than this
-- many seconds ago. (This condition replaces <match> in the queries below.)
($1::bigint[] IS NULL OR id = ANY($1::bigint[]))
AND ($2::text IS NULL OR topic = $2::text)
AND ($3::text IS NULL OR key = $3::text)
AND ($4::text IS NULL OR strpos(lower(error), lower($4::text)) > 0)
AND ($5::timestamptz IS NULL OR dead_lettered_at >= $5::timestamptz)
AND ($6::timestamptz IS NULL OR dead_lettered_at < $6::timestamptz)
AND ($7::float8 IS NULL OR dead_lettered_at < now() - make_interval(secs => $7::float8))

-- name: dead_letters_list
-- Matching dead letters with ids in ($8, $9], in id order, at most $10.
SELECT id, event_id, topic, key, payload::text AS payload, payload_bytes,
       headers::text AS headers, event_type, aggregate_type, aggregate_id, idempotency_key,
       created_at, attempts, error, dead_lettered_at
FROM @dead_letter@
WHERE <match>
  AND id > $8 AND id <= $9
ORDER BY id
LIMIT $10;

-- name: dead_letters_count
-- Matching dead letters, counted up to $8.
SELECT count(*) FROM (
    SELECT 1 FROM @dead_letter@
    WHERE <match>
    LIMIT $8
) AS m;

-- name: dead_letters_last_id
-- The largest dead-letter id: a requeue by filter stops there, so that a row it requeued and
-- that died again (with a new, larger id) is not requeued again by the same command.
SELECT coalesce(max(id), 0) FROM @dead_letter@;

-- name: dead_letters_purge
-- Deletes up to $8 matching dead letters. (No FOR UPDATE SKIP LOCKED: it would need UPDATE on
-- the table, which the relay role does not have; two purges at once just delete fewer each.)
DELETE FROM @dead_letter@
WHERE id IN (
    SELECT id FROM @dead_letter@
    WHERE <match>
    LIMIT $8
);

-- name: replay_range
-- Replay (notify_outbox/replay.py) sends published rows kept by keep_published again.
-- This one: the kept rows of topic $1 published in [$2, $3): how many, and their id span.
SELECT count(*) AS rows, min(id) AS first_id, max(id) AS last_id
FROM @table@
WHERE published_at >= $2 AND published_at < $3 AND topic = $1;

-- name: replay_kept
-- When the kept published rows (any topic) were published: the message when none match.
-- Both ends of the published index, so instant at any size.
SELECT min(published_at) AS earliest, max(published_at) AS latest
FROM @table@ WHERE published_at IS NOT NULL;

-- name: replay_rows
-- Rows of replay_range with ids in ($4, $5], in id order (per-key order), at most $6, in
-- OutboxRow's field order. The id span keeps every page a short primary-key range.
SELECT id, event_id, topic, key, payload::text, payload_bytes, headers::text, event_type,
       aggregate_type, aggregate_id, attempts
FROM @table@
WHERE id > $4 AND id <= $5
  AND published_at >= $2 AND published_at < $3 AND topic = $1
ORDER BY id
LIMIT $6;

-- name: delivery
-- The delivery mode the outbox is set to (migration 0007; NULL before it).
-- (Read through to_jsonb, so that the statement also parses where the column is missing.)
SELECT to_jsonb(c) ->> 'delivery' FROM @config@ AS c;

-- name: set_delivery
UPDATE @config@ SET delivery = $1 RETURNING delivery;

-- name: eos_lease
-- Take exactly-once slot $1 for owner $2 for $3 ms, if it is free, expired or already $2's.
-- Returns the sequence of the batch it has in flight (NULL: none), or no row if not taken.
WITH slot AS (
    INSERT INTO @eos_slot@ AS s (slot, owner, expires_at)
    VALUES ($1, $2, now() + make_interval(secs => $3 / 1000.0))
    ON CONFLICT (slot) DO UPDATE
        SET owner = excluded.owner, expires_at = excluded.expires_at
        WHERE s.owner IS NULL OR s.owner = excluded.owner OR s.expires_at < now()
    RETURNING s.slot
)
SELECT (SELECT max(st.seq) FROM @eos_stamp@ AS st WHERE st.slot = slot.slot) AS outstanding
FROM slot;

-- name: eos_renew
-- Extend owner $2's lease of slot $1 by $3 ms; no row if the slot is no longer $2's.
UPDATE @eos_slot@ SET expires_at = now() + make_interval(secs => $3 / 1000.0)
WHERE slot = $1 AND owner = $2
RETURNING slot;

-- name: eos_release
UPDATE @eos_slot@ SET owner = NULL, expires_at = now() WHERE slot = $1 AND owner = $2;

-- name: eos_tick
-- A relay's one periodic statement in exactly-once mode: renew the leases of the slots $3 its
-- workers serve (owners "$1<n>"; $2 ms), and say which of them it still holds, which slots
-- were abandoned with a batch in flight, and whether rows are due (fresh or retried, not in
-- flight). A slot its worker gave up after an error is not renewed: it expires.
WITH renewed AS (
    UPDATE @eos_slot@ SET expires_at = now() + make_interval(secs => $2 / 1000.0)
    WHERE left(owner, length($1)) = $1 AND slot = ANY($3::integer[])
    RETURNING slot
)
SELECT ARRAY(SELECT r.slot FROM renewed AS r) AS held,
       ARRAY(SELECT s.slot FROM @eos_slot@ AS s
             WHERE s.expires_at < now()
               AND EXISTS (SELECT 1 FROM @eos_stamp@ AS st WHERE st.slot = s.slot)
             ORDER BY s.slot) AS orphans,
       EXISTS (SELECT 1 FROM @table@ AS o
               WHERE o.published_at IS NULL AND o.next_attempt_at IS NULL
                 AND NOT EXISTS (SELECT 1 FROM @eos_stamp@ AS st WHERE st.id = o.id))
       OR EXISTS (SELECT 1 FROM @table@ AS o
                  WHERE o.published_at IS NULL AND o.next_attempt_at <= now()) AS due;

-- name: eos_free
-- Slots below $1 that owner $2 may take: held by nobody (never used, released or expired),
-- or still by $2 itself (a worker taking its slot again after an error); orphans first.
SELECT g.slot
FROM generate_series(0, $1 - 1) AS g(slot)
LEFT JOIN @eos_slot@ AS s ON s.slot = g.slot
WHERE s.slot IS NULL OR s.owner IS NULL OR s.expires_at < now() OR s.owner = $2
ORDER BY EXISTS (SELECT 1 FROM @eos_stamp@ AS st WHERE st.slot = g.slot) DESC, g.slot;

-- name: eos_step
SELECT * FROM @schema@.@prefix@_eos_step($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13);
