-- notify-outbox inbox migration 0001: the consumer side's processed-events table.
-- It lives in the *consumer's* database. A consumer inserts the event id of each message here
-- in the same transaction as its business change (notify_outbox.inbox.Inbox.process), so a
-- redelivered message finds its id and is skipped. Words between at-signs are replaced by
-- validated, quoted names (`notify-outbox sql --inbox` prints the rendered text).

CREATE SCHEMA IF NOT EXISTS @schema@;

CREATE TABLE @table@ (
    -- Which consumer processed the event: several consumers (handlers, consumer groups) may
    -- share one table, and each applies an event once.
    consumer     text        NOT NULL,
    -- The outbox-event-id header (a canonical lower-case UUID), or another producer's id.
    event_id     text        NOT NULL,
    processed_at timestamptz NOT NULL DEFAULT now(),
    -- The unique index is the guard: a second transaction inserting the same id waits for the
    -- first to commit (then it finds the row) or to roll back (then it inserts it).
    CONSTRAINT @prefix@_pkey PRIMARY KEY (consumer, event_id),
    CONSTRAINT @prefix@_event_id_length CHECK (octet_length(event_id) BETWEEN 1 AND 512)
);

-- Retention deletes by age (`notify-outbox inbox purge --older-than 30d`).
CREATE INDEX @prefix@_processed_at_idx ON @table@ (processed_at);
