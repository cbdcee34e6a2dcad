-- notify-outbox migration 0006: a claim that starts where the queue starts, a failing key that
-- steps aside, and an awake marker that expires.
--
-- 1. The claim's low-water mark (issue 17: a held MVCC horizon).
--    Every published row leaves a dead tuple, and while any session keeps an old snapshot
--    (pg_dump, a long report, an idle transaction, a replica with hot_standby_feedback) no index
--    entry of those tuples can be removed. 0005's claim scanned its indexes from the lowest
--    pending id, so every claim walked every row published since the snapshot was taken: at
--    800 ev/s, a snapshot held for 10 minutes took p99 from 7 to 400 ms and producers to 34 % of
--    their rate, while a plain poller kept up.
--
--    Now each relay keeps a low-water mark in memory and passes it to every claim: every fresh
--    row (never tried, not held back) has an id >= `low`, or was written by one of the
--    transactions in `wait_xids` that was still running when the mark was set (with the mark of
--    that time in `wait_lows`). Scans start at the floor: `low`, lowered to the mark of any of
--    those transactions that has ended since (its rows are visible now). A claim returns the
--    next mark in a last row with a NULL id: the first fresh row it saw, or one past the last id
--    drawn when there is none, and the transactions still running at its snapshot. So a claim
--    walks only what was published since the previous claim, however long a snapshot is held.
--
--    Why it is exact: ids are drawn from the sequence, not at commit, so a row can become
--    visible below a mark (a late commit). The ordering trigger below now makes every inserting
--    transaction take its transaction id *before* it draws a row's id. A claim reads `v`, the
--    sequence's last value, then takes its own transaction id, then its snapshot. Every row with
--    an id <= v belongs to a transaction with a smaller id than the claim's, which at the
--    snapshot had ended (its rows visible, or rolled back and gone), or is running: listed in
--    the snapshot, or with an id from the snapshot's xmax up (xmax is one past the latest
--    transaction to end, and PostgreSQL lists no id above it). The next mark carries all of
--    those; rows with larger ids are above it. Every statement computes the floor with its own
--    snapshot, so a transaction that ends between two statements of one claim is seen by the
--    second. (A claim therefore always has a transaction id; an empty one rolls back.)
--    Long transactions that insert nothing cost nothing: they wait in the list, and when they
--    end the floor drops once to the mark of their start, and rises again at the next claim.
--    This needs the sequence to hand out values one at a time (CACHE 1, the default; set below):
--    a backend's cached values would be drawn after the mark passed them. A relay refuses to
--    start otherwise.
--
--    Why not the alternatives: a watermark on xmin (watermill's xid8 column read below
--    pg_snapshot_xmin) stops at the oldest running transaction of the whole cluster, so one long
--    writer anywhere would stall it, and it needs a column and an index on every row; PgQ's
--    rotated tables emptied by TRUNCATE wait behind pg_dump's lock and lose the per-row retry
--    state. The mark needs no new column, no new index and no write, and works through a
--    transaction-pooling PgBouncer (it lives in the relay and travels as parameters).
--
-- 2. A failing key steps aside (issue 17: a failing head).
--    When a key's row fails, the key's later rows must wait, and 0005 left them where they were:
--    at the head of the queue, where the claim chose its buckets. 5,000 rows of five failing
--    keys hid every healthy row behind them until the failures were dead-lettered. Now a claim
--    that meets a fresh row held back behind a failed row of its key parks it: next_attempt_at
--    = 'infinity', which moves it to the small indexes of waiting rows, out of the claim's way.
--    At most two claims at a time park (two advisory locks next to the buckets': parking is
--    the database's work, and four claims parking at once each took four times as long, with
--    the healthy rows riding in them; one alone parked 100,000 rows in 10-15 s, and a claim
--    parking 2,000 rows kept a key sharing a failing bucket waiting over a second), at most
--    `scan` / 2 rows each (1,000 by default, about 25 ms here), so a claim that parks stays
--    short. It also takes, in every bucket where it met held rows, the other keys' rows past
--    them: a healthy key whose bucket a failing key shares (hashes collide) waits for no more
--    than the next such claim. The other claims take the healthy rows of other buckets at
--    once. Measured with claims alone (4 connections, no
--    Kafka): 300 healthy rows behind 100,000 rows of five failing keys were all claimed 1.7 s
--    after their insert when claims parked 4,000 rows and read only the head of each bucket,
--    0.12 s with 1,000.
--    A failed row whose retry time came is claimed alone (it may fail again); once it is
--    published or dead-lettered, the relay promotes its key's next parked row (next_attempt_at
--    = now()). A claim takes a promoted row and the key's following waiting rows in order, as
--    one run, up to the next row that waits for a retry time, and promotes the row after the
--    run, so the rest follows in the next claim. The fallback poll promotes a parked row left
--    first of its key by anything else (a row deleted by hand, a relay of 0005). Rows are never
--    moved back to fresh, so the mark of part 1 never has to go back for them.
--
-- 3. The awake marker expires (issue 17: a stalled relay).
--    The marker of the gated notify (0002) was one lock held by an awake relay's listening
--    session: a relay frozen (SIGSTOP, a VM stall) or cut off from Kafka kept it, producers kept
--    skipping their NOTIFY, and the other relays found the rows only at their fallback poll
--    (p50 1.2 s). Now the marker is a lock on the current epoch of `awake_epoch_ms` milliseconds
--    (two-key advisory lock: awake namespace, epoch number by the database's clock). An awake
--    relay that is making progress takes the current and the next epoch once per epoch (mid-
--    epoch); a relay that stops claiming stops taking them, and producers notify again within
--    two epochs.
--    Producers probe only the current epoch, as they probed A before: still one try and one
--    release. The gate G and the sleep protocol are unchanged (the relay releases every epoch
--    lock it holds in the statement that took G).
--
-- 4. One bucket at a time, whatever the statistics say.
--    The claim reads one key bucket at a time in the bucket index's order. With the bucket
--    written as `bucket = b`, the fresh index (by id) can serve the same order, filtering on
--    the bucket: cheap only if the bucket's rows are spread evenly. An outbox is analyzed while
--    it is nearly empty (or never, when a backlog comes soon after it was created), so the
--    planner takes every index as tiny, and chose that plan: with 100,000 fresh rows of 5
--    failing keys, the look for each other bucket's first row read all of them, 256 times per
--    claim (6-8 s per claim). Each bucket is therefore written as a range of the bucket index,
--    `(bucket, id) >= (b, floor) AND bucket <= b`, which no other index returns in that order
--    without a sort, and sorts are disabled for those statements.
--
-- Upgrading: apply this migration while relays of 0005 run, then restart them one by one. The
-- claim of 0005 stays (same name, two arguments) and keeps working: claims of both kinds own
-- the same key buckets, an old claim treats a parked row as a failed one (its key waits), and
-- the fallback poll of a new relay promotes what an old one left. Old relays' awake marker is
-- no longer seen by producers, which then simply notify.

-- Producers may have to wait a moment here: the table lock makes sure every row from now on is
-- drawn by the new trigger (no transaction that drew an id the old way is still running when
-- the first relay of this version starts). It comes first: a producer in a transaction holds
-- the table and then draws from the sequence, so locking the sequence first could deadlock.
LOCK TABLE @table@ IN SHARE ROW EXCLUSIVE MODE;

-- The sequence hands out one value at a time (see 1). CACHE 1 is PostgreSQL's default, so this
-- usually changes nothing, and then it must not lock the sequence: nextval() locks it for the
-- whole transaction, so a producer that inserted inside a savepoint it rolled back (Django's
-- nested atomic blocks, SQLAlchemy's begin_nested) still holds the sequence but no longer the
-- table, and its next insert waits for the table lock above while ALTER SEQUENCE would wait for
-- it: a deadlock. Where a cache was set, the ALTER runs with a short lock_timeout, so that this
-- migration is the one that gives up (`notify-outbox migrate` tries again), never a producer.
DO $do$
DECLARE
    was text := current_setting('lock_timeout');
BEGIN
    IF (SELECT s.seqcache FROM pg_sequence AS s
        WHERE s.seqrelid = @id_seq_literal@::regclass) <> 1 THEN
        PERFORM set_config('lock_timeout', '100ms', true);
        ALTER SEQUENCE @id_seq@ CACHE 1;
        PERFORM set_config('lock_timeout', was, true);
    END IF;
END
$do$;

-- Per-key commit order (0001), and now for every row: the transaction's id before the row's.
-- A value the insert gave, or the identity default drawn before this trigger ran, is replaced.
CREATE OR REPLACE FUNCTION @schema@.@prefix@_order_key() RETURNS trigger
LANGUAGE plpgsql AS $fn$
BEGIN
    IF NEW.key IS NOT NULL THEN
        PERFORM pg_advisory_xact_lock(@lock_ns@, hashtext(NEW.key));
    END IF;
    PERFORM pg_current_xact_id();
    NEW.id := nextval(@id_seq_literal@);
    RETURN NEW;
END
$fn$;

ALTER TABLE @config@ ADD COLUMN awake_epoch_ms integer NOT NULL DEFAULT 25
    CHECK (awake_epoch_ms BETWEEN 5 AND 60000);

-- The epoch of the awake marker at this moment, by the database's clock (see 3).
CREATE FUNCTION @schema@.@prefix@_awake_epoch(epoch_ms integer) RETURNS integer
LANGUAGE sql VOLATILE AS $fn$
    SELECT (floor(date_part('epoch', clock_timestamp()) * 1000 / epoch_ms)::bigint
            % 2147483648)::integer
$fn$;

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
    PERFORM pg_notify(@channel_literal@, '');
    RETURN NULL;
END
$fn$;

-- The floor of a low-water mark at the calling statement's snapshot (see 1): `low`, or lower,
-- the mark of a transaction of `xids` that has ended since.
CREATE FUNCTION @schema@.@prefix@_floor(low bigint, xids bigint[], lows bigint[]) RETURNS bigint
LANGUAGE sql STABLE AS $fn$
    SELECT least(low, min(u.lo)) FROM unnest(xids, lows) AS u(x, lo)
    WHERE pg_visible_in_snapshot(u.x::text::xid8, pg_current_snapshot())
$fn$;

-- Whether a row of key `k` with id `i` is held back: an earlier row of the key waits (failed,
-- or parked behind one). Rows without a key never are. Written as "the first such row, in the
-- key index's order" so that every plan probes that index (with many parked rows, a plan that
-- filtered the other index of waiting rows would read them all, for every row it checks).
CREATE FUNCTION @schema@.@prefix@_held(k text, i bigint) RETURNS boolean
LANGUAGE sql STABLE AS $fn$
    SELECT (SELECT w.id FROM @table@ AS w
            WHERE w.key = k AND w.published_at IS NULL AND w.next_attempt_at IS NOT NULL
              AND w.id < i
            ORDER BY w.key, w.id LIMIT 1) IS NOT NULL
$fn$;

-- Parked rows that are first of their key: nothing will promote them (their key's earlier row
-- was deleted by hand, or published by a relay of 0005). The earliest waiting row of each key,
-- one key at a time through the key index: the cost is the keys that wait, not their rows.
CREATE FUNCTION @schema@.@prefix@_stuck() RETURNS SETOF bigint
LANGUAGE sql STABLE AS $fn$
    WITH RECURSIVE k AS (
        (SELECT w.key, w.id, w.next_attempt_at FROM @table@ AS w
         WHERE w.key IS NOT NULL AND w.published_at IS NULL AND w.next_attempt_at IS NOT NULL
         ORDER BY w.key, w.id LIMIT 1)
        UNION ALL
        SELECT n.key, n.id, n.next_attempt_at
        FROM k, LATERAL (
            SELECT w.key, w.id, w.next_attempt_at FROM @table@ AS w
            WHERE w.key > k.key AND w.published_at IS NULL AND w.next_attempt_at IS NOT NULL
            ORDER BY w.key, w.id LIMIT 1) AS n
    )
    SELECT k.id FROM k WHERE k.next_attempt_at = 'infinity'
$fn$;

-- Claims up to `batch` rows for the calling transaction (READ COMMITTED: every statement below
-- takes its own snapshot, which the protocol needs), looking at no more than `scan` fresh rows
-- from the floor to choose key buckets. Per key, the rows returned are the key's earliest
-- pending rows with no gap; the final SELECT re-reads every row under a row lock, so a row
-- published by a claim that committed meanwhile is left out. The last row has a NULL id and
-- carries the next low-water mark (see 1), whether the claim parked or promoted rows, and how
-- many buckets with fresh rows other claims held (a frozen relay's claim holds them until
-- PostgreSQL ends it: the relay looks again then, as nothing else may wake it).
CREATE FUNCTION @schema@.@prefix@_claim(batch integer, scan integer, low bigint,
                                        wait_xids bigint[], wait_lows bigint[])
RETURNS TABLE (id bigint, event_id uuid, topic text, key text, payload text, payload_bytes bytea,
               headers text, event_type text, aggregate_type text, aggregate_id text,
               attempts integer, created_at timestamptz,
               next_low bigint, next_xids bigint[], next_lows bigint[], changed boolean,
               busy integer)
-- No JIT: the scans' estimated cost covers the whole table (they stop early, the planner cannot
-- know), which would make PostgreSQL compile them at every call. No sequential scan: a queue
-- table's statistics say it is small while it is full of dead tuples, and a generic plan with
-- a sequential scan would read every one of them at every call. Generic plans: planning a
-- statement for its values looks up the column's actual extremes in the index (when a value is
-- beyond the statistics), and under a held snapshot that look-up walks every dead entry.
LANGUAGE plpgsql SET jit = off SET enable_seqscan = off SET enable_sort = on
    SET plan_cache_mode = force_generic_plan
