-- notify-outbox migration 0002: the gated notify. Producers NOTIFY only when no relay is
-- awake to drain the table, so a busy relay costs commits no NOTIFY lock at all.
--
-- Why: every transaction that issued NOTIFY takes one cluster-wide lock at commit and holds
-- it through the WAL flush, so notifying commits serialize (16 writers: -69% commits/s).
--
-- The protocol, with two advisory keys per outbox (bigint key space):
--   A (awake): held exclusively, at session level, by an awake relay on its dedicated
--      listening connection; it vanishes with that connection if the relay dies.
--   G (gate):  every inserting statement holds it shared until its transaction ends.
-- A producer skips its NOTIFY only when A is held. A relay releases A only inside a statement
-- that got G exclusively (no producer in flight), then claims once more as a new statement:
-- every producer that skipped its NOTIFY has committed by then, so that claim sees its rows.

-- One row: how producers wake the relay. 'gated' (default), 'always' (NOTIFY every
-- inserting statement), 'off' (never; the relay's fallback poll finds the rows).
CREATE TABLE @config@ (
    singleton   boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    notify_mode text    NOT NULL DEFAULT 'gated' CHECK (notify_mode IN ('gated', 'always', 'off'))
);
INSERT INTO @config@ DEFAULT VALUES;

CREATE OR REPLACE FUNCTION @schema@.@prefix@_notify() RETURNS trigger
LANGUAGE plpgsql AS $fn$
DECLARE
    mode text;
BEGIN
    SELECT c.notify_mode INTO mode FROM @config@ AS c;
    IF mode = 'off' THEN
        RETURN NULL;
    END IF;
    IF mode IS DISTINCT FROM 'always' THEN
        PERFORM pg_advisory_xact_lock_shared(@gate_key@);
        -- Probe A shared and release it in one expression: producers never block each other
        -- on A, and a statement timeout cannot land between the take and the release.
        IF NOT (CASE WHEN pg_try_advisory_lock_shared(@awake_key@)
                     THEN pg_advisory_unlock_shared(@awake_key@) ELSE false END) THEN
            RETURN NULL;  -- a relay is awake, and will re-check before it sleeps
        END IF;
    END IF;
    PERFORM pg_notify(@channel_literal@, '');
    RETURN NULL;
END
$fn$;
