-- Every runtime statement of the queue, one named block each. jobqueue.py loads
-- this file once; a method there carries the name of the block it runs.
-- Each state transition names the state it expects, so a late writer changes
-- nothing. Time is always the database's statement_timestamp().

-- name: enqueue_one
-- One order's job, inside the caller's (order) transaction: the statement
-- `receipts.enqueue()` sends. A plain single-row insert, so the checkout pays
-- for the row and its three index entries (primary key, order_id, ready) and
-- little else: the id is a UUIDv7 made by the client (its clock's
-- milliseconds, then random bits: time-ordered ids go to the right edge of
-- the primary key), and an order that already has a job is a no-op (ON
-- CONFLICT: the unique order_id index is the arbiter; a concurrent enqueue of
-- the same order waits for the first transaction and then does nothing).
-- Returns the new id, or no row. No notification (see enqueue below). Cost:
-- bench/README.md, "Checkout".
INSERT INTO {schema}.receipt_jobs (id, order_id, run_at)
VALUES (%(id)s, %(order_id)s, coalesce(%(run_at)s::timestamptz, now()))
ON CONFLICT (order_id) DO NOTHING
RETURNING id;

-- name: enqueue_one_traced
-- enqueue_one, also storing the enqueuing span's W3C traceparent (migration
-- 0004); used only while a trace is active. Identical otherwise (tests/unit checks).
INSERT INTO {schema}.receipt_jobs (id, order_id, run_at, traceparent)
VALUES (%(id)s, %(order_id)s, coalesce(%(run_at)s::timestamptz, now()), %(traceparent)s)
ON CONFLICT (order_id) DO NOTHING
RETURNING id;

-- name: enqueue
-- Runs inside the caller's (order) transaction, for many orders in one
-- statement (`enqueue_many`). The order ids arrive as ONE text, joined by
-- U+001F (chr(31): a control character, which no valid order id contains) and
-- split here; n is
-- each id's 1-based position (the two set-returning functions of the subquery
-- run in lockstep, and stream: unnest(...) WITH ORDINALITY in FROM would copy
-- all rows into a tuplestore first). The LIMIT changes no result (count is the
-- number of ids); it keeps the generic plan's estimate at 100 rows so that a
-- prepared `enqueue` called in a loop reuses its plan instead of replanning
-- each call. An order that already has a job, or that is repeated in the call,
-- is a no-op (ON CONFLICT DO NOTHING). Returns one row: the new jobs' ids in
-- ascending order (NULL when none is new) and the statement's random start.
-- Job ids are UUIDv7 (RFC 9562 §6.2, method 2: one random start per statement,
-- incremented per row; its top bit is 0, the RFC's guard against rollover, so
-- start + n never carries into the variant bits): time-ordered ids go to the
-- right edge of the primary key instead of scattering over it, and one strong
-- random number is drawn per statement, not per row (gen_random_uuid() and
-- PostgreSQL 18's uuidv7() draw one per row: +0.4–0.5 s per 100,000 ids on
-- the 2-core bench machine, against ≈ 0.06 s for this text-built id; random v4
-- ids also made enqueue_many of 100,000 jobs ~40 % slower there). The low 62
-- bits of an id are start + n, so the client places every new id at its
-- position without the order id coming back (receipts.enqueue._aligned).
-- No notification: a transaction that has called pg_notify takes one lock for
-- the whole instance at commit and holds it through its WAL flush, which would
-- serialise every enqueuing checkout (docs/design.md, "The checkout's commit
-- path"). The fleet's waker wakes the workers (waker_probe).
-- Cost (python -m bench.enqueue --runs 7: 100,000 new ids, durable embedded
-- PostgreSQL 18, this 2-core VM at load 0.8–1.5, three sessions interleaved
-- with the previous statement): median 1.66 s (1.18–1.91) against 1.92 s
-- (1.48–2.28) for the text[] parameter with both arrays returned. Of the 1.66 s
-- the server's execution is ≈ 1.3–1.45 s, nearly all of it the insert itself:
-- backend CPU ≈ 0.39 s for heap + WAL without any index, ≈ 0.68 s more for
-- the primary key, order_id and ready indexes, ≈ 0.27 s more for ON CONFLICT's
-- speculative insertion (an arbiter probe, a lock and a confirm record per
-- row); 501,000 WAL records, 41 MB. The client's part is ≈ 0.12 s (checks
-- 0.02, loading 100,000 UUIDs 0.08).
WITH seed AS MATERIALIZED (
  SELECT lpad(to_hex((extract(epoch FROM clock_timestamp()) * 1000)::int8), 12, '0')
         || '7' || substr(r, 1, 3) AS head,
         ('x' || substr(r, 4, 9) || substr(r, 18, 7))::bit(64)::int8
           & 2305843009213693951 AS start
  FROM (SELECT replace(gen_random_uuid()::text, '-', '') AS r) AS g
), new AS (
  INSERT INTO {schema}.receipt_jobs (id, order_id, run_at)
  SELECT (s.head || to_hex((s.start + o.n) | -9223372036854775808))::uuid,
         o.order_id, coalesce(%(run_at)s::timestamptz, now())
  FROM seed AS s,
       (SELECT unnest(string_to_array(%(order_ids)s::text, chr(31))) AS order_id,
               generate_series(1, %(count)s::int8) AS n
        LIMIT %(count)s) AS o
  ON CONFLICT (order_id) DO NOTHING
  RETURNING id
)
SELECT array_agg(new.id ORDER BY new.id), (SELECT start FROM seed)
FROM new;

