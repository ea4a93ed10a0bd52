-- The operator's statements, for `receipts jobs ...` and the review page: the
-- review lists and counts, one job and its history, retry and discard (named
-- jobs or a filter), bulk actions in bounded batches, the fleet-wide pause an
-- operator sets and lifts, the workers seen, and signed-out review-page
-- sessions. operations.py runs them (receipts.statements loads this file with
-- queries.sql); a method there carries the name of the block it runs. None of
-- these runs on a claim's or an ack's path.

-- name: flow_state
-- The fleet-wide provider state, for gauges and review: the effective reason,
-- seconds to the pause's end, its length, and the bucket's tokens.
SELECT {schema}.receipts_pause_reason(pause_reason, paused_until, pause_cause,
                                      pause_cause_until, statement_timestamp()),
       greatest(extract(epoch FROM paused_until - statement_timestamp())::float8, 0),
       pause_seconds,
       least(%(burst)s::float8, tokens + %(rate)s::float8
             * extract(epoch FROM statement_timestamp() - tokens_at)::float8)
FROM {schema}.receipt_flow WHERE id = 1;

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

-- name: job_attempts
-- One job's kept attempt records, newest first (at most 20).
SELECT seq, attempt, at, reason, status, error, duration_seconds, worker
FROM {schema}.receipt_attempts
WHERE job_id = %(id)s
ORDER BY seq DESC;

-- name: review_matching
-- A fragment, not a statement: the review filter shared by review_jobs,
-- review_count, retry_jobs, discard_jobs and the bulk actions' bulk_step,
-- over receipt_jobs AS j and the job's latest attempt record AS la (reason,
-- status). {state} is a literal state (so the planner can use that state's
-- partial index), {key} the time column of the list (finished_at; run_at for
-- ready jobs, lease_until for running ones) and {cutoff_key} the column a
-- bulk action's confirmation time bounds (finished_at; created_at for ready
-- and running jobs: a job that reaches the state after the confirmation is
-- never part of it). A NULL parameter means "any"; order_contains is a plain
-- substring (no patterns); error_prefix is a failure group's key (the first
-- 60 characters of last_error, as failure_groups); expired picks running jobs
-- whose lease has (true)
-- or has not (false) run out.
j.state = {state}
AND (%(reason)s::text IS NULL OR la.reason = %(reason)s::text)
AND (%(status)s::int IS NULL OR la.status = %(status)s::int)
AND (%(since)s::timestamptz IS NULL OR j.{key} >= %(since)s::timestamptz)
AND (%(until)s::timestamptz IS NULL OR j.{key} < %(until)s::timestamptz)
AND (%(order_contains)s::text IS NULL OR strpos(j.order_id, %(order_contains)s::text) > 0)
AND (%(error_prefix)s::text IS NULL OR left(j.last_error, 60) = %(error_prefix)s::text)
AND (%(cutoff)s::timestamptz IS NULL OR j.{cutoff_key} <= %(cutoff)s::timestamptz)
AND (%(expired)s::bool IS NULL
     OR (j.lease_until <= statement_timestamp()) = %(expired)s::bool)

-- name: review_jobs
-- One page of the review list, newest first by {key}, after the keyset
-- cursor (after_at, after_id) when given. {matching} is review_matching.
-- holder is the pod of the worker whose lease a running job is under: the
-- last 8 hex digits of a lease token are the claiming process's tag in
-- receipt_workers (claim), one primary-key probe per listed row; NULL for
-- a token written by a worker that sends no heartbeat.
SELECT j.id, j.order_id, j.state, j.attempts, j.run_at, j.last_error, j.created_at,
       j.finished_at, j.lease_until, j.lease_until <= statement_timestamp() AS expired,
       j.{key} AS sort_at, la.reason, la.status, w.pod AS holder, w.pid AS holder_pid,
       right(j.lease_token::text, 8) AS holder_tag
FROM {schema}.receipt_jobs AS j
LEFT JOIN LATERAL (
  SELECT h.reason, h.status FROM {schema}.receipt_attempts AS h
  WHERE h.job_id = j.id ORDER BY h.seq DESC LIMIT 1
) AS la ON true
LEFT JOIN {schema}.receipt_workers AS w ON w.tag = right(j.lease_token::text, 8)
WHERE {matching}
  AND (%(after_at)s::timestamptz IS NULL
       OR (j.{key}, j.id) < (%(after_at)s::timestamptz, %(after_id)s::uuid))
