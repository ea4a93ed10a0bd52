-- The worker's and recovery's statements, one named block each: claim, ack,
-- reschedule, flow control, wake-ups, the queue gauges, attempt history, the
-- heartbeat, recovery. jobqueue.py runs them (waker.py the wake-up blocks); a
-- method there carries the name of the block it runs. The operator's
-- statements are in operations.sql, the orders service's in enqueue.sql.
-- Each state transition names the state it expects, so a late writer changes
-- nothing. Time is always the database's statement_timestamp().

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
-- The elected waker's look at the queue, every few tens of milliseconds
-- (receipts/waker.py). Four index probes, each a few pages however long the
-- queue:
-- * tail: the newest due, claimable ready job at or after the previous
--   watermark (the due part of the ready index read backwards from now, and
--   no further back than the watermark: with no ready job there, an unbounded
--   scan walked every entry a long reader keeps alive below it, and at a
--   calm rate some probes find the queue empty). When it differs from
--   the tail the previous probe saw (%(seen_run_at)s, %(seen_id)s), new due
--   work appeared (a job committed, or a scheduled or retried one became
--   due). A row below the watermark is the sweep's: once it lowers the
--   watermark, the row is the head, stuck, and wakes a pod.
-- * head: the oldest ready job at or after the previous watermark
--   (%(from_run_at)s, %(from_id)s; NULLs: the index's start). The new
--   watermark is the head, or now - %(margin_seconds)s when that is lower
--   (with the nil id): a job that becomes ready from a statement that began
--   less than the margin ago is never below it. Claims start their scan
--   there (claim); the caller sweeps below it now and then (waker_sweep).
-- * due: how many due jobs wait from the watermark on, counted up to 256 (a
--   literal: a bind LIMIT lets the generic plan fall to a bitmap scan of the
--   whole due part, docs/design.md §10; 256 jobs fill 8 pods of 32 slots, and
--   a longer backlog keeps the head stuck, which wakes the next pods).
-- * stuck: the head is due and has waited %(stuck_seconds)s or more.
-- Wake-ups come from this statement's own short transaction, never an
-- order's, and only when not paused (the claim's pause rule). A notifying
-- commit costs every LISTEN session of the database a signal, whatever the
-- channel, so new work that the waker's own pod can take whole is its alone:
-- %(local)s is what that pod could claim now when it is a member (its free
-- slots within its throttles: Worker._waker_free_slots; NULL: it is none),
-- and when it is at least the due jobs (the head not stuck) the statement
-- returns wake_self and notifies nobody. Otherwise, or for a stuck head, the
-- pods named (%(channels)s, their own channels in turn, the waker's own
-- among them, and %(before)s, the free slots of the pods ahead of each one,
-- added up by the caller) are woken while the free slots ahead of them are
-- fewer than the due jobs, each with the watermark as payload ('<microseconds
-- since 1970> <id>'), and the statement returns how many it woke. All or
-- nothing: a waker's pod that took part of the work while others were woken
-- for the rest would race them for the same rows (at 16 pods, whose shares
-- of the rate limit are below the order rate, 15 % of claims came back
-- empty). At a calm rate the waker's pod takes the new work alone and no
-- probe notifies (bench/README.md, "The waker's probe").
-- New work that woke a member on its channel also notifies %(channel)s
-- (receipts_ready), for every listener that is no member (released workers
-- during an upgrade, pods without a tag): with no pod named the payload is
-- empty and every pod wakes; with pods named it is 'members', which members
-- ignore (they were woken on their own channels). %(heartbeat)s
-- also notifies the waker channel (payload: the schema, what released pods
-- listen for) and, with %(shares)s, the fleet channel: a JSON object with the
-- schema, each pod's share of the rate limit and the watermark.
-- The plan is kept small, because the waker sets it up 14 times a second and
-- that set-up was a third of its session's CPU (bench/README.md, "The waker's
-- probe"): the decision is one row (MATERIALIZED: it is read twice and must
-- be computed once), the due count a sub-select, the wake-ups a lateral
-- aggregate over the channels; no window, sort or join of CTEs.
WITH tail AS (
  SELECT run_at, id
  FROM {schema}.receipt_jobs
  WHERE state = 'ready'
    AND run_at <= statement_timestamp()
    AND attempts < %(max_attempts)s
    AND (run_at, id) >= (coalesce(%(from_run_at)s::timestamptz, '-infinity'),
                         coalesce(%(from_id)s::uuid, '00000000-0000-0000-0000-000000000000'))
  ORDER BY run_at DESC, id DESC
  LIMIT 1
), head AS (
  SELECT run_at, id
  FROM {schema}.receipt_jobs
  WHERE state = 'ready'
    AND attempts < %(max_attempts)s
    AND (run_at, id) >= (coalesce(%(from_run_at)s::timestamptz, '-infinity'),
                         coalesce(%(from_id)s::uuid, '00000000-0000-0000-0000-000000000000'))
  ORDER BY run_at, id
  LIMIT 1
), decided AS MATERIALIZED (
  SELECT t.run_at, t.id,
         CASE WHEN h.run_at < c.at THEN h.run_at ELSE c.at END AS mark_run_at,
         CASE WHEN h.run_at < c.at THEN h.id
              ELSE '00000000-0000-0000-0000-000000000000'::uuid END AS mark_id,
         coalesce(h.run_at <= statement_timestamp()
                  - make_interval(secs => %(stuck_seconds)s), false) AS stuck,
         (SELECT count(*) FROM (
            SELECT 1
            FROM {schema}.receipt_jobs
            WHERE state = 'ready'
              AND run_at <= statement_timestamp()
              AND attempts < %(max_attempts)s
              AND (run_at, id) >= (coalesce(%(from_run_at)s::timestamptz, '-infinity'),
                                   coalesce(%(from_id)s::uuid, '00000000-0000-0000-0000-000000000000'))
            ORDER BY run_at, id
            LIMIT 256) AS d) AS due,
         t.id IS NOT NULL
         AND (t.run_at, t.id) IS DISTINCT FROM (%(seen_run_at)s::timestamptz, %(seen_id)s::uuid)
           AS fresh,
         NOT EXISTS (
           SELECT 1 FROM {schema}.receipt_flow
           WHERE id = 1
             AND {schema}.receipts_pause_reason(pause_reason, paused_until, pause_cause,
                                                pause_cause_until, statement_timestamp())
                 IS NOT NULL
         ) AS open
  FROM (SELECT statement_timestamp() - make_interval(secs => %(margin_seconds)s) AS at) AS c
  LEFT JOIN tail AS t ON true LEFT JOIN head AS h ON true
)
SELECT d.run_at, d.id, d.open AND d.fresh AND d.nobody OR w.n > 0 OR d.self AS wake,
       d.mark_run_at, d.mark_id, d.due, w.n,
       CASE WHEN d.open AND d.fresh AND (d.nobody OR w.n > 0)
            THEN pg_notify(%(channel)s, CASE WHEN d.nobody THEN '' ELSE 'members' END) END,
       CASE WHEN %(heartbeat)s THEN pg_notify(%(waker_channel)s, %(schema_name)s) END,
       CASE WHEN %(heartbeat)s AND %(shares)s::jsonb IS NOT NULL
            THEN pg_notify(%(fleet_channel)s, jsonb_build_object(
                   'schema', %(schema_name)s::text, 'shares', %(shares)s::jsonb,
                   'after', (extract(epoch FROM d.mark_run_at) * 1000000)::int8
                            || ' ' || d.mark_id)::text) END,
       d.self AS wake_self, d.stuck
