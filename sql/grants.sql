-- Least-privilege roles for notify-outbox (print them rendered with
-- `python -m notify_outbox sql --grants --relay-role R --app-role A`).
-- The migrations run as the owner of the schema; neither role below can change the schema.

-- The relay: claims (SELECT ... FOR UPDATE needs UPDATE), marks or deletes published rows,
-- dead-letters failed ones, and re-queues dead letters on request. LISTEN needs no grant.
-- Relays end each other's frozen claims (notify_outbox/pulse.py), which works between sessions
-- of one role: run every relay as this role (with a role per relay, grant them
-- pg_read_all_stats and pg_signal_backend, or frozen claims wait for claim_idle_timeout).
GRANT USAGE ON SCHEMA @schema@ TO @relay_role@;
GRANT SELECT, INSERT, UPDATE, DELETE ON @table@ TO @relay_role@;
GRANT SELECT, INSERT, DELETE ON @dead_letter@ TO @relay_role@;
GRANT USAGE ON SEQUENCE @id_seq@ TO @relay_role@;
GRANT SELECT ON @config@ TO @relay_role@;

-- The application: only inserts events. The triggers run as the inserting role, so it also
-- draws ids from the sequence and reads the notify mode. No SELECT on the outbox: it cannot
-- read other services' events.
GRANT USAGE ON SCHEMA @schema@ TO @app_role@;
GRANT INSERT ON @table@ TO @app_role@;
GRANT USAGE ON SEQUENCE @id_seq@ TO @app_role@;
GRANT SELECT ON @config@ TO @app_role@;
