-- notify-outbox migration 0008: the notification names its outbox (issue #34, many outboxes).
--
-- Until now every outbox notified its channel with an empty payload, so a relay serving many
-- outboxes of one database could not tell which one to claim. Now the payload is the outbox's
-- 'schema.table'. The payload stays a hint, never trusted (any role can NOTIFY any channel):
-- a relay maps it to an outbox it already knows, or ignores it. PostgreSQL still folds a
-- transaction's notifications with the same channel and payload: one per outbox touched per
-- transaction. Producers pay the same as before (docs/concepts/many-outboxes.md measured the
-- three layouts within 2% of each other: the cost is the commit's notify lock, not the payload).
CREATE OR REPLACE FUNCTION @schema@.@prefix@_notify() RETURNS trigger
LANGUAGE plpgsql AS $fn$
DECLARE
    mode text;
    epoch_ms integer;
    e integer;
BEGIN
    SELECT c.notify_mode, c.awake_epoch_ms INTO mode, epoch_ms FROM @config@ AS c;
    IF mode = 'off' THEN
        RETURN NULL;
    END IF;
    IF mode IS DISTINCT FROM 'always' THEN
        PERFORM pg_advisory_xact_lock_shared(@gate_key@);
        e := @schema@.@prefix@_awake_epoch(epoch_ms);
        -- Probe the current epoch's marker shared and release it in one expression (0002).
        IF NOT (CASE WHEN pg_try_advisory_lock_shared(@awake_ns@, e)
                     THEN pg_advisory_unlock_shared(@awake_ns@, e) ELSE false END) THEN
            RETURN NULL;  -- a relay claimed moments ago, and will re-check before it sleeps
        END IF;
    END IF;
    PERFORM pg_notify(@channel_literal@, @target_literal@);
    RETURN NULL;
END
$fn$;