-- name: enqueue_traced
-- enqueue, also storing the enqueuing span's W3C traceparent (migration 0004).
-- Used only while a trace is active, so enqueue works on a schema without the
-- column. Identical to enqueue otherwise (tests/unit checks).
WITH seed AS MATERIALIZED (
  SELECT lpad(to_hex((extract(epoch FROM clock_timestamp()) * 1000)::int8), 12, '0')
         || '7' || substr(r, 1, 3) AS head,
         ('x' || substr(r, 4, 9) || substr(r, 18, 7))::bit(64)::int8
           & 2305843009213693951 AS start
  FROM (SELECT replace(gen_random_uuid()::text, '-', '') AS r) AS g
), new AS (
  INSERT INTO {schema}.receipt_jobs (id, order_id, run_at, traceparent)
  SELECT (s.head || to_hex((s.start + o.n) | -9223372036854775808))::uuid,
         o.order_id, coalesce(%(run_at)s::timestamptz, now()), %(traceparent)s
  FROM seed AS s,
       (SELECT unnest(string_to_array(%(order_ids)s::text, chr(31))) AS order_id,
               generate_series(1, %(count)s::int8) AS n
        LIMIT %(count)s) AS o
  ON CONFLICT (order_id) DO NOTHING
  RETURNING id
)
SELECT array_agg(new.id ORDER BY new.id), (SELECT start FROM seed)
FROM new;

-- name: waker_lock
-- Wake-ups (receipts/waker.py): try to become the fleet's waker. A session
-- advisory lock on %(key)s (one per queue schema), taken on the pod's
-- dedicated LISTEN session and held until that session ends: a killed pod or
-- a dropped connection frees it. The winner's session also gets
-- idle_session_timeout (PostgreSQL 14+): a waker queries every few tens of
-- milliseconds, so a session idle that long belongs to a waker that stopped
-- (a frozen process, a partition), and the server ends it.
SELECT won,
       CASE WHEN won AND current_setting('server_version_num')::int >= 140000
            THEN set_config('idle_session_timeout', %(idle_timeout_ms)s, false) END
FROM (SELECT pg_try_advisory_lock(%(key)s) AS won) AS attempt;

