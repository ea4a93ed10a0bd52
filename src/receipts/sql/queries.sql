-- Every runtime statement of the queue, one named block each. jobqueue.py loads
-- this file once; a method there carries the name of the block it runs.
-- Each state transition names the state it expects, so a late writer changes
-- nothing. Time is always the database's statement_timestamp().

-- name: enqueue
-- Runs inside the caller's (order) transaction, for one order or many in one
-- statement (an array, unnested). An order that already has a job, or that is
-- repeated in the array, is a no-op (ON CONFLICT DO NOTHING). Returns one row:
-- the new jobs' ids and order ids as two arrays (NULL, NULL when none is new);
-- one row, not one per job, spares the client a row object per job (100,000
-- jobs, alternating runs on a busy 2-core machine: median 1.38 s → 1.25 s).
-- Job ids are UUIDv7 (RFC 9562 §6.2, method 2: one random start per statement,
-- incremented per row): time-ordered ids go to the right edge of the primary
-- key instead of scattering over it, and one strong random number is drawn per
-- statement, not per row (gen_random_uuid() measured ~5 µs a call on the 2-core
-- bench machine: 0.5 s of 100,000 jobs; random v4 ids made enqueue_many of
-- 100,000 jobs ~40 % slower there).
-- When at least one job is new and %(notify)s is true, pg_notify runs once;
-- listening workers wake when the transaction commits (identical notifications
-- of one transaction are delivered once). The count over `wake` makes that CTE
-- run: a CTE that nothing reads is never executed.
WITH seed AS MATERIALIZED (
  SELECT lpad(to_hex((extract(epoch FROM clock_timestamp()) * 1000)::int8), 12, '0')
         || '7' || substr(r, 1, 3) AS head,
         ('x' || substr(r, 4, 9) || substr(r, 18, 7))::bit(64)::int8
           & 4611686018427387903 AS tail
  FROM (SELECT replace(gen_random_uuid()::text, '-', '') AS r) AS g
), new AS (
  INSERT INTO receipt_jobs (id, order_id, run_at)
  SELECT (s.head || to_hex(((s.tail + o.n) & 4611686018427387903)
                           | -9223372036854775808))::uuid,
         o.order_id, coalesce(%(run_at)s::timestamptz, now())
  FROM seed AS s, unnest(%(order_ids)b::text[]) WITH ORDINALITY AS o(order_id, n)
  ON CONFLICT (order_id) DO NOTHING
  RETURNING id, order_id
), wake AS (
  SELECT pg_notify(%(channel)s, '')
  WHERE %(notify)s AND EXISTS (SELECT FROM new)
)
SELECT array_agg(new.id), array_agg(new.order_id)
FROM new, (SELECT count(*) FROM wake) AS woken;

-- name: enqueue_traced
-- enqueue, also storing the enqueuing span's W3C traceparent (migration 0004).
-- Used only while a trace is active, so enqueue works on a schema without the
-- column. Identical to enqueue otherwise (tests/unit checks).
WITH seed AS MATERIALIZED (
  SELECT lpad(to_hex((extract(epoch FROM clock_timestamp()) * 1000)::int8), 12, '0')
         || '7' || substr(r, 1, 3) AS head,
         ('x' || substr(r, 4, 9) || substr(r, 18, 7))::bit(64)::int8
           & 4611686018427387903 AS tail
  FROM (SELECT replace(gen_random_uuid()::text, '-', '') AS r) AS g
), new AS (
  INSERT INTO receipt_jobs (id, order_id, run_at, traceparent)
  SELECT (s.head || to_hex(((s.tail + o.n) & 4611686018427387903)
                           | -9223372036854775808))::uuid,
         o.order_id, coalesce(%(run_at)s::timestamptz, now()), %(traceparent)s
  FROM seed AS s, unnest(%(order_ids)b::text[]) WITH ORDINALITY AS o(order_id, n)
  ON CONFLICT (order_id) DO NOTHING
  RETURNING id, order_id
), wake AS (
  SELECT pg_notify(%(channel)s, '')
  WHERE %(notify)s AND EXISTS (SELECT FROM new)
)
SELECT array_agg(new.id), array_agg(new.order_id)
FROM new, (SELECT count(*) FROM wake) AS woken;