ORDER BY j.{key} DESC, j.id DESC
LIMIT %(limit)s;

-- name: review_count
-- The latest attempt is only read when the filter asks for its reason or status.
-- Counts at most %(cap)s rows (NULL: every one), so a page's count costs at
-- most that many index entries however many jobs match.
SELECT count(*)
FROM (
  SELECT 1
  FROM {schema}.receipt_jobs AS j
  LEFT JOIN LATERAL (
    SELECT h.reason, h.status FROM {schema}.receipt_attempts AS h
    WHERE h.job_id = j.id AND (%(reason)s::text IS NOT NULL OR %(status)s::int IS NOT NULL)
    ORDER BY h.seq DESC LIMIT 1
  ) AS la ON true
  WHERE {matching}
  LIMIT %(cap)s
) AS matched;

-- name: retry_jobs
-- Operator retry of named jobs or of a filter, all or nothing: {target} is
-- `j.id = ANY(%(ids)s::uuid[])` or review_matching; only failed rows qualify,
-- and nothing changes unless exactly %(expected)s rows qualify (the count the
-- operator confirmed). Rows are locked first, so a row that changed meanwhile
-- is re-checked. Effect: failed -> ready, attempts reset, due now; last_error
-- is kept (prefixed) so why it failed survives until the next attempt writes
-- its own. The one door for a retry of named jobs, for the command line and
-- the page alike (receipts.review.retry): a check followed by a separate
-- update could retry some of the named jobs and not others.
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
-- The provider pause as the workers' flow control recorded it, with its
-- effective reason (as the claims read it) and the last probe's answer.
SELECT {schema}.receipts_pause_reason(pause_reason, paused_until, pause_cause,
                                      pause_cause_until, statement_timestamp()) AS pause_reason,
       paused_until, pause_seconds,
       greatest(extract(epoch FROM paused_until - statement_timestamp())::float8, 0)
         AS remaining_seconds,
       last_probe_at, last_probe_outcome
FROM {schema}.receipt_flow
WHERE id = 1;


-- name: fleet_flow
-- The fleet-wide provider state as an operator reads it. effective_reason is
-- the reason in force now, as the claims read it (receipts_pause_reason,
-- migration 0008): a retry_after pause whose time is up counts as no pause.
-- The note, author and start belong to the cause, so they show only while the
-- cause applies. tokens is the bucket as the next claim would find it.
SELECT statement_timestamp() AS now,
       {schema}.receipts_pause_reason(f.pause_reason, f.paused_until, f.pause_cause,
                                      f.pause_cause_until, statement_timestamp())
         AS effective_reason,
       f.pause_reason, f.paused_until,
       greatest(extract(epoch FROM f.paused_until - statement_timestamp())::float8, 0)
         AS remaining_seconds,
       f.pause_seconds, f.probe_until,
       CASE WHEN f.pause_cause_until = f.paused_until THEN f.pause_note END AS pause_note,
       CASE WHEN f.pause_cause_until = f.paused_until THEN f.paused_by END AS paused_by,
       CASE WHEN f.pause_cause_until = f.paused_until THEN f.paused_at END AS paused_at,
       least(%(burst)s::float8, f.tokens + %(rate)s::float8
             * extract(epoch FROM statement_timestamp() - f.tokens_at)::float8) AS tokens,
       f.last_probe_at, f.last_probe_outcome
FROM {schema}.receipt_flow AS f
WHERE f.id = 1;