AS $fn$
#variable_conflict use_column
DECLARE
    r record;
    b integer;
    v bigint;
    own bigint;
    changed boolean := false;
    busy integer := 0;  -- buckets other claims held
    taken bigint[] := '{}';
    run bigint[];
    run_keys text[] := '{}';
    heads integer[];
    buckets integer[];
    tried integer[] := '{}';
    held_keys text[] := '{}';
    parked integer := 0;
    parker boolean := false;  -- this claim holds the parking lock
    n integer;
    saw_held boolean := false;
    widened boolean := false;
    head_full boolean;
    any_waiting boolean;  -- some row waits (failed, parked, due): see the buckets' read
    past bigint;
    mark bigint;
    xids bigint[];
    lows bigint[];
BEGIN
    -- The last id drawn so far, then this transaction's own id, then (next statement) the
    -- snapshot: every row with an id <= v was drawn by a transaction whose id is below ours,
    -- and at the snapshot that transaction had ended, or is in its list of running ones, or
    -- its id is at or above the snapshot's xmax (PostgreSQL does not list those: xmax is one
    -- past the latest transaction to end). So the next mark carries the listed ones and every
    -- id from xmax up to ours (see 1).
    IF pg_current_xact_id_if_assigned() IS NOT NULL THEN
        RAISE EXCEPTION 'the claim must come before any write of its transaction';
    END IF;
    v := coalesce(pg_sequence_last_value(@id_seq_literal@::regclass), 0);
    own := pg_current_xact_id()::text::bigint;

    -- One snapshot: the next mark, and the buckets of the freshest rows at the head of the
    -- queue, in order of their oldest row.
    WITH s AS MATERIALIZED (SELECT pg_current_snapshot() AS snap),
    waiting AS (
        SELECT u.x, u.lo, pg_visible_in_snapshot(u.x::text::xid8, s.snap) AS ended
        FROM s, unnest(wait_xids, wait_lows) AS u(x, lo)
    ),
    head AS (
        SELECT o.id,
               CASE WHEN o.key IS NULL THEN (o.id & 255)::integer
                    ELSE hashtext(o.key) & 255 END AS b
        FROM @table@ AS o
        WHERE o.published_at IS NULL AND o.next_attempt_at IS NULL
          AND o.id >= least(low, (SELECT min(w.lo) FROM waiting AS w WHERE w.ended))
        ORDER BY o.id
        LIMIT scan
    ),
    running AS (
        SELECT w.x, w.lo FROM waiting AS w WHERE NOT w.ended
        UNION ALL
        SELECT r.x, low FROM (
            SELECT x.x::text::bigint AS x FROM s, pg_snapshot_xip(s.snap) AS x(x)
            UNION ALL
            SELECT generate_series(pg_snapshot_xmax(s.snap)::text::bigint, own - 1) FROM s
        ) AS r
        WHERE r.x <> ALL(wait_xids)
    )
    SELECT least(v + 1, (SELECT min(h.id) FROM head AS h)),
           ARRAY(SELECT ru.x FROM running AS ru ORDER BY ru.x),
           ARRAY(SELECT ru.lo FROM running AS ru ORDER BY ru.x),
           ARRAY(SELECT h.b FROM head AS h GROUP BY h.b ORDER BY min(h.id)),
           (SELECT count(*) FROM head) >= scan,
           EXISTS (SELECT 1 FROM @table@ AS w
                   WHERE w.published_at IS NULL AND w.next_attempt_at IS NOT NULL)
    INTO mark, xids, lows, heads, head_full, any_waiting;

    -- Due rows, each the earliest waiting row of its key (so each key once): a retry whose time
    -- came, or a parked row promoted. Few, and none at all where no row waits (the common case:
    -- the loop's statement is then not even started). A try on a bucket this transaction owns
    -- already succeeds (the lock is re-entrant).
    IF any_waiting THEN
        FOR r IN
            SELECT o.id, o.key, o.attempts,
                   CASE WHEN o.key IS NULL THEN (o.id & 255)::integer
                        ELSE hashtext(o.key) & 255 END AS b
            FROM @table@ AS o
            WHERE o.published_at IS NULL AND o.next_attempt_at <= now()
              AND NOT @schema@.@prefix@_held(o.key, o.id)
            ORDER BY o.id
        LOOP
            EXIT WHEN cardinality(taken) >= batch;
            CONTINUE WHEN NOT pg_try_advisory_xact_lock(@claim_ns@, r.b);
            taken := taken || r.id;
            -- A retry goes alone: it may well fail again. If it is published, the relay promotes
            -- the key's next parked row (promote_next), and the run follows.
            CONTINUE WHEN r.key IS NULL OR r.attempts > 0;
            -- The run: the key's following waiting rows in order, up to one that waits for its
            -- retry time (parked rows wait for 'infinity', promoted and due ones are <= now()).
            run := ARRAY(
                SELECT x.id FROM (
                    SELECT w.id,
                           bool_or(w.next_attempt_at > now() AND w.next_attempt_at < 'infinity')
                               OVER (ORDER BY w.id) AS stop
                    FROM @table@ AS w
                    WHERE w.key = r.key AND w.published_at IS NULL
                      AND w.next_attempt_at IS NOT NULL AND w.id > r.id
                    ORDER BY w.key, w.id  -- the key index's order
                    LIMIT batch - cardinality(taken)
                ) AS x
                WHERE NOT x.stop ORDER BY x.id);
            taken := taken || run;
            run_keys := run_keys || r.key;
            -- Promote the row after the run, if it is parked, so the rest follows next time.
            UPDATE @table@ AS o SET next_attempt_at = now()
            WHERE o.id = (SELECT w.id FROM @table@ AS w
                          WHERE w.key = r.key AND w.published_at IS NULL
                            AND w.next_attempt_at IS NOT NULL
                            AND w.id > coalesce(run[cardinality(run)], r.id)
                          ORDER BY w.key, w.id LIMIT 1)
              AND o.next_attempt_at = 'infinity';
            changed := changed OR FOUND;
        END LOOP;
    END IF;

    -- The buckets of the head first. When they hold rows held back behind a failed row of
    -- their key, and the batch is not full, every other bucket that has fresh rows, in order
    -- of its first one: a failing key at the head of the queue does not hide the others.
    buckets := heads;
    -- Every statement of this loop reads one bucket in the bucket index's order (see 4).
    PERFORM set_config('enable_sort', 'off', true);
    LOOP
        FOREACH b IN ARRAY buckets LOOP
            EXIT WHEN cardinality(taken) >= batch;
            tried := tried || b;
            IF NOT pg_try_advisory_xact_lock(@claim_ns@, b) THEN
                busy := busy + 1;
                CONTINUE;
            END IF;
            -- A new statement, so a new snapshot taken after the lock: rows the bucket's
            -- previous owner published before it committed are seen as published.
            -- Two forms of one read: with rows waiting anywhere (a failing key's, parked or due
            -- for a retry), the held-back check once per key; without, once per row, which is
            -- cheaper then (a probe of the empty index of waiting rows costs a microsecond,
            -- and the per-key form's hashing cost a 1,000-key claim 25% more). Both are exact:
            -- a row that starts waiting after the claim's first look is seen by either.
            IF any_waiting THEN
                WITH range AS MATERIALIZED (
                    SELECT o.id, o.key
                    FROM @table@ AS o
                    -- The bucket b from the floor on, as a range of the bucket index (see 4).
                    WHERE ((CASE WHEN o.key IS NULL THEN (o.id & 255)::integer
                                 ELSE hashtext(o.key) & 255 END), o.id)
                          -- outbox_floor(mark, xids, lows), written out: a SQL function with
                          -- a FROM is never inlined, and its body is planned again at every
                          -- statement.
                          >= (b, least(mark, (
                                SELECT min(u.lo) FROM unnest(xids, lows) AS u(x, lo)
                                WHERE pg_visible_in_snapshot(u.x::text::xid8,
                                                             pg_current_snapshot()))))
                      AND (CASE WHEN o.key IS NULL THEN (o.id & 255)::integer
                                ELSE hashtext(o.key) & 255 END) <= b
                      AND o.published_at IS NULL AND o.next_attempt_at IS NULL
                    -- The bucket index's own order (the bucket is fixed): whatever the
                    -- statistics say, no other index can return the rows in this order without
                    -- reading all.
                    ORDER BY (CASE WHEN o.key IS NULL THEN (o.id & 255)::integer
                                   ELSE hashtext(o.key) & 255 END), o.id
                    LIMIT batch - cardinality(taken)
                ),
                -- Each key's earliest waiting row (failed, or parked behind one): the key's
                -- rows after it are held back (outbox_held). Once per key, not per row: a
                -- failing key's bucket holds a thousand of its rows, and a probe each was half
                -- of a parking claim's time (alone: 134 ms a claim over 100,000 failing rows,
                -- 64 now).
                firsts AS MATERIALIZED (
                    SELECT k.key,
                           (SELECT w.id FROM @table@ AS w
                            WHERE w.key = k.key AND w.published_at IS NULL
                              AND w.next_attempt_at IS NOT NULL
                            ORDER BY w.key, w.id LIMIT 1) AS first_id
                    FROM (SELECT DISTINCT range.key FROM range WHERE range.key IS NOT NULL) AS k
                ),
                checked AS (
                    SELECT range.id, range.key, coalesce(f.first_id < range.id, false) AS held
                    FROM range LEFT JOIN firsts AS f ON f.key = range.key
                )
                -- One pass over the range (it holds no more rows than the batch may take).
                SELECT taken || coalesce(array_agg(c.id ORDER BY c.id) FILTER (WHERE NOT c.held),
                                         '{}'),
                       coalesce(array_agg(DISTINCT c.key)
                                    FILTER (WHERE c.held AND c.key <> ALL(run_keys)), '{}'),
                       max(c.id)
                FROM checked AS c
                INTO taken, held_keys, past;
            ELSE
                WITH range AS MATERIALIZED (
                    SELECT o.id, o.key,
                           -- outbox_held(o.key, o.id), written out: a function with a subquery
                           -- is never inlined, and calling one per row doubled the claim's cost.
                           (SELECT w.id FROM @table@ AS w
                            WHERE w.key = o.key AND w.published_at IS NULL
                              AND w.next_attempt_at IS NOT NULL AND w.id < o.id
                            ORDER BY w.key, w.id LIMIT 1) IS NOT NULL AS held
                    FROM @table@ AS o  -- the same range as above
                    WHERE ((CASE WHEN o.key IS NULL THEN (o.id & 255)::integer
                                 ELSE hashtext(o.key) & 255 END), o.id)
                          >= (b, least(mark, (
                                SELECT min(u.lo) FROM unnest(xids, lows) AS u(x, lo)
                                WHERE pg_visible_in_snapshot(u.x::text::xid8,
                                                             pg_current_snapshot()))))
                      AND (CASE WHEN o.key IS NULL THEN (o.id & 255)::integer
                                ELSE hashtext(o.key) & 255 END) <= b
                      AND o.published_at IS NULL AND o.next_attempt_at IS NULL
                    ORDER BY (CASE WHEN o.key IS NULL THEN (o.id & 255)::integer
                                   ELSE hashtext(o.key) & 255 END), o.id
                    LIMIT batch - cardinality(taken)
                )
                SELECT taken || coalesce(array_agg(range.id ORDER BY range.id)
                                             FILTER (WHERE NOT range.held), '{}'),
                       coalesce(array_agg(DISTINCT range.key)
                                    FILTER (WHERE range.held AND range.key <> ALL(run_keys)), '{}'),
                       max(range.id)
                FROM range
                INTO taken, held_keys, past;
            END IF;
            saw_held := saw_held OR cardinality(held_keys) > 0;
            CONTINUE WHEN cardinality(held_keys) = 0;
            -- Two claims at a time walk the held buckets and park (locks 256 and 257 of the
            -- claim's namespace, next to the buckets' 0-255). Both are the database's work:
            -- with four claims doing both at once each took 250-350 ms under the bench's load,
            -- and every healthy row behind the failing head rode in one of them; one alone
            -- parked too slowly (see 2). The other claims take the healthy rows of other
            -- buckets at once (the widening below), and the parkers those that share a held
            -- bucket, in their next claim.
            IF NOT parker THEN
                parker := pg_try_advisory_xact_lock(@claim_ns@, 256)
                          OR pg_try_advisory_xact_lock(@claim_ns@, 257);
            END IF;
            CONTINUE WHEN NOT parker;
            -- The bucket's rows of other keys, past the held ones: a key that shares its
            -- bucket with a failing key must not wait until every row of that key is parked
            -- (tens of thousands of rows: many claims). This walks the held keys' rows not
            -- parked yet, a chunk fewer at every claim. Per key still a gapless prefix: all of
            -- a key's rows are in this bucket, read in id order after those the range read,
            -- and a held row is followed by held rows only.
            IF cardinality(taken) < batch THEN
                taken := taken || ARRAY(
                    SELECT o.id FROM @table@ AS o
                    WHERE ((CASE WHEN o.key IS NULL THEN (o.id & 255)::integer
                                 ELSE hashtext(o.key) & 255 END), o.id) > (b, past)
                      AND (CASE WHEN o.key IS NULL THEN (o.id & 255)::integer
                                ELSE hashtext(o.key) & 255 END) <= b
                      AND o.published_at IS NULL AND o.next_attempt_at IS NULL
                      AND (o.key IS NULL OR o.key <> ALL(held_keys))
                      AND (SELECT w.id FROM @table@ AS w
                           WHERE w.key = o.key AND w.published_at IS NULL
                             AND w.next_attempt_at IS NOT NULL AND w.id < o.id
                           ORDER BY w.key, w.id LIMIT 1) IS NULL
                    ORDER BY (CASE WHEN o.key IS NULL THEN (o.id & 255)::integer
                                   ELSE hashtext(o.key) & 255 END), o.id
                    LIMIT batch - cardinality(taken));
            END IF;
            CONTINUE WHEN parked >= scan / 2;
            -- Park the held keys' fresh rows in this bucket (see 2), up to `scan` / 2 per
            -- claim, so that a claim that parks stays short (see 2).
            -- Not the rows of a key whose run this claim took: they are next once the run is
            -- published, and nothing would promote them. By primary key: the re-check is
            -- written so that no partial index's predicate matches it (a full scan of one
            -- would read every dead entry).
            -- The held keys' earliest waiting rows, once per key (as in the range above).
            WITH f AS MATERIALIZED (
                SELECT k.key,
                       (SELECT w.id FROM @table@ AS w
                        WHERE w.key = k.key AND w.published_at IS NULL
                          AND w.next_attempt_at IS NOT NULL
                        ORDER BY w.key, w.id LIMIT 1) AS first_id
                FROM unnest(held_keys) AS k(key)
            )
            UPDATE @table@ AS o SET next_attempt_at = 'infinity'
            WHERE o.id = ANY(ARRAY(
                    SELECT h.id FROM @table@ AS h
                    WHERE ((CASE WHEN h.key IS NULL THEN (h.id & 255)::integer
                                 ELSE hashtext(h.key) & 255 END), h.id)
                          >= (b, @schema@.@prefix@_floor(mark, xids, lows))
                      AND (CASE WHEN h.key IS NULL THEN (h.id & 255)::integer
                                ELSE hashtext(h.key) & 255 END) <= b
                      AND h.published_at IS NULL AND h.next_attempt_at IS NULL
                      AND h.key = ANY(held_keys)
                      AND h.id > (SELECT f.first_id FROM f WHERE f.key = h.key)
                    ORDER BY (CASE WHEN h.key IS NULL THEN (h.id & 255)::integer
                                   ELSE hashtext(h.key) & 255 END), h.id
                    LIMIT scan / 2 - parked))
              AND coalesce(o.published_at, o.next_attempt_at) IS NULL;
            GET DIAGNOSTICS n = ROW_COUNT;
            parked := parked + n;
        END LOOP;
        -- Widen when held rows were met, or when other claims held head buckets and fresh
        -- rows lie beyond the head (a claim parking a failing key's rows holds its bucket:
        -- meanwhile the others serve the rest).
        EXIT WHEN cardinality(taken) >= batch OR widened
                  OR NOT (saw_held OR (busy > 0 AND head_full));
        widened := true;
        -- Each bucket's first fresh row: one probe of the bucket index each.
        WITH f AS MATERIALIZED (SELECT @schema@.@prefix@_floor(mark, xids, lows) AS lo)
        SELECT ARRAY(
            SELECT x.b FROM generate_series(0, 255) AS x(b),
                 LATERAL (SELECT o.id FROM @table@ AS o
                          WHERE ((CASE WHEN o.key IS NULL THEN (o.id & 255)::integer
                                       ELSE hashtext(o.key) & 255 END), o.id)
                                >= (x.b, (SELECT f.lo FROM f))
                            AND (CASE WHEN o.key IS NULL THEN (o.id & 255)::integer
                                      ELSE hashtext(o.key) & 255 END) <= x.b
                            AND o.published_at IS NULL AND o.next_attempt_at IS NULL
                          ORDER BY (CASE WHEN o.key IS NULL THEN (o.id & 255)::integer
                                         ELSE hashtext(o.key) & 255 END), o.id
                          LIMIT 1) AS first
            WHERE x.b <> ALL(tried)
            ORDER BY first.id)
        INTO buckets;
    END LOOP;
    PERFORM set_config('enable_sort', 'on', true);
    changed := changed OR parked > 0;

    RETURN QUERY
        SELECT o.id, o.event_id, o.topic, o.key, o.payload::text, o.payload_bytes,
               o.headers::text, o.event_type, o.aggregate_type, o.aggregate_id, o.attempts,
               o.created_at, NULL::bigint, NULL::bigint[], NULL::bigint[], NULL::boolean,
               NULL::integer
        FROM @table@ AS o
        WHERE o.id = ANY(taken) AND o.published_at IS NULL
        ORDER BY o.id
        FOR UPDATE OF o;
    RETURN QUERY SELECT NULL::bigint, NULL::uuid, NULL::text, NULL::text, NULL::text,
                        NULL::bytea, NULL::text, NULL::text, NULL::text, NULL::text,
                        NULL::integer, NULL::timestamptz, mark, xids, lows, changed, busy;