FROM (
  SELECT d.*,
         d.open AND d.fresh AND NOT d.stuck AND d.due > 0
           AND coalesce(%(local)s::int, 0) >= d.due AS self,
         coalesce(cardinality(%(channels)s::text[]), 0) = 0 AS nobody
  FROM decided AS d
) AS d CROSS JOIN LATERAL (
  SELECT count(pg_notify(g.channel, (extract(epoch FROM d.mark_run_at) * 1000000)::int8
                                    || ' ' || d.mark_id)) AS n
  FROM unnest(%(channels)s::text[], %(before)s::int[]) AS g(channel, before)
  WHERE d.open AND (d.fresh OR d.stuck) AND d.due > 0 AND NOT d.self AND g.before < d.due
) AS w;

-- name: waker_sweep
-- The backstop below the watermark, run by the waker now and then: the oldest
-- claimable ready job below (%(below_run_at)s, %(below_id)s) and no more than
-- %(reach_seconds)s of run_at below it (NULL: from the index's start, the
-- full sweep), if any, and the time the database spent on it (by its own
-- clock, so neither the round trip nor a busy client counts). A row gets
-- there when it becomes visible after the watermark passed it: a back-dated
-- run_at, a transaction that commits long after it began (its now() is its
-- start). The waker then lowers the watermark to it and wakes a pod. It walks
-- what the claims skip (entries of claimed jobs a long reader keeps alive):
-- the full sweep runs less often while it is slow, and between two full
-- sweeps the near one covers the last NEAR_SECONDS below the watermark, where
-- late commits land (receipts/waker.py). The reach is subtracted here, in
-- absolute time: the watermark arrives in the session's time zone, and
-- Python's arithmetic on it is wall-clock time, wrong across a daylight-saving
-- change. Both bounds are the ready index's Index Cond
-- (tests/integration/test_watermark.py). Always one row (NULLs: none found).
SELECT s.run_at, s.id, clock_timestamp() - statement_timestamp() AS spent
FROM (SELECT 1) AS one
LEFT JOIN LATERAL (
  SELECT run_at, id
  FROM {schema}.receipt_jobs
  WHERE state = 'ready'
    AND attempts < %(max_attempts)s
    AND (run_at, id) >= (coalesce(%(below_run_at)s::timestamptz
                                  - make_interval(secs => %(reach_seconds)s::float8),
                                  '-infinity'::timestamptz),
                         '00000000-0000-0000-0000-000000000000'::uuid)
    AND (run_at, id) < (%(below_run_at)s::timestamptz, %(below_id)s::uuid)
  ORDER BY run_at, id
  LIMIT 1
) AS s ON true;