-- name: pause_fleet
-- An operator pauses every worker's claims for %(seconds)s from now. Written
-- so that every worker, released ones included, understands it: pause_reason
-- 'retry_after' (claims stop until paused_until and then resume by
-- themselves, no probe), with the cause, note, author and start beside it and
-- pause_cause_until = paused_until, the mark that the cause applies. A manual
-- pause replaces no pause, an earlier manual one, or one that ends sooner; a
-- longer automatic pause (outage, auth, Retry-After) stays unless
-- %(replace)s: then nothing changes and the row says why. pause_seconds (what
-- a failed probe doubles) starts again from 0, and any probe in flight loses
-- its right to resume the fleet.
WITH old AS MATERIALIZED (
  SELECT f.pause_reason, f.paused_until,
         {schema}.receipts_pause_reason(f.pause_reason, f.paused_until, f.pause_cause,
                                        f.pause_cause_until, NULL) AS effective_reason
  FROM {schema}.receipt_flow AS f
  WHERE f.id = 1
  FOR UPDATE
), paused AS (
  UPDATE {schema}.receipt_flow AS f
  SET pause_reason = 'retry_after',
      paused_until = statement_timestamp() + make_interval(secs => %(seconds)s),
      pause_cause = 'manual',
      pause_cause_until = statement_timestamp() + make_interval(secs => %(seconds)s),
      pause_note = %(note)s,
      paused_by = %(paused_by)s,
      paused_at = statement_timestamp(),
      pause_seconds = 0,
      probe_until = NULL
  FROM old
  WHERE f.id = 1
    AND (%(replace)s
         OR old.pause_reason IS NULL
         OR old.effective_reason = 'manual'
         OR old.paused_until <= statement_timestamp() + make_interval(secs => %(seconds)s))
  RETURNING f.paused_until
)
SELECT (SELECT paused_until FROM paused) AS paused_until,
       old.effective_reason AS previous_reason, old.paused_until AS previous_until
FROM old;

-- name: wake_fleet
-- After an operator's pause: wake every worker's LISTEN session
-- (%(channel)s is receipts_ready), so each claims once now, learns of the
-- pause from the claim and says so on /metrics (receipts_provider_paused
-- {reason="manual"}, which silences the lag alerts) within a moment instead
-- of its next poll, seconds later. An operator's own short transaction, never
-- an order's.
SELECT pg_notify(%(channel)s, '');

-- name: resume_fleet
-- An operator lifts the pause, whatever its reason: every pause column is
-- cleared and the next claim of every worker claims again (no probe). With
-- %(expected_until)s, only the pause the operator saw (the same paused_until)
-- is lifted: one that another pod extended or that started since is left
-- alone. Returns the pause that was there (its reason whether or not its time
-- was up: receipts_pause_reason with no moment), and whether it was lifted.
WITH old AS MATERIALIZED (
  SELECT f.pause_reason, f.paused_until,
         {schema}.receipts_pause_reason(f.pause_reason, f.paused_until, f.pause_cause,
                                        f.pause_cause_until, NULL) AS effective_reason,
         CASE WHEN f.pause_cause_until = f.paused_until THEN f.pause_note END AS pause_note
  FROM {schema}.receipt_flow AS f
  WHERE f.id = 1
  FOR UPDATE
), lifted AS (
  UPDATE {schema}.receipt_flow AS f
  SET pause_reason = NULL, paused_until = NULL, pause_seconds = 0, probe_until = NULL,
      pause_cause = NULL, pause_cause_until = NULL, pause_note = NULL, paused_by = NULL,
      paused_at = NULL
  FROM old
  WHERE f.id = 1
    AND old.pause_reason IS NOT NULL
    AND (%(expected_until)s::timestamptz IS NULL
         OR old.paused_until = %(expected_until)s::timestamptz)
  RETURNING 1
)
SELECT old.effective_reason, old.paused_until, old.pause_note,
       EXISTS (SELECT FROM lifted) AS lifted
FROM old;

-- name: workers_seen
-- The workers that sent a heartbeat within the last %(seconds)s, busiest pod
-- first. age_seconds: since the last heartbeat.
SELECT tag, pod, pid, version, slots, inflight, claimed_total, started_at, seen_at,
       last_claim_at, stopped_at,
       extract(epoch FROM statement_timestamp() - seen_at)::float8 AS age_seconds
FROM {schema}.receipt_workers
WHERE seen_at > statement_timestamp() - make_interval(secs => %(seconds)s)
ORDER BY stopped_at IS NOT NULL, pod, tag;

-- name: revoke_session
-- A review-page session signed out: its id is refused until %(expires_at)s,
-- when its cookie would have expired anyway (expired entries go in the same
-- statement).
WITH expired AS (
  DELETE FROM {schema}.receipt_ui_revoked WHERE expires_at <= statement_timestamp()
)
INSERT INTO {schema}.receipt_ui_revoked (sid, expires_at)
VALUES (%(sid)s, %(expires_at)s)
ON CONFLICT (sid) DO NOTHING;

