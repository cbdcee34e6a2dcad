-- notify-outbox Debezium-compatible capture (`notify-outbox debezium install` applies it,
-- `notify-outbox debezium sql` prints it). Not a numbered migration: its text depends on the
-- router options (the topic pattern, the key column, the header fields), so `install` replaces
-- it whenever they change and `debezium verify` compares it with the options given.
--
-- An AFTER INSERT trigger on the table laid out for Debezium's outbox event router copies each
-- new row, in the producer's transaction, into notify-outbox's own outbox table, mapped as the
-- router maps it. A row deleted right after its insert (the usual Debezium habit) was copied
-- already; updates are ignored, as the router ignores them. Words between at-signs are replaced
-- by validated names and by expressions built from validated options.

CREATE OR REPLACE FUNCTION @function@() RETURNS trigger
LANGUAGE plpgsql AS $fn$
DECLARE
    routed text := NEW.@route_column@;
    topic  text;
BEGIN
    -- The router would fail the whole connector on these rows; here the producer's INSERT
    -- fails instead, with the reason, and nothing is ever dropped.
    IF routed IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'not_null_violation',
            MESSAGE = 'notify-outbox Debezium capture: column @route_name@ (route.by.field) is NULL '
                || 'in a new row of @source_name@; it names the topic, so it is required';
    END IF;
    topic := @topic_expr@;
    IF topic !~ '^[A-Za-z0-9._-]{1,249}$' THEN
        RAISE EXCEPTION USING ERRCODE = 'check_violation',
            MESSAGE = format('notify-outbox Debezium capture: %s %L of a new row of '
                || '@source_name@ routes to topic %L, which is not a valid Kafka topic name '
                || '(letters, digits, ".", "_", "-"; at most 249)', '@route_name@', routed, topic);
    END IF;
@null_checks@
    INSERT INTO @outbox@
        (event_id, topic, key, payload_bytes, headers, event_type, aggregate_type, aggregate_id)
    VALUES (@event_id_expr@, topic, @key_expr@, @payload_expr@,
            jsonb_build_object(@header_pairs@), @type_expr@, routed, @key_expr@);
    RETURN NULL;
END
$fn$;

DROP TRIGGER IF EXISTS notify_outbox_capture ON @source@;
CREATE TRIGGER notify_outbox_capture AFTER INSERT ON @source@
    FOR EACH ROW EXECUTE FUNCTION @function@();
