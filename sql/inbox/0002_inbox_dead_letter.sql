-- notify-outbox inbox migration 0002: the inbox's dead-letter table.
-- A consumer running with on_error="dead_letter" (notify_outbox.inbox.consume_batches, or
-- consume) records here a message its handler failed on, and goes on with the next one. The
-- row is written in the same transaction as the message's id in the inbox table, so a
-- redelivery of that message is a repeat: it is neither applied nor recorded twice.

CREATE TABLE @dead_letter@ (
    consumer       text        NOT NULL,
    event_id       text        NOT NULL,
    topic          text,
    kafka_partition integer,
    kafka_offset   bigint,
    key            bytea,
    value          bytea,
    -- The record's headers as [[name, value-as-base64], ...]: a header may not be UTF-8.
    headers        jsonb       NOT NULL DEFAULT '[]',
    error          text        NOT NULL,
    failed_at      timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT @prefix@_dead_letter_pkey PRIMARY KEY (consumer, event_id)
);