-- name: revoked_sessions
SELECT sid FROM {schema}.receipt_ui_revoked WHERE expires_at > statement_timestamp();

-- name: bulk_create
-- A confirmed bulk action, owned by %(runner)s from the start. Finished
-- actions older than 90 days go in the same statement.
WITH old AS (
  DELETE FROM {schema}.receipt_bulk_actions
  WHERE finished_at < statement_timestamp() - interval '90 days'
)
INSERT INTO {schema}.receipt_bulk_actions
  (id, action, job_state, reason, http_status, since, until, order_contains, error_prefix,
   cutoff, expected, status, runner, created_by)
VALUES (%(id)s, %(action)s, %(job_state)s, %(reason)s, %(http_status)s, %(since)s, %(until)s,
        %(order_contains)s, %(error_prefix)s, %(cutoff)s, %(expected)s, 'running', %(runner)s,
        %(created_by)s)
RETURNING *;

-- name: bulk_get
SELECT *, extract(epoch FROM statement_timestamp() - updated_at)::float8 AS idle_seconds
FROM {schema}.receipt_bulk_actions WHERE id = %(id)s;

-- name: bulk_recent
-- The actions still running and those created within the last %(seconds)s.
SELECT *, extract(epoch FROM statement_timestamp() - updated_at)::float8 AS idle_seconds
FROM {schema}.receipt_bulk_actions
WHERE status = 'running' OR created_at > statement_timestamp() - make_interval(secs => %(seconds)s)
ORDER BY created_at DESC
LIMIT 10;

-- name: bulk_take
-- Take over an action to run it: one that was stopped or failed, one whose
-- runner released it (bulk_release: the nil runner), or one whose runner has
-- written nothing for %(stale_seconds)s (its process died). The new runner
-- token fences the old runner out: its next batch changes nothing.
UPDATE {schema}.receipt_bulk_actions
SET status = 'running', runner = %(runner)s, updated_at = statement_timestamp(),
    finished_at = NULL, error = NULL
WHERE id = %(id)s
  AND (status IN ('stopped', 'failed')
       OR (status = 'running'
           AND (runner = '00000000-0000-0000-0000-000000000000'::uuid
                OR updated_at < statement_timestamp()
                                - make_interval(secs => %(stale_seconds)s))))
RETURNING *;

-- name: bulk_release
-- A page that shuts down hands its running action over: it stays running,
-- owned by the nil runner, which no process holds, so the next page (this one
-- restarted, or another replica) takes it over at once (bulk_take) instead of
-- after the stale time. The old runner token is fenced out as by bulk_take.
UPDATE {schema}.receipt_bulk_actions
SET runner = '00000000-0000-0000-0000-000000000000'::uuid
WHERE id = %(id)s AND runner = %(runner)s AND status = 'running'
RETURNING id;

-- name: bulk_orphans
-- Running actions nobody runs: released by a page that shut down, or silent
-- for %(stale_seconds)s (the page that ran them was killed). A page takes them
-- over by itself (bulk_take decides which page wins).
SELECT id FROM {schema}.receipt_bulk_actions
WHERE status = 'running'
  AND (runner = '00000000-0000-0000-0000-000000000000'::uuid
       OR updated_at < statement_timestamp() - make_interval(secs => %(stale_seconds)s))
ORDER BY created_at
LIMIT 10;

-- name: bulk_find
-- The action an operator already confirmed with this very form (the same
-- action, filter and confirmation time): a form sent twice (a reload, a
-- replay) finds it instead of starting an empty second action.
SELECT *, extract(epoch FROM statement_timestamp() - updated_at)::float8 AS idle_seconds
FROM {schema}.receipt_bulk_actions
WHERE action = %(action)s AND job_state = %(job_state)s AND cutoff = %(cutoff)s
  AND reason IS NOT DISTINCT FROM %(reason)s::text
  AND http_status IS NOT DISTINCT FROM %(http_status)s::int
  AND since IS NOT DISTINCT FROM %(since)s::timestamptz
  AND until IS NOT DISTINCT FROM %(until)s::timestamptz
  AND order_contains IS NOT DISTINCT FROM %(order_contains)s::text
  AND error_prefix IS NOT DISTINCT FROM %(error_prefix)s::text