-- name: claim
-- {limit} is a literal per batch size: a bind parameter there lets a prepared
-- generic plan fall to a seq scan + hash join (docs/design.md §10).
-- SKIP LOCKED must be inside the CTE to lock the candidate rows.
WITH candidate AS (
  SELECT id
  FROM receipt_jobs
  WHERE state = 'ready'
    AND run_at <= statement_timestamp()
    AND attempts < %(max_attempts)s
  ORDER BY run_at, id
  FOR UPDATE SKIP LOCKED
  LIMIT {limit}
)
UPDATE receipt_jobs AS j
SET state = 'running',
    attempts = j.attempts + 1,
    lease_token = gen_random_uuid(),
    lease_until = statement_timestamp() + make_interval(secs => %(lease_seconds)s)
FROM candidate AS c
WHERE j.id = c.id
RETURNING j.id, j.order_id, j.lease_token, j.attempts;

-- name: ack
-- Many (id, token) pairs in one statement. The guard is id + token + unexpired
-- lease: the CHECK constraint makes a matching non-null token imply 'running',
-- and leaving state out keeps the planner on the primary key (docs/design.md §10).
UPDATE receipt_jobs AS j
SET state = 'done',
    lease_token = NULL,
    lease_until = NULL,
    finished_at = statement_timestamp()
FROM unnest(%(ids)s::uuid[], %(tokens)s::uuid[]) AS a(id, token)
WHERE j.id = a.id
  AND j.lease_token = a.token
  AND j.lease_until > statement_timestamp()
RETURNING j.id;

-- name: reschedule
-- A failed attempt (known failure or unknown outcome), guarded like ack.
-- Ready again after %(delay_seconds)s, or failed when the attempts are used up
-- or the failure is permanent: never a ready row with attempts >= max.
UPDATE receipt_jobs
SET state = CASE WHEN %(permanent)s OR attempts >= %(max_attempts)s
                 THEN 'failed' ELSE 'ready' END,
    run_at = CASE WHEN %(permanent)s OR attempts >= %(max_attempts)s THEN run_at
                  ELSE statement_timestamp() + make_interval(secs => %(delay_seconds)s) END,
    finished_at = CASE WHEN %(permanent)s OR attempts >= %(max_attempts)s
                       THEN statement_timestamp() END,
    lease_token = NULL,
    lease_until = NULL,
    last_error = %(error)s
WHERE id = %(id)s
  AND lease_token = %(token)s
  AND lease_until > statement_timestamp()
RETURNING state;

-- name: recover_expired
-- One bounded batch of abandoned attempts; the caller commits each batch.
WITH expired AS (
  SELECT id
  FROM receipt_jobs
  WHERE state = 'running'
    AND lease_until <= statement_timestamp()
  ORDER BY lease_until, id
  FOR UPDATE SKIP LOCKED
  LIMIT %(batch)s
)
UPDATE receipt_jobs AS j
SET state = CASE WHEN j.attempts >= %(max_attempts)s THEN 'failed' ELSE 'ready' END,
    run_at = statement_timestamp()
             + make_interval(secs => %(delay_seconds)s * (0.5 + random() / 2)),
    finished_at = CASE WHEN j.attempts >= %(max_attempts)s THEN statement_timestamp() END,
    lease_token = NULL,
    lease_until = NULL,
    last_error = 'lease expired'
FROM expired AS e
WHERE j.id = e.id
RETURNING j.state;

