-- Runtime queries of the consumer-side inbox (notify_outbox/inbox.py). Words between
-- at-signs are replaced by the inbox's validated, quoted names.

-- name: claim
-- Records the event for this consumer; returns a row only if it was not there. A concurrent
-- transaction inserting the same id waits here on the primary key until the first one
-- commits (no row: a repeat) or rolls back (a row: this one applies it).
INSERT INTO @table@ (consumer, event_id) VALUES ($1, $2)
ON CONFLICT (consumer, event_id) DO NOTHING
RETURNING true

-- name: purge
-- One batch of retention: ids processed before the cutoff, of one consumer or ($2 NULL) all.
-- Small batches keep each statement short; the caller loops until a batch comes back short.
DELETE FROM @table@ WHERE ctid = ANY(ARRAY(
    SELECT ctid FROM @table@
    WHERE processed_at < now() - $1::interval AND ($2::text IS NULL OR consumer = $2)
    LIMIT $3
))