ORDER BY created_at
LIMIT 1;

-- name: bulk_stop
-- Stop an action between two batches (a batch in flight commits first: it
-- holds the action's row lock, and this waits for it).
UPDATE {schema}.receipt_bulk_actions
SET status = 'stopped', runner = NULL, updated_at = statement_timestamp()
WHERE id = %(id)s AND status = 'running'
RETURNING id;

-- name: bulk_fail
UPDATE {schema}.receipt_bulk_actions
SET status = 'failed', runner = NULL, updated_at = statement_timestamp(),
    error = left(%(error)s, 500)
WHERE id = %(id)s AND runner = %(runner)s
RETURNING id;

-- name: bulk_step
-- One batch of a bulk action, one transaction. It walks the jobs of the
-- action's state (the literal {state}) in keyset order by {key} DESC, id DESC
-- from the cursor, over at most %(batch)s index entries, whatever the filter
-- matches: a selective filter costs as much per batch as a broad one, never a
-- whole scan. The matching rows (review_matching, {matching}, with the
-- confirmation's cutoff) get {effect}; the UPDATE states the state it
-- expects, so a job a worker, recovery or another operator moved meanwhile is
-- left alone. The action's row is locked first and only if %(runner)s still
-- owns it running (else nothing happens and no row comes back); its counts
-- and cursor move in the same commit as the jobs, so a crash loses nothing
-- and a resumed action repeats nothing. Fewer entries than %(batch)s means
-- the walk reached the end: the action is done. The changed ids come back
-- only when %(want_ids)s (the command line lists them; the page does not).
WITH action AS MATERIALIZED (
  SELECT a.id FROM {schema}.receipt_bulk_actions AS a
  WHERE a.id = %(id)s AND a.runner = %(runner)s AND a.status = 'running'
  FOR UPDATE
), walked AS MATERIALIZED (
  SELECT j.id, j.{key} AS k
  FROM {schema}.receipt_jobs AS j
  WHERE EXISTS (SELECT FROM action)
    AND j.state = {state}
    AND j.{cutoff_key} <= %(cutoff)s::timestamptz
    AND (%(since)s::timestamptz IS NULL OR j.{key} >= %(since)s::timestamptz)
    AND (%(until)s::timestamptz IS NULL OR j.{key} < %(until)s::timestamptz)
    AND (%(after_at)s::timestamptz IS NULL
         OR (j.{key}, j.id) < (%(after_at)s::timestamptz, %(after_id)s::uuid))
  ORDER BY j.{key} DESC, j.id DESC
  LIMIT %(batch)s
), matched AS (
  SELECT j.id
  FROM walked AS w
  JOIN {schema}.receipt_jobs AS j ON j.id = w.id
  LEFT JOIN LATERAL (
    SELECT h.reason, h.status FROM {schema}.receipt_attempts AS h
    WHERE h.job_id = j.id AND (%(reason)s::text IS NOT NULL OR %(status)s::int IS NOT NULL)
    ORDER BY h.seq DESC LIMIT 1
  ) AS la ON true
  WHERE {matching}
), changed AS (
  UPDATE {schema}.receipt_jobs AS j
  SET {effect}
  FROM matched AS m
  WHERE j.id = m.id
    AND j.state = {state}
    AND j.{cutoff_key} <= %(cutoff)s::timestamptz
  RETURNING j.id
), last AS (
  SELECT k, id FROM walked ORDER BY k, id LIMIT 1
), progress AS (
  UPDATE {schema}.receipt_bulk_actions AS a
  SET examined = a.examined + (SELECT count(*) FROM walked),
      changed = a.changed + (SELECT count(*) FROM changed),
      batches = a.batches + 1,
      cursor_at = coalesce((SELECT k FROM last), a.cursor_at),
      cursor_id = coalesce((SELECT id FROM last), a.cursor_id),
      status = CASE WHEN (SELECT count(*) FROM walked) < %(batch)s THEN 'done' ELSE 'running' END,
      runner = CASE WHEN (SELECT count(*) FROM walked) < %(batch)s THEN NULL ELSE a.runner END,
      finished_at = CASE WHEN (SELECT count(*) FROM walked) < %(batch)s
                         THEN statement_timestamp() END,
      updated_at = statement_timestamp()
  FROM action
  WHERE a.id = action.id
  RETURNING a.examined, a.changed, a.status, a.cursor_at, a.cursor_id
)
SELECT p.examined, p.changed, p.status, p.cursor_at, p.cursor_id,
       (SELECT count(*) FROM changed) AS batch_changed,
       CASE WHEN %(want_ids)s THEN (SELECT array_agg(id) FROM changed) END AS changed_ids
FROM progress AS p;

-- name: retry_effect
-- A fragment of bulk_step: what a retry does (as retry_jobs).
state = 'ready',
attempts = 0,
run_at = statement_timestamp(),
finished_at = NULL,
last_error = 'manual retry after: ' || coalesce(j.last_error, 'unknown')

-- name: discard_effect
-- A fragment of bulk_step: what a discard does (as discard_jobs).
state = 'discarded',
finished_at = statement_timestamp()

-- name: failure_groups
-- Failures grouped by cause: the first 60 characters of last_error (an
-- error's status and message; what varies, an order id or a time, comes
-- later). Bounded work whatever the table holds: the %(failed_cap)s most
-- recent failed jobs (a range of receipt_jobs_failed, newest first) and at
-- most %(ready_cap)s ready jobs that carry an error (waiting for a retry, or
-- a held rejection; a range of the ready index), so a million failed rows
-- cost what a hundred thousand do. `capped` says a side reached its bound
-- (the counts are then of those rows). Each group has the count, when its
-- first and last job failed (ready: their due times), and the reason and
-- HTTP status of its most recent job's latest attempt (one probe per group).
-- At most %(limit)s groups, largest first.
WITH recent AS MATERIALIZED (
  SELECT j.id, j.last_error, j.finished_at AS at
  FROM {schema}.receipt_jobs AS j
  WHERE j.state = 'failed'
  ORDER BY j.finished_at DESC, j.id DESC
  LIMIT %(failed_cap)s
), ready_rows AS MATERIALIZED (
  SELECT j.id, j.last_error, j.run_at AS at
  FROM {schema}.receipt_jobs AS j
  WHERE j.state = 'ready' AND j.last_error IS NOT NULL
  ORDER BY j.run_at, j.id
  LIMIT %(ready_cap)s
), groups AS (
  SELECT 'failed'::text AS state, left(r.last_error, 60) AS prefix, count(*) AS jobs,
         min(r.at) AS first_at, max(r.at) AS last_at,
         (SELECT count(*) FROM recent) >= %(failed_cap)s AS capped,
         (array_agg(r.id ORDER BY r.at DESC))[1] AS newest
  FROM recent AS r
  GROUP BY left(r.last_error, 60)
  UNION ALL
  SELECT 'ready'::text, left(r.last_error, 60), count(*), min(r.at), max(r.at),
         (SELECT count(*) FROM ready_rows) >= %(ready_cap)s,
         (array_agg(r.id ORDER BY r.at DESC))[1]
  FROM ready_rows AS r
  GROUP BY left(r.last_error, 60)
  ORDER BY jobs DESC, prefix
  LIMIT %(limit)s
)
SELECT g.state, g.prefix, g.jobs, g.first_at, g.last_at, g.capped, la.reason, la.status
FROM groups AS g
LEFT JOIN LATERAL (
  SELECT h.reason, h.status FROM {schema}.receipt_attempts AS h
  WHERE h.job_id = g.newest ORDER BY h.seq DESC LIMIT 1
) AS la ON true
ORDER BY g.jobs DESC, g.prefix;

-- name: attempt_rates
-- Attempts per minute since %(since)s (at most the last hour): how many,
-- how many delivered, and the median and 95th percentile of their time
-- (seconds). Read from receipt_attempts (its BRIN index on at), so a page
-- that restarts draws the same hour again.
SELECT date_trunc('minute', h.at) AS minute,
       count(*) AS attempts,
       count(*) FILTER (WHERE h.reason = 'delivered') AS delivered,
       percentile_cont(0.5) WITHIN GROUP (ORDER BY h.duration_seconds) AS p50,
       percentile_cont(0.95) WITHIN GROUP (ORDER BY h.duration_seconds) AS p95
FROM {schema}.receipt_attempts AS h
WHERE h.at >= greatest(%(since)s::timestamptz, statement_timestamp() - interval '1 hour')
GROUP BY 1
ORDER BY 1;

-- name: attempt_percentiles
-- The median and 95th percentile of the attempt time (seconds) and the
-- deliveries over the last hour, as one row.
SELECT count(*) FILTER (WHERE h.reason = 'delivered') AS delivered,
       count(*) AS attempts,
       percentile_cont(0.5) WITHIN GROUP (ORDER BY h.duration_seconds) AS p50,
       percentile_cont(0.95) WITHIN GROUP (ORDER BY h.duration_seconds) AS p95
FROM {schema}.receipt_attempts AS h
WHERE h.at >= statement_timestamp() - interval '1 hour';

-- name: ui_sample
-- The queue-depth chart's sample of this minute (the first page to write it
-- wins; the others' rows are the same minute's). Samples older than two hours
-- go in the same statement.
WITH old AS (
  DELETE FROM {schema}.receipt_ui_samples
  WHERE minute < statement_timestamp() - interval '2 hours'
)
INSERT INTO {schema}.receipt_ui_samples (minute, ready, running, failed)
VALUES (date_trunc('minute', %(at)s::timestamptz), %(ready)s, %(running)s, %(failed)s)
ON CONFLICT (minute) DO NOTHING;

-- name: ui_samples
-- The queue-depth chart's samples of the last hour, oldest first.
SELECT minute, ready, running, failed
FROM {schema}.receipt_ui_samples
WHERE minute >= statement_timestamp() - interval '1 hour'
ORDER BY minute;

-- name: held_jobs
-- The held rejections as one group: ready jobs whose last attempt was a 4xx
-- the workers could not judge for want of evidence (the provider accepted no
-- other order around it), so they gave the attempt back (receipts/flow.py;
-- last_error starts with 'held rejection: '). Oldest due first, at most
-- %(limit)s, with the group's size. A read over the ready partial index.
SELECT j.id, j.order_id, j.attempts, j.run_at, j.last_error, j.created_at,
       count(*) OVER () AS held
FROM {schema}.receipt_jobs AS j
WHERE j.state = 'ready' AND starts_with(j.last_error, 'held rejection: ')
ORDER BY j.run_at, j.id
LIMIT %(limit)s;

-- name: held_discard
-- Give up on at most %(batch)s held rejections (held_jobs): ready → discarded,
-- as discard_jobs (terminal, the order stays deduplicated). Rows a worker has
-- claimed meanwhile are running, not ready, and are left alone (SKIP LOCKED and
-- the state check). Run until it changes fewer than %(batch)s rows.
WITH target AS MATERIALIZED (
  SELECT j.id FROM {schema}.receipt_jobs AS j
  WHERE j.state = 'ready' AND starts_with(j.last_error, 'held rejection: ')
  ORDER BY j.run_at, j.id
  LIMIT %(batch)s
  FOR UPDATE OF j SKIP LOCKED
)
UPDATE {schema}.receipt_jobs AS j
SET state = 'discarded',
    finished_at = statement_timestamp()
FROM target AS t
WHERE j.id = t.id AND j.state = 'ready'
RETURNING j.id;

-- name: held_retry
-- Send at most %(batch)s held rejections again now: run_at = now. last_error is
-- kept, so they stay in the group (a paused fleet may not send them for a
-- while, and the operator must still be able to discard them) until they are
-- delivered, failed on evidence, or held again. Attempts are unchanged (held
-- rejections gave theirs back).
WITH target AS MATERIALIZED (
  SELECT j.id FROM {schema}.receipt_jobs AS j
  WHERE j.state = 'ready' AND starts_with(j.last_error, 'held rejection: ')
    AND j.run_at > statement_timestamp()
  ORDER BY j.run_at, j.id
  LIMIT %(batch)s
  FOR UPDATE OF j SKIP LOCKED
)
UPDATE {schema}.receipt_jobs AS j
SET run_at = statement_timestamp()
FROM target AS t
WHERE j.id = t.id AND j.state = 'ready'
RETURNING j.id;