-- name: fail_exhausted
-- Ready rows that can never be claimed (max attempts was lowered): fail them
-- so that none waits forever.
WITH exhausted AS (
  SELECT id
  FROM receipt_jobs
  WHERE state = 'ready' AND attempts >= %(max_attempts)s
  ORDER BY run_at, id
  FOR UPDATE SKIP LOCKED
  LIMIT %(batch)s
)
UPDATE receipt_jobs AS j
SET state = 'failed',
    finished_at = statement_timestamp(),
    last_error = coalesce(j.last_error || '; ', '') || 'attempts exhausted (max lowered)'
FROM exhausted AS e
WHERE j.id = e.id
RETURNING j.id;

-- name: prune
-- One bounded batch of finished rows older than the retention window.
WITH old AS (
  SELECT id
  FROM receipt_jobs
  WHERE state IN ('done', 'failed')
    AND finished_at < statement_timestamp() - make_interval(secs => %(retention_seconds)s)
  ORDER BY finished_at, id
  FOR UPDATE SKIP LOCKED
  LIMIT %(batch)s
)
DELETE FROM receipt_jobs AS j
USING old
WHERE j.id = old.id
RETURNING j.id;

-- name: retry_failed
-- Operator retry: failed -> ready, attempts reset, due now; %(ids)s NULL means
-- every failed job. last_error is kept (prefixed) so why it failed survives
-- until the next attempt writes its own.
UPDATE receipt_jobs
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
-- cleanup of receipt_jobs (docs/design.md §10).
WITH ready AS MATERIALIZED (
  SELECT count(*) AS ready,
         count(*) FILTER (WHERE run_at <= statement_timestamp()) AS ready_due,
         min(run_at) FILTER (WHERE run_at <= statement_timestamp()) AS oldest_due
  FROM receipt_jobs WHERE state = 'ready'
), running AS MATERIALIZED (
  SELECT count(*) AS running,
         count(*) FILTER (WHERE lease_until <= statement_timestamp()) AS expired
  FROM receipt_jobs WHERE state = 'running'
), failed AS MATERIALIZED (
  SELECT count(*) AS failed FROM receipt_jobs WHERE state = 'failed'
)
SELECT
  r.ready_due, r.ready, n.running, n.expired, f.failed,
  coalesce(extract(epoch FROM statement_timestamp() - r.oldest_due), 0) AS lag_seconds,
  greatest(pg_stat_get_live_tuples('receipt_jobs'::regclass) - r.ready - n.running - f.failed,
           0) AS done_estimate,
  pg_stat_get_dead_tuples('receipt_jobs'::regclass) AS dead_tuples,
  (SELECT coalesce(extract(epoch FROM statement_timestamp() - min(xact_start)), 0)
     FROM pg_stat_activity
     WHERE xact_start IS NOT NULL AND backend_type = 'client backend'
       AND datname = current_database() AND pid <> pg_backend_pid()) AS oldest_xact_seconds
FROM ready AS r, running AS n, failed AS f;

-- name: state_counts
-- Exact rows by state, for `receipts jobs stats` (an operator command; it
-- counts every done row).
SELECT state, count(*) FROM receipt_jobs GROUP BY state;

-- name: oldest_failed
SELECT min(finished_at) FROM receipt_jobs WHERE state = 'failed';

-- name: list_jobs
SELECT id, order_id, state, attempts, run_at, lease_until, last_error, created_at, finished_at
FROM receipt_jobs
WHERE state = %(state)s
  AND (%(since)s::timestamptz IS NULL OR coalesce(finished_at, created_at) >= %(since)s)
ORDER BY coalesce(finished_at, run_at) DESC, id
LIMIT %(limit)s;

-- name: show_job
SELECT id, order_id, state, attempts, run_at, lease_token, lease_until, last_error,
       created_at, finished_at
FROM receipt_jobs
WHERE id = %(id)s;

-- name: show_job_by_order
SELECT id, order_id, state, attempts, run_at, lease_token, lease_until, last_error,
       created_at, finished_at
FROM receipt_jobs
WHERE order_id = %(order_id)s;