-- name: waker_probe
-- The elected waker's look at the queue, every few tens of milliseconds: the
-- newest due, claimable ready job (the tail of the due part of the ready
-- index, read backwards from now: one index probe however long the queue).
-- When it differs from the tail the previous probe saw (%(seen_run_at)s,
-- %(seen_id)s), new due work has appeared (a job committed, or a scheduled or
-- retried one became due) and this statement notifies %(channel)s
-- (receipts_ready) from its own short transaction, never an order's: every
-- listening pod wakes, released 0.2.0 workers included. A tail that stays (a
-- backlog being worked, a paused fleet) wakes nobody again; a paused fleet
-- (the claim's pause rule) is not woken at all, its pods sleep until the
-- pause ends. %(heartbeat)s also notifies the waker channel with the schema
-- as payload, so the other pods know a waker is alive. Returns the tail
-- (NULLs when nothing is due) and whether it woke the fleet.
WITH tail AS (
  SELECT run_at, id
  FROM {schema}.receipt_jobs
  WHERE state = 'ready'
    AND run_at <= statement_timestamp()
    AND attempts < %(max_attempts)s
  ORDER BY run_at DESC, id DESC
  LIMIT 1
), decided AS (
  SELECT t.run_at, t.id,
         t.id IS NOT NULL
         AND (t.run_at, t.id) IS DISTINCT FROM (%(seen_run_at)s::timestamptz, %(seen_id)s::uuid)
         AND NOT EXISTS (
           SELECT 1 FROM {schema}.receipt_flow
           WHERE id = 1 AND pause_reason IS NOT NULL
             AND NOT (pause_reason = 'retry_after' AND paused_until <= statement_timestamp())
         ) AS wake
  FROM (SELECT 1) AS one LEFT JOIN tail AS t ON true
)
SELECT run_at, id, wake,
       CASE WHEN wake THEN pg_notify(%(channel)s, '') END,
       CASE WHEN %(heartbeat)s THEN pg_notify(%(waker_channel)s, %(schema_name)s) END
FROM decided;

-- name: waker_step_down
-- A waker that stops cleanly: release the lock (at once) and say so (the
-- notification is delivered at this statement's commit), so another pod
-- takes over without waiting for the heartbeat to fall silent.
SELECT pg_advisory_unlock(%(key)s), pg_notify(%(waker_channel)s, %(payload)s);

-- name: listen_check
-- A LISTEN session that has heard nothing for a while: one round trip, so a
-- half-open connection is found.
SELECT 1;

-- name: claim
-- {limit} is a literal per batch size: a bind parameter there lets a prepared
-- generic plan fall to a seq scan + hash join (docs/design.md §10).
-- SKIP LOCKED must be inside the CTE to lock the candidate rows.
-- While the fleet-wide provider pause is set nothing is claimed, except by the
-- one probe (%(probe)s) that won begin_probe. The pause check is one
-- primary-key read of a one-row table, run once per statement (an InitPlan).
-- Every row returned carries the flow state; with no job claimed one row
-- comes back whose job columns are NULL.
WITH flow AS (
  -- A Retry-After pause ends by itself when its time is up (the provider said
  -- when); an outage or auth pause ends only when a probe is answered.
  SELECT CASE WHEN pause_reason = 'retry_after' AND paused_until <= statement_timestamp()
              THEN NULL ELSE pause_reason END AS pause_reason,
         extract(epoch FROM paused_until - statement_timestamp())::float8 AS pause_left
  FROM {schema}.receipt_flow WHERE id = 1
), candidate AS (
  SELECT id
  FROM {schema}.receipt_jobs
  WHERE state = 'ready'
    AND run_at <= statement_timestamp()
    AND attempts < %(max_attempts)s
    AND (%(probe)s OR NOT EXISTS (SELECT 1 FROM flow WHERE pause_reason IS NOT NULL))
  ORDER BY run_at, id
  FOR UPDATE SKIP LOCKED
  LIMIT {limit}
), claimed AS (
  UPDATE {schema}.receipt_jobs AS j
  SET state = 'running',
      attempts = j.attempts + 1,
      lease_token = gen_random_uuid(),
      lease_until = statement_timestamp() + make_interval(secs => %(lease_seconds)s)
  FROM candidate AS c
  WHERE j.id = c.id
  RETURNING j.id, j.order_id, j.lease_token, j.attempts, j.created_at, j.traceparent
)
SELECT c.id, c.order_id, c.lease_token, c.attempts, c.created_at,
       f.pause_reason, f.pause_left, NULL::float8 AS tokens, c.traceparent
FROM flow AS f LEFT JOIN claimed AS c ON true;

-- name: claim_limited
-- The claim under the fleet-wide rate limit: the token bucket row is locked,
-- refilled by rate x elapsed (capped at the burst), and charged exactly one
-- token per job this statement returns, in the same transaction: never a
-- token for an unclaimed job, never a job without a token. At most
-- floor(tokens) of the locked candidates are claimed; the others stay ready.
WITH flow AS MATERIALIZED (
  SELECT CASE WHEN pause_reason = 'retry_after' AND paused_until <= statement_timestamp()
              THEN NULL ELSE pause_reason END AS pause_reason,
         extract(epoch FROM paused_until - statement_timestamp())::float8 AS pause_left,
         least(%(burst)s::float8, tokens + %(rate)s::float8
               * extract(epoch FROM statement_timestamp() - tokens_at)::float8) AS tokens
  FROM {schema}.receipt_flow WHERE id = 1
  FOR UPDATE
), candidate AS (
  SELECT id, run_at
  FROM {schema}.receipt_jobs
  WHERE state = 'ready'
    AND run_at <= statement_timestamp()
    AND attempts < %(max_attempts)s
    AND (%(probe)s OR NOT EXISTS (SELECT 1 FROM flow WHERE pause_reason IS NOT NULL))
  ORDER BY run_at, id
  FOR UPDATE SKIP LOCKED
  LIMIT {limit}
), allowed AS (
  SELECT id FROM candidate ORDER BY run_at, id
  LIMIT (SELECT greatest(floor(tokens), 0)::int FROM flow)
), claimed AS (
  UPDATE {schema}.receipt_jobs AS j
  SET state = 'running',
      attempts = j.attempts + 1,
      lease_token = gen_random_uuid(),
      lease_until = statement_timestamp() + make_interval(secs => %(lease_seconds)s)
  FROM allowed AS a
  WHERE j.id = a.id
  RETURNING j.id, j.order_id, j.lease_token, j.attempts, j.created_at, j.traceparent
), spent AS (
  UPDATE {schema}.receipt_flow
  SET tokens = (SELECT tokens FROM flow) - (SELECT count(*) FROM claimed),
      tokens_at = statement_timestamp()
  WHERE id = 1
  RETURNING tokens
)
SELECT c.id, c.order_id, c.lease_token, c.attempts, c.created_at,
       f.pause_reason, f.pause_left, s.tokens, c.traceparent
FROM flow AS f CROSS JOIN spent AS s LEFT JOIN claimed AS c ON true;

-- name: ack
-- Many (id, token) pairs in one statement. The guard is id + token + unexpired
-- lease: the CHECK constraint makes a matching non-null token imply 'running',
-- and leaving state out keeps the planner on the primary key (docs/design.md §10).
-- The ids and the tokens arrive as two texts of comma-separated hex UUIDs,
-- not as uuid[] parameters: psycopg dumps a list element by element in
-- Python, which cost the worker ~4 µs per acked job (an ack of 100: ~1.1 ms
-- of client CPU against ~0.7 ms joined; bench/README.md).
UPDATE {schema}.receipt_jobs AS j
SET state = 'done',
    lease_token = NULL,
    lease_until = NULL,
    last_token = a.token,
    finished_at = statement_timestamp()
FROM unnest(string_to_array(%(ids)s::text, ',')::uuid[],
            string_to_array(%(tokens)s::text, ',')::uuid[]) AS a(id, token)
WHERE j.id = a.id
  AND j.lease_token = a.token
  AND j.lease_until > statement_timestamp()
RETURNING j.id;

-- name: reschedule
-- Failed attempts (known failures and unknown outcomes) in one statement,
-- each guarded like ack. A row becomes ready again after its delay, or failed
-- when its failure is permanent or its attempts are used up: never a ready
-- row with attempts >= max. An attempt is given back (attempts - 1) when
-- `refund` is set (the provider was in a fleet-wide outage) or when the
-- provider answered 409 "in progress" and the job's in_progress_count is
-- still under %(max_in_progress)s.
WITH r AS (
  -- Read under our own lease: while the token matches, no other writer
  -- changes attempts or in_progress_count, so these values are the row's.
  SELECT r.id, r.token, r.delay, r.error, r.in_progress, b.back,
         r.permanent OR j.attempts - b.back >= %(max_attempts)s AS final
  FROM unnest(%(ids)s::uuid[], %(tokens)s::uuid[], %(delays)s::float8[], %(errors)s::text[],
              %(permanent)s::bool[], %(refund)s::bool[], %(in_progress)s::bool[])
         AS r(id, token, delay, error, permanent, refund, in_progress)
  JOIN {schema}.receipt_jobs AS j ON j.id = r.id
  CROSS JOIN LATERAL (
    SELECT (NOT r.permanent AND (r.refund OR (r.in_progress
            AND j.in_progress_count < %(max_in_progress)s)))::int AS back
  ) AS b
)
UPDATE {schema}.receipt_jobs AS j
SET state = CASE WHEN r.final THEN 'failed' ELSE 'ready' END,
    attempts = j.attempts - r.back,
    in_progress_count = j.in_progress_count + r.in_progress::int,
    run_at = CASE WHEN r.final THEN j.run_at
                  ELSE statement_timestamp() + make_interval(secs => r.delay) END,
    finished_at = CASE WHEN r.final THEN statement_timestamp() END,
    lease_token = NULL,
    lease_until = NULL,
    last_token = r.token,
    last_error = r.error
FROM r
WHERE j.id = r.id
  AND j.lease_token = r.token
  AND j.lease_until > statement_timestamp()
RETURNING j.id, j.state;

-- name: resolve_writes
-- After a write whose answer was lost (the connection broke around its
-- commit): which of these attempts' outcomes are in place? An ack or a
-- reschedule records its token as last_token in the same statement, so a row
-- carrying our token was written by us; any other row was not.
-- The pairs arrive as the ack's do (two texts of comma-separated hex UUIDs).
SELECT j.id, j.state
FROM {schema}.receipt_jobs AS j
JOIN unnest(string_to_array(%(ids)s::text, ',')::uuid[],
            string_to_array(%(tokens)s::text, ',')::uuid[]) AS a(id, token) ON j.id = a.id
WHERE j.last_token = a.token;

-- name: extend_pause
-- Pause every pod's claims for at least %(seconds)s from now because of
-- %(reason)s. Never shortens a pause: the later end wins, and with it its
-- reason; pause_seconds (the length a failed probe doubles) only grows. A
-- probe in flight loses its claim to resume: the provider failed again.
UPDATE {schema}.receipt_flow
SET pause_reason = CASE
      WHEN paused_until IS NULL
        OR statement_timestamp() + make_interval(secs => %(seconds)s) > paused_until
      THEN %(reason)s ELSE pause_reason END,
    paused_until = greatest(paused_until,
                            statement_timestamp() + make_interval(secs => %(seconds)s)),
    pause_seconds = greatest(pause_seconds, %(seconds)s),
    probe_until = NULL
WHERE id = 1
RETURNING pause_reason, extract(epoch FROM paused_until - statement_timestamp())::float8,
          pause_seconds;

-- name: begin_probe
-- An outage or auth pause has run out: exactly one pod wins the right to
-- claim one probe job (the row lock serialises contenders, and a loser re-checks the WHERE
-- against the winner's probe_until). If the winner dies, another pod may
-- probe once %(guard_seconds)s have passed.
UPDATE {schema}.receipt_flow
SET probe_until = statement_timestamp() + make_interval(secs => %(guard_seconds)s)
WHERE id = 1
  AND pause_reason IN ('outage', 'auth')
  AND paused_until <= statement_timestamp()
  AND (probe_until IS NULL OR probe_until <= statement_timestamp())
RETURNING pause_reason, probe_until, pause_seconds;

-- name: resume
-- The provider answered the probe properly: end the pause, unless another pod
-- has extended it since (paused_until moved into the future, or the probe
-- was taken over after its guard ran out).
UPDATE {schema}.receipt_flow
SET pause_reason = NULL, paused_until = NULL, pause_seconds = 0, probe_until = NULL
WHERE id = 1
  AND pause_reason IS NOT NULL
  AND probe_until = %(probe_until)s
  AND paused_until <= statement_timestamp()
RETURNING 1;

-- name: flow_state
-- The fleet-wide provider state, for gauges and review.
SELECT pause_reason,
       greatest(extract(epoch FROM paused_until - statement_timestamp())::float8, 0),
       pause_seconds,
       least(%(burst)s::float8, tokens + %(rate)s::float8
             * extract(epoch FROM statement_timestamp() - tokens_at)::float8)
FROM {schema}.receipt_flow WHERE id = 1;

-- name: recover_expired
-- One bounded batch of abandoned attempts; the caller commits each batch.
-- Each returned row also gets a `lease_expired` record in its attempt history
-- (the ring of record_attempts; worker = this session's application_name;
-- no status or duration: nobody saw the attempt end).
WITH expired AS (
  SELECT id
  FROM {schema}.receipt_jobs
  WHERE state = 'running'
    AND lease_until <= statement_timestamp()
  ORDER BY lease_until, id
  FOR UPDATE SKIP LOCKED
  LIMIT %(batch)s
), moved AS (
  UPDATE {schema}.receipt_jobs AS j
  SET state = CASE WHEN j.attempts >= %(max_attempts)s THEN 'failed' ELSE 'ready' END,
      run_at = statement_timestamp()
               + make_interval(secs => %(delay_seconds)s * (0.5 + random() / 2)),
      finished_at = CASE WHEN j.attempts >= %(max_attempts)s THEN statement_timestamp() END,
      lease_token = NULL,
      lease_until = NULL,
      last_error = 'lease expired'
  FROM expired AS e
  WHERE j.id = e.id
  RETURNING j.id, j.state, j.attempts
), recorded AS (
  INSERT INTO {schema}.receipt_attempts AS h (job_id, slot, seq, attempt, reason, error, worker)
  SELECT m.id, mod(s.seq - 1, 20), s.seq, m.attempts, 'lease_expired', 'lease expired',
         left(current_setting('application_name'), 100)
  FROM moved AS m
  CROSS JOIN LATERAL (
    SELECT coalesce(max(p.seq), 0) + 1 AS seq
    FROM {schema}.receipt_attempts AS p WHERE p.job_id = m.id
  ) AS s
  ON CONFLICT (job_id, slot) DO UPDATE
  SET seq = excluded.seq, attempt = excluded.attempt, at = excluded.at,
      reason = excluded.reason, status = NULL, error = excluded.error,
      duration_seconds = NULL, worker = excluded.worker
  WHERE h.seq < excluded.seq
)
SELECT state FROM moved;

-- name: fail_exhausted
-- Ready rows that can never be claimed (max attempts was lowered): fail them
-- so that none waits forever.
WITH exhausted AS (
  SELECT id
  FROM {schema}.receipt_jobs
  WHERE state = 'ready' AND attempts >= %(max_attempts)s
  ORDER BY run_at, id
  FOR UPDATE SKIP LOCKED
  LIMIT %(batch)s
)
UPDATE {schema}.receipt_jobs AS j
SET state = 'failed',
    finished_at = statement_timestamp(),
    last_error = coalesce(j.last_error || '; ', '') || 'attempts exhausted (max lowered)'
FROM exhausted AS e
WHERE j.id = e.id
RETURNING j.id;

-- name: prune
-- One bounded batch of finished rows older than the retention window: up to
-- %(batch)s done/failed rows and up to %(batch)s discarded rows (each kind
-- through its own partial index), with their attempt histories.
WITH old AS (
  SELECT id
  FROM {schema}.receipt_jobs
  WHERE state IN ('done', 'failed')
    AND finished_at < statement_timestamp() - make_interval(secs => %(retention_seconds)s)
  ORDER BY finished_at, id
  FOR UPDATE SKIP LOCKED
  LIMIT %(batch)s
), old_discarded AS (
  SELECT id
  FROM {schema}.receipt_jobs
  WHERE state = 'discarded'
    AND finished_at < statement_timestamp() - make_interval(secs => %(retention_seconds)s)
  ORDER BY finished_at, id
  FOR UPDATE SKIP LOCKED
  LIMIT %(batch)s
), deleted AS (
  DELETE FROM {schema}.receipt_jobs AS j
  USING (SELECT id FROM old UNION ALL SELECT id FROM old_discarded) AS o
  WHERE j.id = o.id
  RETURNING j.id
), history AS (
  DELETE FROM {schema}.receipt_attempts AS h
  USING deleted AS d
  WHERE h.job_id = d.id
)
SELECT id FROM deleted;

-- name: retry_failed
-- Operator retry: failed -> ready, attempts reset, due now; %(ids)s NULL means
-- every failed job. last_error is kept (prefixed) so why it failed survives
-- until the next attempt writes its own.
UPDATE {schema}.receipt_jobs
SET state = 'ready',
    attempts = 0,
    run_at = statement_timestamp(),
    finished_at = NULL,
    last_error = 'manual retry after: ' || coalesce(last_error, 'unknown')
WHERE state = 'failed'
  AND (%(ids)s::uuid[] IS NULL OR id = ANY(%(ids)s::uuid[]))
RETURNING id;

-- name: queue_stats
-- The gauges, in one statement that walks each small partial index once
-- (MATERIALIZED: a CTE referenced twice must not be re-run per reference), so
-- it stays cheap with millions of done rows; done is an estimate from the
-- table statistics (live rows minus the other states), never a count. The
-- oldest transaction is this database's: only its sessions hold back the
-- cleanup of receipt_jobs (docs/design.md §10). The oldest undelivered job is
-- counted from created_at, which no retry moves (run_at does): reading it costs
-- a heap visit per ready row (100,000 due ready rows: 48 ms instead of 36,
-- 2,700 buffers instead of 500), nothing when the queue is drained.
WITH ready AS MATERIALIZED (
  SELECT count(*) AS ready,
         count(*) FILTER (WHERE run_at <= statement_timestamp()) AS ready_due,
         min(run_at) FILTER (WHERE run_at <= statement_timestamp()) AS oldest_due,
         min(created_at) AS oldest_created
  FROM {schema}.receipt_jobs WHERE state = 'ready'
), running AS MATERIALIZED (
  SELECT count(*) AS running,
         count(*) FILTER (WHERE lease_until <= statement_timestamp()) AS expired,
         min(created_at) AS oldest_created
  FROM {schema}.receipt_jobs WHERE state = 'running'
), failed AS MATERIALIZED (
  SELECT count(*) AS failed FROM {schema}.receipt_jobs WHERE state = 'failed'
), discarded AS MATERIALIZED (
  SELECT count(*) AS discarded FROM {schema}.receipt_jobs WHERE state = 'discarded'
)
SELECT
  r.ready_due, r.ready, n.running, n.expired, f.failed,
  coalesce(extract(epoch FROM statement_timestamp() - r.oldest_due), 0) AS lag_seconds,
  greatest(pg_stat_get_live_tuples('{schema}.receipt_jobs'::regclass) - r.ready - n.running - f.failed
           - d.discarded, 0) AS done_estimate,
  pg_stat_get_dead_tuples('{schema}.receipt_jobs'::regclass) AS dead_tuples,
  greatest(
    (SELECT coalesce(extract(epoch FROM statement_timestamp() - min(xact_start)), 0)
       FROM pg_stat_activity
       WHERE xact_start IS NOT NULL AND backend_type = 'client backend'
         AND datname = current_database() AND pid <> pg_backend_pid()),
    (SELECT coalesce(extract(epoch FROM statement_timestamp() - min(prepared)), 0)
       FROM pg_prepared_xacts WHERE database = current_database())
  ) AS oldest_transaction_age_seconds,
  coalesce(extract(epoch FROM statement_timestamp()
                   - least(r.oldest_created, n.oldest_created)), 0) AS oldest_undelivered_seconds,
  d.discarded,
  -- Who holds the xmin horizon back, in transaction IDs (a replication slot has
  -- no start time): open transactions, forgotten prepared transactions, and
  -- replication slots (a physical slot, database NULL, holds every database).
  (SELECT coalesce(max(age(backend_xmin)), 0) FROM pg_stat_activity
     WHERE backend_xmin IS NOT NULL AND datname = current_database()
       AND pid <> pg_backend_pid()) AS xmin_transaction,
  (SELECT coalesce(max(age(transaction)), 0) FROM pg_prepared_xacts
     WHERE database = current_database()) AS xmin_prepared,
  (SELECT coalesce(max(greatest(age(xmin), age(catalog_xmin))), 0) FROM pg_replication_slots
     WHERE database = current_database() OR database IS NULL) AS xmin_replication_slot
FROM ready AS r, running AS n, failed AS f, discarded AS d;

-- name: state_counts
-- Exact rows by state, for `receipts jobs stats` (an operator command; it
-- counts every done row).
SELECT state, count(*) FROM {schema}.receipt_jobs GROUP BY state;

-- name: oldest_failed
SELECT min(finished_at) FROM {schema}.receipt_jobs WHERE state = 'failed';

-- name: list_jobs
SELECT id, order_id, state, attempts, run_at, lease_until, last_error, created_at, finished_at
FROM {schema}.receipt_jobs
WHERE state = %(state)s
  AND (%(since)s::timestamptz IS NULL OR coalesce(finished_at, created_at) >= %(since)s)
ORDER BY coalesce(finished_at, run_at) DESC, id
LIMIT %(limit)s;

-- name: show_job
SELECT id, order_id, state, attempts, run_at, lease_token, lease_until, last_error,
       created_at, finished_at
FROM {schema}.receipt_jobs
WHERE id = %(id)s;

-- name: show_job_by_order
SELECT id, order_id, state, attempts, run_at, lease_token, lease_until, last_error,
       created_at, finished_at
FROM {schema}.receipt_jobs
WHERE order_id = %(order_id)s;

-- ------------------------------------------------------------------------
-- Attempt history, discard and the review page (migration 0005).

-- name: record_attempts
-- Many attempt records (parallel arrays, one element per attempt) in one
-- statement, after the attempts' acks or reschedules. Each job keeps its last
-- 20 records in a ring: seq = the job's previous highest seq + 1 (several
-- records of one job in a batch get consecutive numbers, in array order),
-- slot = (seq - 1) % 20, and a newer record overwrites the slot's older one.
-- Records of jobs that no longer exist (pruned) are dropped. Two writers that
-- race on the same job and slot keep the first record.
WITH given AS (
  SELECT a.*,
         row_number() OVER (PARTITION BY a.job_id ORDER BY a.ord) AS k,
         count(*) OVER (PARTITION BY a.job_id) AS n
  FROM unnest(%(job_ids)s::uuid[], %(attempts)s::int[], %(reasons)s::text[],
              %(statuses)s::int[], %(errors)s::text[], %(durations)s::float8[],
              %(workers)s::text[])
       WITH ORDINALITY AS a(job_id, attempt, reason, status, error, duration_seconds,
                            worker, ord)
  WHERE EXISTS (SELECT 1 FROM {schema}.receipt_jobs AS j WHERE j.id = a.job_id)
)
INSERT INTO {schema}.receipt_attempts AS h
  (job_id, slot, seq, attempt, reason, status, error, duration_seconds, worker)
SELECT g.job_id, mod(s.seq - 1, 20), s.seq, greatest(g.attempt, 0), left(g.reason, 64),
       g.status, left(g.error, 500), greatest(g.duration_seconds, 0), left(g.worker, 100)
FROM given AS g
CROSS JOIN LATERAL (
  SELECT g.k + coalesce(max(p.seq), 0) AS seq
  FROM {schema}.receipt_attempts AS p WHERE p.job_id = g.job_id
) AS s
WHERE g.k > g.n - 20
ON CONFLICT (job_id, slot) DO UPDATE
SET seq = excluded.seq, attempt = excluded.attempt, at = excluded.at,
    reason = excluded.reason, status = excluded.status, error = excluded.error,
    duration_seconds = excluded.duration_seconds, worker = excluded.worker
WHERE h.seq < excluded.seq;

-- name: job_attempts
-- One job's kept attempt records, newest first (at most 20).
SELECT seq, attempt, at, reason, status, error, duration_seconds, worker
FROM {schema}.receipt_attempts
WHERE job_id = %(id)s
ORDER BY seq DESC;

-- name: review_matching
-- A fragment, not a statement: the review filter shared by review_jobs,
-- review_count, retry_jobs and discard_jobs, over receipt_jobs AS j and the
-- job's latest attempt record AS la (reason, status). {state} is a literal
-- state (so the planner can use that state's partial index) and {key} the
-- time column of the list (finished_at, or run_at for ready jobs). A NULL
-- parameter means "any"; order_contains is a plain substring (no patterns).
j.state = {state}
AND (%(reason)s::text IS NULL OR la.reason = %(reason)s::text)
AND (%(status)s::int IS NULL OR la.status = %(status)s::int)
AND (%(since)s::timestamptz IS NULL OR j.{key} >= %(since)s::timestamptz)
AND (%(until)s::timestamptz IS NULL OR j.{key} < %(until)s::timestamptz)
AND (%(order_contains)s::text IS NULL OR strpos(j.order_id, %(order_contains)s::text) > 0)

-- name: review_jobs
-- One page of the review list, newest first by {key}, after the keyset
-- cursor (after_at, after_id) when given. {matching} is review_matching.
SELECT j.id, j.order_id, j.state, j.attempts, j.run_at, j.last_error, j.created_at,
       j.finished_at, j.{key} AS sort_at, la.reason, la.status
FROM {schema}.receipt_jobs AS j
LEFT JOIN LATERAL (
  SELECT h.reason, h.status FROM {schema}.receipt_attempts AS h
  WHERE h.job_id = j.id ORDER BY h.seq DESC LIMIT 1
) AS la ON true
WHERE {matching}
  AND (%(after_at)s::timestamptz IS NULL
       OR (j.{key}, j.id) < (%(after_at)s::timestamptz, %(after_id)s::uuid))
ORDER BY j.{key} DESC, j.id DESC
LIMIT %(limit)s;

-- name: review_count
-- The latest attempt is only read when the filter asks for its reason or status.
SELECT count(*)
FROM {schema}.receipt_jobs AS j
LEFT JOIN LATERAL (
  SELECT h.reason, h.status FROM {schema}.receipt_attempts AS h
  WHERE h.job_id = j.id AND (%(reason)s::text IS NOT NULL OR %(status)s::int IS NOT NULL)
  ORDER BY h.seq DESC LIMIT 1
) AS la ON true
WHERE {matching};

-- name: retry_jobs
-- Operator retry of named jobs or of a filter, all or nothing: {target} is
-- `j.id = ANY(%(ids)s::uuid[])` or review_matching; only failed rows qualify,
-- and nothing changes unless exactly %(expected)s rows qualify (the count the
-- operator confirmed). Rows are locked first, so a row that changed meanwhile
-- is re-checked. Effect as retry_failed.
WITH target AS MATERIALIZED (
  SELECT j.id
  FROM {schema}.receipt_jobs AS j
  LEFT JOIN LATERAL (
    SELECT h.reason, h.status FROM {schema}.receipt_attempts AS h
    WHERE h.job_id = j.id AND (%(reason)s::text IS NOT NULL OR %(status)s::int IS NOT NULL)
    ORDER BY h.seq DESC LIMIT 1
  ) AS la ON true
  WHERE j.state = 'failed' AND {target}
  FOR UPDATE OF j
)
UPDATE {schema}.receipt_jobs AS j
SET state = 'ready',
    attempts = 0,
    run_at = statement_timestamp(),
    finished_at = NULL,
    last_error = 'manual retry after: ' || coalesce(j.last_error, 'unknown')
FROM target AS t
WHERE j.id = t.id
  AND j.state = 'failed'
  AND (SELECT count(*) FROM target) = %(expected)s
RETURNING j.id;

-- name: discard_jobs
-- Operator discard, all or nothing like retry_jobs: ready or failed rows only
-- (never running: a running row belongs to its lease) → discarded, a terminal
-- state with finished_at set that keeps the row, so the order id stays taken.
WITH target AS MATERIALIZED (
  SELECT j.id
  FROM {schema}.receipt_jobs AS j
  LEFT JOIN LATERAL (
    SELECT h.reason, h.status FROM {schema}.receipt_attempts AS h
    WHERE h.job_id = j.id AND (%(reason)s::text IS NOT NULL OR %(status)s::int IS NOT NULL)
    ORDER BY h.seq DESC LIMIT 1
  ) AS la ON true
  WHERE j.state IN ('ready', 'failed') AND {target}
  FOR UPDATE OF j
)
UPDATE {schema}.receipt_jobs AS j
SET state = 'discarded',
    finished_at = statement_timestamp()
FROM target AS t
WHERE j.id = t.id
  AND j.state IN ('ready', 'failed')
  AND (SELECT count(*) FROM target) = %(expected)s
RETURNING j.id;

-- name: job_states
-- The current state of each given id (absent ids are missing from the result).
SELECT id, state FROM {schema}.receipt_jobs WHERE id = ANY(%(ids)s::uuid[]);

-- name: provider_pause
-- The provider pause as the workers' flow control recorded it.
SELECT pause_reason, paused_until, pause_seconds,
       greatest(extract(epoch FROM paused_until - statement_timestamp())::float8, 0)
         AS remaining_seconds
FROM {schema}.receipt_flow
WHERE id = 1;

-- name: commit_probe
-- Admission control's sample of what a small durable commit costs now, the
-- WAL flush every checkout transaction waits for (admission.py). One
-- transactional logical-decoding message of a few bytes (no table, no lock,
-- any role may emit one; consumers of logical decoding see it under the
-- prefix receipts.probe and may ignore it), committed with synchronous_commit
-- on whatever the session's setting. No parameters: psycopg sends the four
-- statements as one simple query, one round trip.
BEGIN;
SET LOCAL synchronous_commit TO on;
SELECT pg_logical_emit_message(true, 'receipts.probe', '');
COMMIT;
