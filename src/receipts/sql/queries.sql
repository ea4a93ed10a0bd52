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
-- PostgreSQL 18's uuidv7() draw one per row, which costs far more, and random
-- v4 ids also slowed enqueue_many: bench/README.md). The low 62
-- bits of an id are start + n, so the client places every new id at its
-- position without the order id coming back (receipts.enqueue._aligned).
-- No notification: a transaction that has called pg_notify takes one lock for
-- the whole instance at commit and holds it through its WAL flush, which would
-- serialise every enqueuing checkout (docs/design.md, "The checkout's commit
-- path"). The fleet's waker wakes the workers (waker_probe).
-- Cost: python -m bench.enqueue (bench/README.md). Nearly all of it is the
-- insert itself: heap and WAL, the primary key, order_id and ready indexes,
-- and ON CONFLICT's speculative insertion (an arbiter probe, a lock and a
-- confirm record per row); the client's part is small.
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
-- comes back whose job columns are NULL. A worker's claims end each token in
-- its tag (receipts.statements.claim_query), naming the lease's holder.
WITH flow AS (
  -- The effective reason (docs/design.md §11): a Retry-After (or operator's)
  -- pause ends by itself when its time is up; an outage, auth or rejecting
  -- pause ends only when a probe is answered. The cause columns apply while
  -- pause_cause_until = paused_until (a released worker that extended the
  -- pause wrote only pause_reason). pause_left counts down to the next probe
  -- of a probed pause (probe_until), or to the end of any other.
  SELECT CASE WHEN pause_reason IS NULL
                OR (pause_reason = 'retry_after' AND paused_until <= statement_timestamp())
              THEN NULL
              WHEN pause_cause_until = paused_until THEN coalesce(pause_cause, pause_reason)
              ELSE pause_reason END AS pause_reason,
         extract(epoch FROM CASE WHEN pause_reason IN ('outage', 'auth')
                                 THEN coalesce(probe_until, paused_until)
                                 ELSE paused_until END
                            - statement_timestamp())::float8 AS pause_left
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
  SELECT CASE WHEN pause_reason IS NULL
                OR (pause_reason = 'retry_after' AND paused_until <= statement_timestamp())
              THEN NULL
              WHEN pause_cause_until = paused_until THEN coalesce(pause_cause, pause_reason)
              ELSE pause_reason END AS pause_reason,
         extract(epoch FROM CASE WHEN pause_reason IN ('outage', 'auth')
                                 THEN coalesce(probe_until, paused_until)
                                 ELSE paused_until END
                            - statement_timestamp())::float8 AS pause_left,
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
-- Python, which cost the worker CPU per acked job (bench/README.md).
-- The lease test is written through coalesce() so that the planner cannot
-- estimate it from the column's statistics: nearly every row has no lease,
-- so it would expect the test to leave about one row of the table, and for a
-- few hundred pairs on a small table (a custom plan, which knows the list's
-- length) it chose to scan the table once and compare every row it kept with
-- every pair (bench/README.md, "The database's bill"). The meaning is the
-- same: no lease is never unexpired.
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
  AND coalesce(j.lease_until, '-infinity') > statement_timestamp()
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
  AND coalesce(j.lease_until, '-infinity') > statement_timestamp()  -- as in ack
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
-- %(reason)s (auth, outage, retry_after or rejecting). Never shortens a pause:
-- the later end wins, and with it its reason and cause. A systemic rejection
-- is stored as pause_reason 'outage' (what a released worker understands: it
-- is probed like one) with pause_cause 'rejecting'; pause_cause_until marks
-- the end the cause belongs to. A new pause starts at %(seconds)s; an active
-- one's pause_seconds (the length a failed probe doubles) only grows. The next
-- probe may start %(next_probe_seconds)s from now (probe_until, never later
-- than the pause's end), whatever the pause has grown to; a probe in flight
-- loses its claim to resume (probe_until changed): the provider failed again.
-- %(probe_outcome)s, when not NULL, records the failed probe's answer.
-- The operator's note and author belong to the pause they were written with:
-- an extension that wins clears them. The row lock (FOR UPDATE) makes
-- concurrent extensions judge against each other's result.
WITH cur AS (
  SELECT paused_until,
         CASE WHEN pause_reason IS NULL
                OR (pause_reason = 'retry_after' AND paused_until <= statement_timestamp())
              THEN NULL
              WHEN pause_cause_until = paused_until THEN coalesce(pause_cause, pause_reason)
              ELSE pause_reason END AS pause_reason,
         pause_cause_until = paused_until AS cause_valid
  FROM {schema}.receipt_flow WHERE id = 1
  FOR UPDATE
), n AS (
  SELECT statement_timestamp() + make_interval(secs => %(seconds)s) AS until,
         c.pause_reason IS NOT NULL AS active,
         c.paused_until IS NULL OR c.pause_reason IS NULL
           OR statement_timestamp() + make_interval(secs => %(seconds)s) > c.paused_until AS wins,
         c.pause_reason IS NOT NULL AND coalesce(c.cause_valid, false)
           AND c.pause_reason = %(reason)s::text AS same
  FROM cur AS c
)
UPDATE {schema}.receipt_flow AS f
SET pause_reason = CASE WHEN NOT n.wins THEN f.pause_reason
                        WHEN %(reason)s::text = 'rejecting' THEN 'outage'
                        ELSE %(reason)s::text END,
    paused_until = CASE WHEN n.wins THEN n.until ELSE f.paused_until END,
    pause_seconds = CASE WHEN n.active THEN greatest(f.pause_seconds, %(seconds)s)
                         ELSE %(seconds)s END,
    probe_until = least(CASE WHEN n.wins THEN n.until ELSE f.paused_until END,
                        statement_timestamp() + make_interval(secs => %(next_probe_seconds)s)),
    pause_cause = CASE WHEN n.wins THEN %(reason)s::text ELSE f.pause_cause END,
    pause_cause_until = CASE WHEN n.wins THEN n.until ELSE f.pause_cause_until END,
    pause_note = CASE WHEN n.wins THEN NULL ELSE f.pause_note END,
    paused_by = CASE WHEN n.wins THEN NULL ELSE f.paused_by END,
    paused_at = CASE WHEN NOT n.wins THEN f.paused_at
                     WHEN n.same THEN coalesce(f.paused_at, statement_timestamp())
                     ELSE statement_timestamp() END,
    last_probe_at = CASE WHEN %(probe_outcome)s::text IS NULL THEN f.last_probe_at
                         ELSE statement_timestamp() END,
    last_probe_outcome = coalesce(left(%(probe_outcome)s::text, 64), f.last_probe_outcome)
FROM n
WHERE f.id = 1
RETURNING CASE WHEN pause_reason IS NULL
                OR (pause_reason = 'retry_after' AND paused_until <= statement_timestamp())
              THEN NULL
              WHEN pause_cause_until = paused_until THEN coalesce(pause_cause, pause_reason)
              ELSE pause_reason END,
          extract(epoch FROM CASE WHEN pause_reason IN ('outage', 'auth')
                                  THEN coalesce(probe_until, paused_until)
                                  ELSE paused_until END
                             - statement_timestamp())::float8,
          pause_seconds;

-- name: begin_probe
-- An outage, auth or rejecting pause is due for a probe: exactly one pod wins
-- the right to claim the probe's jobs (the row lock serialises contenders, and a
-- loser re-checks the WHERE against the winner's probe_until). A probe is due
-- at probe_until (set by extend_pause: a short interval after the last
-- failure, whatever the pause's length) or, when that is NULL (a released
-- worker's extension), at the pause's end. If the winner dies, another pod may
-- probe once %(guard_seconds)s have passed. Returns the effective reason.
UPDATE {schema}.receipt_flow
SET probe_until = statement_timestamp() + make_interval(secs => %(guard_seconds)s)
WHERE id = 1
  AND pause_reason IN ('outage', 'auth')
  AND coalesce(probe_until, paused_until) <= statement_timestamp()
RETURNING CASE WHEN pause_reason IS NULL
                OR (pause_reason = 'retry_after' AND paused_until <= statement_timestamp())
              THEN NULL
              WHEN pause_cause_until = paused_until THEN coalesce(pause_cause, pause_reason)
              ELSE pause_reason END,
          probe_until, pause_seconds;

-- name: resume
-- The provider answered the probe properly: end the pause, unless it changed
-- since the probe began (an extension or another pod's probe replaced
-- probe_until, or an operator's pause replaced the reason), and record the
-- probe's answer. The pause may end before its nominal paused_until: the
-- probe proved the provider is back.
UPDATE {schema}.receipt_flow
SET pause_reason = NULL, paused_until = NULL, pause_seconds = 0, probe_until = NULL,
    pause_cause = NULL, pause_cause_until = NULL, pause_note = NULL, paused_by = NULL,
    paused_at = NULL,
    last_probe_at = statement_timestamp(), last_probe_outcome = left(%(probe_outcome)s::text, 64)
WHERE id = 1
  AND pause_reason IN ('outage', 'auth')
  AND probe_until = %(probe_until)s
RETURNING 1;

-- name: flow_state
-- The fleet-wide provider state, for gauges and review: the effective reason,
-- seconds to the pause's end, its length, and the bucket's tokens.
SELECT CASE WHEN pause_reason IS NULL
                OR (pause_reason = 'retry_after' AND paused_until <= statement_timestamp())
              THEN NULL
              WHEN pause_cause_until = paused_until THEN coalesce(pause_cause, pause_reason)
              ELSE pause_reason END,
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
-- No FOR UPDATE SKIP LOCKED: locking a row before deleting it wrote one more
-- WAL record per job, as large as the delete's own (bench/README.md, "The
-- database's bill"), and the delete locks the row anyway. The DELETE itself
-- repeats the retention condition, so a row that changed after the CTEs read
-- it (an operator's retry: ready again, finished_at NULL) is re-checked under
-- its lock and left alone. Two sweeps at once (the chart forbids it) wait on
-- each other's rows for a batch instead of skipping them.
WITH old AS (
  SELECT id
  FROM {schema}.receipt_jobs
  WHERE state IN ('done', 'failed')
    AND finished_at < statement_timestamp() - make_interval(secs => %(retention_seconds)s)
  ORDER BY finished_at, id
  LIMIT %(batch)s
), old_discarded AS (
  SELECT id
  FROM {schema}.receipt_jobs
  WHERE state = 'discarded'
    AND finished_at < statement_timestamp() - make_interval(secs => %(retention_seconds)s)
  ORDER BY finished_at, id
  LIMIT %(batch)s
), deleted AS (
  DELETE FROM {schema}.receipt_jobs AS j
  USING (SELECT id FROM old UNION ALL SELECT id FROM old_discarded) AS o
  WHERE j.id = o.id
    AND j.state IN ('done', 'failed', 'discarded')
    AND j.finished_at < statement_timestamp() - make_interval(secs => %(retention_seconds)s)
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
-- a heap visit per ready row (bench/README.md has what that costs), nothing
-- when the queue is drained. The oldest finished row (done, failed or
-- discarded) is what pruning keeps within the retention: the first live entry
-- of two partial indexes on finished_at.
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
     WHERE database = current_database() OR database IS NULL) AS xmin_replication_slot,
  coalesce(extract(epoch FROM statement_timestamp() - least(
    (SELECT min(finished_at) FROM {schema}.receipt_jobs WHERE state IN ('done', 'failed')),
    (SELECT min(finished_at) FROM {schema}.receipt_jobs WHERE state = 'discarded'))), 0)
    AS oldest_finished_seconds
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
-- review_count, retry_jobs, discard_jobs and the bulk actions' bulk_step,
-- over receipt_jobs AS j and the job's latest attempt record AS la (reason,
-- status). {state} is a literal state (so the planner can use that state's
-- partial index), {key} the time column of the list (finished_at; run_at for
-- ready jobs, lease_until for running ones) and {cutoff_key} the column a
-- bulk action's confirmation time bounds (finished_at; created_at for ready
-- and running jobs: a job that reaches the state after the confirmation is
-- never part of it). A NULL parameter means "any"; order_contains is a plain
-- substring (no patterns); expired picks running jobs whose lease has (true)
-- or has not (false) run out.
j.state = {state}
AND (%(reason)s::text IS NULL OR la.reason = %(reason)s::text)
AND (%(status)s::int IS NULL OR la.status = %(status)s::int)
AND (%(since)s::timestamptz IS NULL OR j.{key} >= %(since)s::timestamptz)
AND (%(until)s::timestamptz IS NULL OR j.{key} < %(until)s::timestamptz)
AND (%(order_contains)s::text IS NULL OR strpos(j.order_id, %(order_contains)s::text) > 0)
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
       j.{key} AS sort_at, la.reason, la.status, w.pod AS holder
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
-- The provider pause as the workers' flow control recorded it, with its
-- effective reason (as the claims read it) and the last probe's answer.
SELECT CASE WHEN pause_reason IS NULL
                OR (pause_reason = 'retry_after' AND paused_until <= statement_timestamp())
              THEN NULL
              WHEN pause_cause_until = paused_until THEN coalesce(pause_cause, pause_reason)
              ELSE pause_reason END AS pause_reason,
       paused_until, pause_seconds,
       greatest(extract(epoch FROM paused_until - statement_timestamp())::float8, 0)
         AS remaining_seconds,
       last_probe_at, last_probe_outcome
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

-- name: wal_position
-- How far this server has inserted and flushed its write-ahead log, in bytes
-- from 0/0. A commit that returned before this statement started is at or
-- below its insert position; once a later read's flush position reaches
-- that, the commit is durable (the completer counts an asynchronously
-- committed outcome only then, docs/design.md §2). Any role may call both
-- functions; no table, no lock.
SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), '0/0')::int8,
       pg_wal_lsn_diff(pg_current_wal_flush_lsn(), '0/0')::int8;