-- name: member_lock
-- A pod says it is alive on its LISTEN session: a session advisory lock on
-- (%(key)s, the pod's tag as a 32-bit number), held until the session ends,
-- so a pod killed with kill -9 drops out of the fleet at once. Read by
-- fleet_members; written nowhere.
SELECT pg_try_advisory_lock(%(key)s::int4, %(tag)s::int4);

-- name: fleet_members
-- The live pods, for the waker (once per heartbeat): every member_lock held
-- in this database for this queue (%(key)s), with what the pod's last
-- heartbeat row says of its slots and deliveries in flight (NULLs: no row
-- yet). No table is written; pg_locks is readable by every role.
SELECT m.tag, w.slots, w.inflight
FROM (
  SELECT lpad(to_hex(l.objid::int8), 8, '0') AS tag
  FROM pg_locks AS l
  WHERE l.locktype = 'advisory' AND l.objsubid = 2 AND l.granted
    AND l.classid = %(key)s::int8::oid
    AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
) AS m
LEFT JOIN {schema}.receipt_workers AS w ON w.tag = m.tag
ORDER BY m.tag;

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
-- The scan starts at the watermark (%(after_run_at)s, %(after_id)s): the
-- oldest ready (run_at, id) as the fleet's waker last saw it (receipts.waker;
-- NULLs: from the index's start). Below it lie only the entries of jobs
-- claimed since, which vacuum has not removed yet and which a long reader's
-- snapshot keeps alive; the claim no longer steps over them one by one
-- (docs/design.md, "Calm-day wake-ups"). A row that becomes ready below the
-- watermark is found by the waker's sweep, which lowers it.
WITH flow AS (
  -- The effective reason (receipts_pause_reason, migration 0008; inlined by
  -- the planner): a Retry-After (or operator's) pause ends by itself when its
  -- time is up; an outage, auth or rejecting pause ends only when a probe is
  -- answered. pause_left counts down to the next probe of a probed pause
  -- (probe_until), or to the end of any other.
  SELECT {schema}.receipts_pause_reason(pause_reason, paused_until, pause_cause,
                                        pause_cause_until, statement_timestamp())
           AS pause_reason,
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
    AND (run_at, id) >= (coalesce(%(after_run_at)s::timestamptz, '-infinity'),
                         coalesce(%(after_id)s::uuid, '00000000-0000-0000-0000-000000000000'))
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
-- The claim under the fleet-wide rate limit when the pod has no share of its
-- own (no waker heard: behind PgBouncer, RECEIPTS_LISTEN_NOTIFY off, or while
-- a new waker is elected; receipts.ratelimit): the token bucket row is locked,
-- refilled by rate x elapsed (capped at the burst), and charged exactly one
-- token per job this statement returns, in the same transaction: never a
-- token for an unclaimed job, never a job without a token. At most
-- floor(tokens) of the locked candidates are claimed; the others stay ready.
-- It writes the one shared row on every call, so a fleet that hears its
-- waker claims with `claim` and a local bucket instead.
WITH flow AS MATERIALIZED (
  SELECT {schema}.receipts_pause_reason(pause_reason, paused_until, pause_cause,
                                        pause_cause_until, statement_timestamp())
           AS pause_reason,
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
    AND (run_at, id) >= (coalesce(%(after_run_at)s::timestamptz, '-infinity'),
                         coalesce(%(after_id)s::uuid, '00000000-0000-0000-0000-000000000000'))
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
-- Every answer also carries the server's WAL positions (the wal_position
-- block's two columns), read while the statement runs; with no job acked one
-- row comes back whose id is NULL. The completer's durability watch takes
-- them as one more read, so a worker that acks steadily proves its earlier
-- asynchronous commits without a statement of its own (receipts.durability;
-- docs/design.md §2).
-- At a trickle an ack usually rides on the worker's next claim instead: its two
-- CTEs (done, wal) go first in that claim statement (receipts.statements.claim_query),
-- which then also returns the acked ids and the positions.
WITH done AS (
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
  RETURNING j.id
), wal AS (
  SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), '0/0')::int8 AS insert_lsn,
         pg_wal_lsn_diff(pg_current_wal_flush_lsn(), '0/0')::int8 AS flush_lsn
)
SELECT d.id, w.insert_lsn, w.flush_lsn
FROM wal AS w LEFT JOIN done AS d ON true;

-- name: reschedule
-- Failed attempts (known failures and unknown outcomes) in one statement,
-- each guarded like ack. A row becomes ready again after its delay, or failed
-- when its failure is permanent or its attempts are used up: never a ready
-- row with attempts >= max. An attempt is given back (attempts - 1) when
-- `refund` is set (the provider was in a fleet-wide outage) or when the
-- provider answered 409 "in progress" and the job's in_progress_count is
-- still under %(max_in_progress)s. A NULL error keeps the job's last_error (an
-- attempt claimed ahead and given back unsent: receipts.worker's prefetch).
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
    last_error = coalesce(r.error, j.last_error)
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
         {schema}.receipts_pause_reason(pause_reason, paused_until, pause_cause,
                                        pause_cause_until, statement_timestamp())
           AS pause_reason,
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
RETURNING {schema}.receipts_pause_reason(pause_reason, paused_until, pause_cause,
                                          pause_cause_until, statement_timestamp()),
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
RETURNING {schema}.receipts_pause_reason(pause_reason, paused_until, pause_cause,
                                          pause_cause_until, statement_timestamp()),
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

-- name: recover_expired
-- One bounded batch of abandoned attempts; the caller commits each batch.
-- Each returned row also gets a `lease_expired` record in its attempt history
-- (through receipts_record_attempts, as record_attempts; worker = this session's
-- application_name; no status or duration: nobody saw the attempt end). The
-- function runs once per batch (recorded is one row, referenced by the final
-- SELECT so that it runs); when nothing moved its arrays are NULL and it writes
-- nothing.
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
  SELECT {schema}.receipts_record_attempts(
    array_agg(m.id), array_agg(m.attempts), array_agg('lease_expired'::text),
    array_agg(NULL::int), array_agg('lease expired'::text), array_agg(NULL::float8),
    array_agg(left(current_setting('application_name'), 100))) AS written
  FROM moved AS m
)
SELECT m.state FROM moved AS m CROSS JOIN recorded AS r;

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
-- through its own partial index), with their attempt histories, deleted by
-- receipts_prune() (migration 0009, its text there): a SECURITY DEFINER
-- function, so the recover role holds no DELETE and cannot remove a ready or
-- running job. No FOR UPDATE SKIP LOCKED: locking a row before deleting it
-- wrote one more WAL record per job, as large as the delete's own
-- (bench/README.md, "The database's bill"), and the delete locks the row
-- anyway. The DELETE repeats the retention condition, so a row that changed
-- after it was read (an operator's retry: ready again, finished_at NULL) is
-- re-checked under its lock and left alone. Two sweeps at once (the chart
-- forbids it) wait on each other's rows for a batch instead of skipping them.
SELECT id FROM {schema}.receipts_prune(%(retention_seconds)s::float8, %(batch)s::int) AS id;

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

-- ------------------------------------------------------------------------
-- Worker heartbeats (migration 0007).

-- name: heartbeat
-- One worker process says it is alive: an upsert of its own row, about every
-- 20 s (never per claim). Times are the database's: the worker sends how long
-- ago it started and last claimed (seconds; NULL: never). started_at is kept
-- from the first heartbeat; stopped is sent once, by a draining worker.
INSERT INTO {schema}.receipt_workers AS w
  (tag, pod, pid, version, slots, inflight, claimed_total, started_at, seen_at,
   last_claim_at, stopped_at, concurrency_limit)
VALUES (%(tag)s, left(%(pod)s, 100), %(pid)s, left(%(version)s, 40), %(slots)s, %(inflight)s,
        %(claimed_total)s,
        statement_timestamp() - make_interval(secs => %(uptime_seconds)s),
        statement_timestamp(),
        statement_timestamp() - make_interval(secs => %(since_claim_seconds)s),
        CASE WHEN %(stopped)s THEN statement_timestamp() END, %(concurrency_limit)s)
ON CONFLICT (tag) DO UPDATE
SET pod = excluded.pod, pid = excluded.pid, version = excluded.version,
    slots = excluded.slots, inflight = excluded.inflight,
    claimed_total = excluded.claimed_total, seen_at = excluded.seen_at,
    last_claim_at = coalesce(excluded.last_claim_at, w.last_claim_at),
    stopped_at = excluded.stopped_at, concurrency_limit = excluded.concurrency_limit;

-- name: fleet_concurrency_limit
-- The mean adaptive concurrency limit of the workers heard within the last
-- minute that report one (migration 0011), and how many do: where a starting
-- worker's limit begins (receipts.capacity). NULL mean: none reports one.
SELECT avg(concurrency_limit)::float8, count(concurrency_limit)
FROM {schema}.receipt_workers
WHERE seen_at > statement_timestamp() - interval '60 seconds' AND stopped_at IS NULL
  AND concurrency_limit IS NOT NULL;

-- name: forget_workers
-- Heartbeat rows not seen for %(seconds)s (a starting worker runs this once).
DELETE FROM {schema}.receipt_workers
WHERE seen_at < statement_timestamp() - make_interval(secs => %(seconds)s);

-- ------------------------------------------------------------------------
-- Attempt history (migration 0005).

-- name: record_attempts
-- Many attempt records (parallel arrays, one element per attempt) in one
-- statement, after the attempts' acks or reschedules, appended through
-- receipts_record_attempts() (migration 0009): the history is append-only for
-- every service role, which may call the function and holds no write on the
-- table. Each job keeps its last 20 records in a ring: seq = the job's previous
-- highest seq + 1 (several records of one job in a batch get consecutive
-- numbers, in array order), slot = (seq - 1) % 20, and a newer record
-- overwrites the slot's older one. Records of jobs that no longer exist
-- (pruned) are dropped. Two writers that race on the same job and slot keep the
-- first record.
SELECT {schema}.receipts_record_attempts(
  %(job_ids)s::uuid[], %(attempts)s::int[], %(reasons)s::text[], %(statuses)s::int[],
  %(errors)s::text[], %(durations)s::float8[], %(workers)s::text[]);

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