END
$fn$;

-- Whether a claim would get something (the relay's look between claims, after a commit and at
-- the fallback poll): a fresh row at or above the floor (one held back behind a failed row
-- counts: a claim parks it), or a due row first of its key. Rows waiting for their retry time,
-- and those parked behind them, do not: they must not keep a relay awake.
CREATE FUNCTION @schema@.@prefix@_due(low bigint, xids bigint[], lows bigint[]) RETURNS boolean
LANGUAGE plpgsql STABLE SET enable_seqscan = off SET plan_cache_mode = force_generic_plan
AS $fn$
BEGIN
    -- outbox_floor and outbox_held written out: SQL functions with a FROM are never inlined,
    -- and their bodies were planned again at every look (0.2 ms a look at 1,000 ev/s).
    RETURN EXISTS (
            SELECT 1 FROM @table@ AS o
            WHERE o.published_at IS NULL AND o.next_attempt_at IS NULL
              AND o.id >= least(low, (
                    SELECT min(u.lo) FROM unnest(xids, lows) AS u(x, lo)
                    WHERE pg_visible_in_snapshot(u.x::text::xid8, pg_current_snapshot()))))
        OR EXISTS (
            SELECT 1 FROM @table@ AS o
            WHERE o.published_at IS NULL AND o.next_attempt_at <= now()
              AND (SELECT w.id FROM @table@ AS w
                   WHERE w.key = o.key AND w.published_at IS NULL
                     AND w.next_attempt_at IS NOT NULL AND w.id < o.id
                   ORDER BY w.key, w.id LIMIT 1) IS NULL);
END
$fn$;
