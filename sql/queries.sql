-- Runtime queries of notify-outbox, one per "-- name:" block. Words between at-signs are
-- replaced by validated, quoted names once at start-up; values are always $n parameters.

-- name: claim
-- Locks up to $1 rows in per-key commit order until the claiming transaction ends, looking at no
-- more than $2 candidates (migration 0003 explains how keys are owned).
SELECT * FROM @schema@.@prefix@_claim($1, $2);

-- name: due
-- Whether a claim would get something: a fresh row not held back behind a failed row of its
-- key, or a retry that is due and first of its key. Rows waiting for their retry time, and
-- the rows queued behind them, do not count: they must not keep a relay awake. (A condition,
-- used by has_due and commit_and_look.)
EXISTS (
    SELECT 1 FROM @table@ AS o
    WHERE o.published_at IS NULL AND o.next_attempt_at IS NULL
      AND (o.key IS NULL OR NOT EXISTS (
            SELECT 1 FROM @table@ AS w
            WHERE w.key = o.key AND w.published_at IS NULL
              AND w.next_attempt_at IS NOT NULL AND w.id < o.id)))
OR EXISTS (
    SELECT 1 FROM @table@ AS o
    WHERE o.published_at IS NULL AND o.next_attempt_at <= now()
      AND NOT EXISTS (
            SELECT 1 FROM @table@ AS w
            WHERE w.key = o.key AND w.published_at IS NULL
              AND w.next_attempt_at IS NOT NULL AND w.id < o.id))

-- name: next_retry
-- Seconds until the earliest retry that is not due yet (NULL: none), to wake the relay then.
-- (A scalar subquery, asked together with "due" by the fallback poll.)
SELECT extract(epoch FROM min(next_attempt_at) - now())::float8 FROM @table@
WHERE published_at IS NULL AND next_attempt_at > now()

-- name: count_pending
-- Pending rows, counted up to $1 (bounded work at any table size).
SELECT count(*) FROM (SELECT 1 FROM @table@ WHERE published_at IS NULL LIMIT $1) AS p;

-- name: mark_published
-- <ids> is an integer array literal built by the relay from the claimed ids, never from user
-- data: this statement is sent in the simple protocol (no parameters), followed by
-- commit_and_look, so that mark, commit and look share one round trip.
UPDATE @table@ SET published_at = now() WHERE id = ANY('<ids>'::bigint[]);

-- name: delete_published
DELETE FROM @table@ WHERE id = ANY('<ids>'::bigint[]);

-- name: commit_and_look
-- The end of a claim: commit, then look, as a new statement after the commit, whether more
-- is due (the command tag "SELECT 1" or "SELECT 0" says it; "due" is appended).
COMMIT;
SELECT 1 WHERE

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
-- Moves dead-lettered rows back into the outbox (same ids and event ids), attempts reset.
WITH moved AS (
    DELETE FROM @dead_letter@ WHERE id = ANY($1::bigint[])
    RETURNING id, event_id, topic, key, payload, payload_bytes, headers, event_type,
              aggregate_type, aggregate_id, idempotency_key, created_at
)
INSERT INTO @table@ (id, event_id, topic, key, payload, payload_bytes, headers, event_type,
                     aggregate_type, aggregate_id, idempotency_key, created_at)
OVERRIDING SYSTEM VALUE
SELECT * FROM moved
RETURNING id;

-- name: stats
SELECT count(*) FILTER (WHERE published_at IS NULL) AS pending,
       count(*) FILTER (WHERE published_at IS NULL AND attempts > 0) AS retrying,
       extract(epoch FROM now() - min(created_at) FILTER (WHERE published_at IS NULL))::float8
           AS oldest_pending_seconds,
       count(*) FILTER (WHERE published_at IS NOT NULL) AS published_kept,
       (SELECT count(*) FROM @dead_letter@) AS dead_lettered
FROM @table@;

-- name: notify_mode
SELECT notify_mode FROM @config@;

-- name: set_notify_mode
UPDATE @config@ SET notify_mode = $1 RETURNING notify_mode;

-- name: mark_awake
-- The relay says "I am awake and draining": producers may skip their NOTIFY. Never blocks.
SELECT pg_try_advisory_lock(@awake_key@);

-- name: try_sleep
-- Releases A only while no producer is in flight (G free), in one statement so that nothing
-- can land between the check and the release. Never blocks: a relay waiting on G would queue
-- every new producer behind it. False means "producers in flight: stay awake, claim again".
SELECT CASE WHEN pg_try_advisory_xact_lock(@gate_key@) THEN pg_advisory_unlock(@awake_key@)
            ELSE false END;

-- name: release_awake
-- Lets producers NOTIFY again at once, while some producer transaction stays open (so
-- try_sleep keeps failing). Producers that skipped their NOTIFY before this are still in
-- flight: the relay watches gate_free and looks once more when it is.
SELECT pg_advisory_unlock(@awake_key@);

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
