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

-- name: claim_many
-- The batch path's claim: every id of a fetched batch ($2, distinct) in one statement; returns
-- the ids that were not there (the fresh ones). Concurrent transactions wait on the primary key
-- exactly as in `claim`.
INSERT INTO @table@ (consumer, event_id) SELECT $1, unnest($2::text[])
ON CONFLICT (consumer, event_id) DO NOTHING
RETURNING event_id

-- name: dead_letter
-- One message the handler failed on (on_error="dead_letter"); in the transaction that claims
-- its id, so a redelivery is a repeat.
INSERT INTO @dead_letter@
    (consumer, event_id, topic, kafka_partition, kafka_offset, key, value, headers, error)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8::jsonb, $9)
ON CONFLICT (consumer, event_id) DO NOTHING

-- name: identity
-- What makes this database distinct from every other one (the Redis fast path's key scope):
-- the cluster's system identifier and the database's oid.
SELECT (SELECT system_identifier FROM pg_control_system())::text || '/'
    || (SELECT oid FROM pg_database WHERE datname = current_database())::text
