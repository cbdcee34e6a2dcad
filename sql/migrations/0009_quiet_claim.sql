-- notify-outbox migration 0009: the claim's quiet path (issue #31: back to the floor).
--
-- 0006's claim reads each key bucket it wins in a statement of its own, after the bucket's
-- lock, so that the read sees what the bucket's previous owner published or failed before it
-- committed. A quiet claim (a few fresh rows, no row waiting anywhere) of n rows in n buckets
-- thus ran 3 + n statements (the first look, n ranges, two settings, the rows' re-read under
-- their row locks), each paying the executor's start-up for its generic plan: at 1,000 ev/s,
-- about seven rows a claim, 550 us of the server's time a claim.
--
-- Now, when no row waits (none failed, parked or due for a retry) and the head holds fewer
-- than `scan` rows (the whole queue is in view), the claim tries the head's buckets, oldest
-- first, only until they hold a batch by the first look's count, and then reads every bucket
-- it won in one statement that also takes the row locks: the statement starts after the last
-- lock, so the property above holds for every bucket at once. Each key's rows are still a
-- gapless prefix (a bucket read in id order from the floor, held-back rows left out: they
-- follow a key's waiting row and are followed by held rows only). When a row starts waiting
-- between the first look and the read, the held-back check leaves its key's later rows out;
-- such a claim does not park or widen (the next one, seeing a waiting row, takes the full
-- path). The next mark
-- and the count of buckets other claims held are returned as before; "changed" is false (the
-- quiet path writes nothing). Everything else is 0006's claim unchanged, its numbered
-- references ("see 4") to 0006's header.
--
-- Measured (scripts/claim_cost.py, one row or four of distinct keys every 10 ms, variants
-- alternating, medians of 4 rounds): the quiet claim's round trip 0.51 against 0.57 ms for one
-- row, 0.62 against 0.73 for four. A relay at 1,000 ev/s from 8 writers (/proc and
-- pg_stat_statements over 15 s, two runs each): the claim's execution 408 and 380 us a call
-- against 556 and 569, the relay's database sessions 177 and 167 us of CPU per event against
-- 191 and 195.
CREATE OR REPLACE FUNCTION @schema@.@prefix@_claim(batch integer, scan integer, low bigint,
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
    counts integer[];  -- the head's rows in each of its buckets
    won integer[] := '{}';  -- the quiet path's buckets
    i integer;
    buckets integer[];
    tried integer[] := '{}';
    held_keys text[] := '{}';
    parked integer := 0;
    parker boolean := false;  -- this claim holds the parking lock
    n integer := 0;
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
           ARRAY(SELECT count(*)::integer FROM head AS h GROUP BY h.b ORDER BY min(h.id)),
           (SELECT count(*) FROM head) >= scan,
           EXISTS (SELECT 1 FROM @table@ AS w
                   WHERE w.published_at IS NULL AND w.next_attempt_at IS NOT NULL)
    INTO mark, xids, lows, heads, counts, head_full, any_waiting;

    -- The quiet path (see the header): no row waits anywhere, and the head holds the whole
    -- queue. Its buckets are tried oldest first, until they hold a batch, then read in one
    -- statement begun after the last lock.
    IF NOT any_waiting AND NOT head_full THEN
        FOR i IN 1 .. coalesce(cardinality(heads), 0) LOOP
            EXIT WHEN n >= batch;
            IF pg_try_advisory_xact_lock(@claim_ns@, heads[i]) THEN
                won := won || heads[i];
                n := n + counts[i];
            ELSE
                busy := busy + 1;
            END IF;
        END LOOP;
        -- Each bucket as a range of the bucket index, whatever the statistics say (see 4).
        PERFORM set_config('enable_sort', 'off', true);
        RETURN QUERY
            SELECT o.id, o.event_id, o.topic, o.key, o.payload::text, o.payload_bytes,
                   o.headers::text, o.event_type, o.aggregate_type, o.aggregate_id, o.attempts,
                   o.created_at, NULL::bigint, NULL::bigint[], NULL::bigint[], NULL::boolean,
                   NULL::integer
            FROM @table@ AS o
            WHERE o.id = ANY(ARRAY(
                    SELECT r.id
                    FROM unnest(won) AS w(b),
                         -- Each bucket won from the floor on, as in the loop below.
                         LATERAL (
                            SELECT x.id,
                                   (SELECT h.id FROM @table@ AS h
                                    WHERE h.key = x.key AND h.published_at IS NULL
                                      AND h.next_attempt_at IS NOT NULL AND h.id < x.id
                                    ORDER BY h.key, h.id LIMIT 1) IS NOT NULL AS held
                            FROM @table@ AS x
                            WHERE ((CASE WHEN x.key IS NULL THEN (x.id & 255)::integer
                                         ELSE hashtext(x.key) & 255 END), x.id)
                                  >= (w.b, least(mark, (
                                        SELECT min(u.lo) FROM unnest(xids, lows) AS u(x, lo)
                                        WHERE pg_visible_in_snapshot(u.x::text::xid8,
                                                                     pg_current_snapshot()))))
                              AND (CASE WHEN x.key IS NULL THEN (x.id & 255)::integer
                                        ELSE hashtext(x.key) & 255 END) <= w.b
                              AND x.published_at IS NULL AND x.next_attempt_at IS NULL
                            ORDER BY (CASE WHEN x.key IS NULL THEN (x.id & 255)::integer
                                           ELSE hashtext(x.key) & 255 END), x.id
                            LIMIT batch) AS r
                    WHERE NOT r.held
                    ORDER BY r.id LIMIT batch))
              AND o.published_at IS NULL
            ORDER BY o.id
            FOR UPDATE OF o;
        RETURN QUERY SELECT NULL::bigint, NULL::uuid, NULL::text, NULL::text, NULL::text,
                            NULL::bytea, NULL::text, NULL::text, NULL::text, NULL::text,
                            NULL::integer, NULL::timestamptz, mark, xids, lows, false, busy;
        RETURN;
    END IF;


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
