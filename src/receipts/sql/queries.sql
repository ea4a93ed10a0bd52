-- Every runtime statement of the queue, one named block each. jobqueue.py loads
-- this file once; a method there carries the name of the block it runs.
-- Each state transition names the state it expects, so a late writer changes
-- nothing. Time is always the database's statement_timestamp().

-- name: enqueue
-- Runs inside the caller's (order) transaction. Duplicate order ids are a no-op.
INSERT INTO receipt_jobs (id, order_id)
VALUES (%(id)s, %(order_id)s)
ON CONFLICT (order_id) DO NOTHING
RETURNING id;

-- name: notify_ready
-- Wakes listening workers when the enclosing transaction commits.
SELECT pg_notify(%(channel)s, '');

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
-- Each returned row also gets a `lease_expired` record in its attempt history
-- (the ring of record_attempts; worker = this session's application_name;
-- no status or duration: nobody saw the attempt end).
WITH expired AS (
  SELECT id
  FROM receipt_jobs
  WHERE state = 'running'
    AND lease_until <= statement_timestamp()
  ORDER BY lease_until, id
  FOR UPDATE SKIP LOCKED
  LIMIT %(batch)s
), moved AS (
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
  RETURNING j.id, j.state, j.attempts
), recorded AS (
  INSERT INTO receipt_attempts AS h (job_id, slot, seq, attempt, reason, error, worker)
  SELECT m.id, mod(s.seq - 1, 20), s.seq, m.attempts, 'lease_expired', 'lease expired',
         left(current_setting('application_name'), 100)
  FROM moved AS m
  CROSS JOIN LATERAL (
    SELECT coalesce(max(p.seq), 0) + 1 AS seq
    FROM receipt_attempts AS p WHERE p.job_id = m.id
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
-- One bounded batch of finished rows older than the retention window: up to
-- %(batch)s done/failed rows and up to %(batch)s discarded rows (each kind
-- through its own partial index), with their attempt histories.
WITH old AS (
  SELECT id
  FROM receipt_jobs
  WHERE state IN ('done', 'failed')
    AND finished_at < statement_timestamp() - make_interval(secs => %(retention_seconds)s)
  ORDER BY finished_at, id
  FOR UPDATE SKIP LOCKED
  LIMIT %(batch)s
), old_discarded AS (
  SELECT id
  FROM receipt_jobs
  WHERE state = 'discarded'
    AND finished_at < statement_timestamp() - make_interval(secs => %(retention_seconds)s)
  ORDER BY finished_at, id
  FOR UPDATE SKIP LOCKED
  LIMIT %(batch)s
), deleted AS (
  DELETE FROM receipt_jobs AS j
  USING (SELECT id FROM old UNION ALL SELECT id FROM old_discarded) AS o
  WHERE j.id = o.id
  RETURNING j.id
), history AS (
  DELETE FROM receipt_attempts AS h
  USING deleted AS d
  WHERE h.job_id = d.id
)
SELECT id FROM deleted;

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
), discarded AS MATERIALIZED (
  SELECT count(*) AS discarded FROM receipt_jobs WHERE state = 'discarded'
)
SELECT
  r.ready_due, r.ready, n.running, n.expired, f.failed,
  coalesce(extract(epoch FROM statement_timestamp() - r.oldest_due), 0) AS lag_seconds,
  greatest(pg_stat_get_live_tuples('receipt_jobs'::regclass) - r.ready - n.running - f.failed
           - d.discarded, 0) AS done_estimate,
  pg_stat_get_dead_tuples('receipt_jobs'::regclass) AS dead_tuples,
  (SELECT coalesce(extract(epoch FROM statement_timestamp() - min(xact_start)), 0)
     FROM pg_stat_activity
     WHERE xact_start IS NOT NULL AND backend_type = 'client backend'
       AND datname = current_database() AND pid <> pg_backend_pid()) AS oldest_xact_seconds,
  d.discarded
FROM ready AS r, running AS n, failed AS f, discarded AS d;

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
  WHERE EXISTS (SELECT 1 FROM receipt_jobs AS j WHERE j.id = a.job_id)
)
INSERT INTO receipt_attempts AS h
  (job_id, slot, seq, attempt, reason, status, error, duration_seconds, worker)
SELECT g.job_id, mod(s.seq - 1, 20), s.seq, greatest(g.attempt, 0), left(g.reason, 64),
       g.status, left(g.error, 500), greatest(g.duration_seconds, 0), left(g.worker, 100)
FROM given AS g
CROSS JOIN LATERAL (
  SELECT g.k + coalesce(max(p.seq), 0) AS seq
  FROM receipt_attempts AS p WHERE p.job_id = g.job_id
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
FROM receipt_attempts
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
FROM receipt_jobs AS j
LEFT JOIN LATERAL (
  SELECT h.reason, h.status FROM receipt_attempts AS h
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
FROM receipt_jobs AS j
LEFT JOIN LATERAL (
  SELECT h.reason, h.status FROM receipt_attempts AS h
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
  FROM receipt_jobs AS j
  LEFT JOIN LATERAL (
    SELECT h.reason, h.status FROM receipt_attempts AS h
    WHERE h.job_id = j.id AND (%(reason)s::text IS NOT NULL OR %(status)s::int IS NOT NULL)
    ORDER BY h.seq DESC LIMIT 1
  ) AS la ON true
  WHERE j.state = 'failed' AND {target}
  FOR UPDATE OF j
)
UPDATE receipt_jobs AS j
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
  FROM receipt_jobs AS j
  LEFT JOIN LATERAL (
    SELECT h.reason, h.status FROM receipt_attempts AS h
    WHERE h.job_id = j.id AND (%(reason)s::text IS NOT NULL OR %(status)s::int IS NOT NULL)
    ORDER BY h.seq DESC LIMIT 1
  ) AS la ON true
  WHERE j.state IN ('ready', 'failed') AND {target}
  FOR UPDATE OF j
)
UPDATE receipt_jobs AS j
SET state = 'discarded',
    finished_at = statement_timestamp()
FROM target AS t
WHERE j.id = t.id
  AND j.state IN ('ready', 'failed')
  AND (SELECT count(*) FROM target) = %(expected)s
RETURNING j.id;

-- name: job_states
-- The current state of each given id (absent ids are missing from the result).
SELECT id, state FROM receipt_jobs WHERE id = ANY(%(ids)s::uuid[]);

-- name: flow_table
-- Whether the provider flow-control table exists (it arrives with its own
-- migration; the review page shows "unknown" until then).
SELECT to_regclass('receipt_flow') IS NOT NULL;

-- name: provider_pause
-- The provider pause as the workers' flow control recorded it.
SELECT pause_reason, paused_until, pause_seconds,
       greatest(extract(epoch FROM paused_until - statement_timestamp()), 0) AS remaining_seconds
FROM receipt_flow
WHERE id = 1;
