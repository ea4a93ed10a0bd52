-- Every rule enforced by the database, for every role (docs/design.md, "Least-privilege
-- roles" and "Constraints"). Expand-only: released workers' statements keep working
-- (tests/compat); what changes for a role is what `receipts migrate --print-grants`
-- prints for it, applied by the DBA after the fleet runs this release.
--
-- 1. The order-id and run_at rules of receipts_enqueue() become CHECK constraints, so an
--    INSERT by any role (the Python API's, a hand-written one) is refused the same rows:
--    an empty id, one longer than 200 characters, one with a control character
--    (U+0001-U+001F, U+007F; text cannot hold NUL) or leading or trailing whitespace
--    (Python's str.isspace set, as receipts.enqueue.check_order_id), a run_at that is not
--    finite. The rules bind pending rows (ready, running): a finished row (done, failed,
--    discarded) is exempt, so a row written before this migration that breaks them can
--    still be failed, discarded and pruned, and an ack (a row becoming done) skips the
--    regular expression. Nothing makes a finished row pending again without an UPDATE,
--    which the constraint checks (an operator's retry of such a row is refused).
--    A CHECK constraint is evaluated on every write of a row, so the claim pays the
--    regular expression once per job too (measured: bench/README.md, "Database rules").
-- 2. Adding a CHECK constraint takes an ACCESS EXCLUSIVE lock on receipt_jobs, and
--    validating it scans the table. Both are split: this file adds them NOT VALID (the
--    lock is held for no scan; new and updated rows are checked from the commit on), and
--    `receipts migrate` validates them afterwards in a transaction of its own, which holds
--    only SHARE UPDATE EXCLUSIVE (claims, acks and enqueues go on during the scan;
--    migrate.validate_constraints). Pending rows that break the rules are failed first
--    (below), through the ready and running partial indexes and before the lock is taken,
--    so a claim never meets a row it could not write.
-- 3. A job becomes done only through the ack's guard: the row was running under an
--    unexpired lease and the write records that lease's token as last_token (what ack
--    writes, and 0.2.0's ack too). A BEFORE UPDATE OF state trigger whose WHEN clause
--    is the guard: evaluated as an expression per row (no function call unless it
--    refuses), for every role.
-- 4. The attempt history is written only through receipts_record_attempts() (SECURITY
--    DEFINER): roles get EXECUTE on it and no INSERT, UPDATE or DELETE on
--    receipt_attempts, so a worker, review or recover role can append a record (the ring
--    overwrites the job's oldest when it holds 20) but cannot edit or remove one.
-- 4b. receipts_enqueue() relies on the table: it runs with its caller's rights (SECURITY
--    INVOKER, no pinned search_path), so a role that calls it needs what the Python API's
--    role holds: INSERT on the four columns an enqueue writes and SELECT on id (RETURNING).
--    Its insert's conflict has no target column (naming order_id there needs SELECT on
--    it, the right to read every order id). Column rights keep state, attempts and the
--    lease at their defaults, and the constraints above refuse what its checks refuse,
--    so a direct INSERT by the same role gets no further than the function. It keeps its
--    own checks for their error (invalid_parameter_value, a sentence per rule) and
--    sends no notification. Every role that may EXECUTE it now is granted those column
--    rights here, so no running orders service loses its enqueue in the upgrade. The
--    definer's switch and its pinned search_path cost the checkout about 20 us per call
--    (bench/README.md, "Database rules").
-- 5. Finished rows are pruned only through receipts_prune() (SECURITY DEFINER): it
--    deletes done, failed and discarded rows past the retention the caller gives, with
--    their histories, and nothing else, so the recover role holds no DELETE and cannot
--    delete a ready or running job.
-- Every role that holds INSERT on receipt_attempts (DELETE on receipt_jobs) is granted
-- EXECUTE on receipts_record_attempts() (receipts_prune()) here, so this release runs
-- under the previous release's grants until the DBA applies the new ones.

-- 1. Pending rows that already break the rules would make every claim or outcome write
-- that touches them fail once the constraints hold: fail them now, with the reason.
UPDATE receipt_jobs
SET state = 'failed',
    finished_at = statement_timestamp(),
    run_at = CASE WHEN isfinite(run_at) THEN run_at ELSE statement_timestamp() END,
    lease_token = NULL,
    lease_until = NULL,
    last_error = 'refused by the database rules (migration 0009): the order id is empty, '
                 'longer than 200 characters, has a control character or surrounding '
                 'whitespace, or run_at is not finite'
WHERE state IN ('ready', 'running')
  AND NOT (length(order_id) BETWEEN 1 AND 200
           AND order_id !~ ('[\u0001-\u001f\u007f]'
                            '|^[ \u0085\u00a0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]'
                            '|[ \u0085\u00a0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]$')
           AND isfinite(run_at));

ALTER TABLE receipt_jobs
  ADD CONSTRAINT receipt_jobs_order_id_rules CHECK (
    state IN ('done', 'failed', 'discarded')
    OR (length(order_id) BETWEEN 1 AND 200
        AND order_id !~ ('[\u0001-\u001f\u007f]'
                         '|^[ \u0085\u00a0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]'
                         '|[ \u0085\u00a0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]$'))
  ) NOT VALID,
  ADD CONSTRAINT receipt_jobs_run_at_finite CHECK (
    state IN ('done', 'failed', 'discarded') OR isfinite(run_at)
  ) NOT VALID;

-- 3. done only through the ack's guard.
CREATE FUNCTION receipts_refuse_unguarded_done() RETURNS trigger
LANGUAGE plpgsql
AS $$
BEGIN
  RAISE EXCEPTION 'receipts: job % may become done only through the ack''s lease guard '
                  '(running, an unexpired lease, its token written as last_token)', OLD.id
    USING ERRCODE = 'check_violation', CONSTRAINT = 'receipt_jobs_done_guard';
END
$$;

CREATE TRIGGER receipt_jobs_done_guard
  BEFORE UPDATE OF state ON receipt_jobs
  FOR EACH ROW
  WHEN (NEW.state = 'done'
        AND NOT (OLD.state = 'running'
                 AND OLD.lease_until > statement_timestamp()
                 AND NEW.last_token IS NOT DISTINCT FROM OLD.lease_token))
  EXECUTE FUNCTION receipts_refuse_unguarded_done();

-- 4, 5. The definer functions. Their search_path is pinned to this schema with pg_temp
-- last (left out, pg_temp is searched first and a caller's temporary table could capture
-- a write), and their tables are qualified, as receipts_enqueue()'s are (0006).
DO $migration$
DECLARE
  queue_schema text := current_schema();
  grantee_name text;
BEGIN
  -- receipts_record_attempts(job_ids, attempts, reasons, statuses, errors, durations,
  -- workers): parallel arrays, one element per attempt record; appends each record to
  -- its job's ring of 20 (seq = the job's highest + 1, slot = (seq - 1) % 20; several
  -- records of one job get consecutive numbers in array order); records of jobs that
  -- no longer exist are dropped; text is cut to the columns' limits; a NULL status,
  -- error or duration stays NULL (unknown). Returns how many records were written.
  -- NULL arrays write nothing.
  EXECUTE format($create$
CREATE FUNCTION %1$I.receipts_record_attempts(
  job_ids uuid[], attempts int[], reasons text[], statuses int[], errors text[],
  durations float8[], workers text[]
) RETURNS integer
LANGUAGE sql
VOLATILE
SECURITY DEFINER
SET search_path = %1$I, pg_temp
AS $body$
WITH given AS (
  SELECT a.*,
         row_number() OVER (PARTITION BY a.job_id ORDER BY a.ord) AS k,
         count(*) OVER (PARTITION BY a.job_id) AS n
  FROM unnest($1, $2, $3, $4, $5, $6, $7)
       WITH ORDINALITY AS a(job_id, attempt, reason, status, error, duration_seconds,
                            worker, ord)
  WHERE EXISTS (SELECT 1 FROM %1$I.receipt_jobs AS j WHERE j.id = a.job_id)
), written AS (
  INSERT INTO %1$I.receipt_attempts AS h
    (job_id, slot, seq, attempt, reason, status, error, duration_seconds, worker)
  SELECT g.job_id, mod(s.seq - 1, 20), s.seq, greatest(g.attempt, 0),
         left(g.reason, 64), g.status, left(g.error, 500),
         CASE WHEN g.duration_seconds IS NOT NULL THEN greatest(g.duration_seconds, 0) END,
         left(g.worker, 100)
  FROM given AS g
  CROSS JOIN LATERAL (
    SELECT g.k + coalesce(max(p.seq), 0) AS seq
    FROM %1$I.receipt_attempts AS p WHERE p.job_id = g.job_id
  ) AS s
  WHERE g.k > g.n - 20
  ON CONFLICT (job_id, slot) DO UPDATE
  SET seq = excluded.seq, attempt = excluded.attempt, at = excluded.at,
      reason = excluded.reason, status = excluded.status, error = excluded.error,
      duration_seconds = excluded.duration_seconds, worker = excluded.worker
  WHERE h.seq < excluded.seq
  RETURNING 1
)
SELECT count(*)::int FROM written
$body$
$create$, queue_schema);

  -- receipts_prune(retention_seconds, batch): one bounded batch of finished rows older
  -- than the retention window (up to batch done/failed rows and up to batch discarded
  -- rows, each kind through its own partial index), deleted with their attempt
  -- histories; returns the deleted jobs' ids. The DELETE repeats the retention
  -- condition, so a row that changed after it was read (an operator's retry) is
  -- re-checked under its lock and left alone. Never a ready or running row.
  EXECUTE format($create$
CREATE FUNCTION %1$I.receipts_prune(retention_seconds float8, batch integer)
RETURNS SETOF uuid
LANGUAGE sql
VOLATILE
SECURITY DEFINER
SET search_path = %1$I, pg_temp
AS $body$
WITH old AS (
  SELECT id
  FROM %1$I.receipt_jobs
  WHERE state IN ('done', 'failed')
    AND finished_at < statement_timestamp() - make_interval(secs => $1)
  ORDER BY finished_at, id
  LIMIT $2
), old_discarded AS (
  SELECT id
  FROM %1$I.receipt_jobs
  WHERE state = 'discarded'
    AND finished_at < statement_timestamp() - make_interval(secs => $1)
  ORDER BY finished_at, id
  LIMIT $2
), deleted AS (
  DELETE FROM %1$I.receipt_jobs AS j
  USING (SELECT id FROM old UNION ALL SELECT id FROM old_discarded) AS o
  WHERE j.id = o.id
    AND j.state IN ('done', 'failed', 'discarded')
    AND j.finished_at < statement_timestamp() - make_interval(secs => $1)
  RETURNING j.id
), history AS (
  DELETE FROM %1$I.receipt_attempts AS h
  USING deleted AS d
  WHERE h.job_id = d.id
)
SELECT id FROM deleted
$body$
$create$, queue_schema);

  -- 4b. receipts_enqueue(), as 0006 made it, with the caller's rights.
  EXECUTE format($create$
CREATE OR REPLACE FUNCTION %1$I.receipts_enqueue(
  order_id text,
  run_at timestamptz DEFAULT now(),
  traceparent text DEFAULT NULL
) RETURNS uuid
LANGUAGE plpgsql
VOLATILE
SECURITY INVOKER
AS $body$
#variable_conflict use_column
DECLARE
  new_id uuid;
BEGIN
  IF receipts_enqueue.order_id IS NULL OR receipts_enqueue.order_id = '' THEN
    RAISE EXCEPTION 'receipts: order id must not be empty'
      USING ERRCODE = 'invalid_parameter_value';
  END IF;
  IF length(receipts_enqueue.order_id) > 200 THEN
    RAISE EXCEPTION 'receipts: order id is longer than 200 characters'
      USING ERRCODE = 'invalid_parameter_value';
  END IF;
  IF receipts_enqueue.order_id ~ '[\u0001-\u001f\u007f]' THEN
    RAISE EXCEPTION 'receipts: order id contains control characters'
      USING ERRCODE = 'invalid_parameter_value';
  END IF;
  IF receipts_enqueue.order_id
     ~ ('^[ \u0085\u00a0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]'
        '|[ \u0085\u00a0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]$') THEN
    RAISE EXCEPTION 'receipts: order id starts or ends with whitespace (it could not be sent as an HTTP header)'
      USING ERRCODE = 'invalid_parameter_value';
  END IF;
  IF receipts_enqueue.run_at IS NOT NULL AND NOT isfinite(receipts_enqueue.run_at) THEN
    RAISE EXCEPTION 'receipts: run_at must be a finite time'
      USING ERRCODE = 'invalid_parameter_value';
  END IF;
  INSERT INTO %1$I.receipt_jobs (id, order_id, run_at, traceparent)
  VALUES (gen_random_uuid(), receipts_enqueue.order_id,
          coalesce(receipts_enqueue.run_at, now()), receipts_enqueue.traceparent)
  ON CONFLICT DO NOTHING
  RETURNING id INTO new_id;
  RETURN new_id;
END
$body$
$create$, queue_schema);

  FOR grantee_name IN
    SELECT DISTINCT r.rolname
    FROM pg_proc AS p
    CROSS JOIN LATERAL aclexplode(p.proacl) AS a
    JOIN pg_roles AS r ON r.oid = a.grantee
    WHERE p.oid = format('%I.receipts_enqueue(text, timestamptz, text)', queue_schema)::regprocedure
      AND a.privilege_type = 'EXECUTE' AND r.oid <> p.proowner
  LOOP
    EXECUTE format('GRANT INSERT (id, order_id, run_at, traceparent), SELECT (id) '
                   'ON TABLE %I.receipt_jobs TO %I', queue_schema, grantee_name);
  END LOOP;

  -- The new doors open for every role that holds the rights they replace, so this
  -- release's workers, recovery and review page run under the previous release's grants
  -- (the DBA's next --print-grants takes the old rights away once no older pod runs).
  FOR grantee_name IN
    SELECT DISTINCT r.rolname
    FROM pg_class AS c
    CROSS JOIN LATERAL aclexplode(c.relacl) AS a
    JOIN pg_roles AS r ON r.oid = a.grantee
    WHERE c.oid = format('%I.receipt_attempts', queue_schema)::regclass
      AND a.privilege_type = 'INSERT' AND r.oid <> c.relowner
  LOOP
    EXECUTE format('GRANT EXECUTE ON FUNCTION %I.receipts_record_attempts(uuid[], int[], '
                   'text[], int[], text[], float8[], text[]) TO %I', queue_schema, grantee_name);
  END LOOP;
  FOR grantee_name IN
    SELECT DISTINCT r.rolname
    FROM pg_class AS c
    CROSS JOIN LATERAL aclexplode(c.relacl) AS a
    JOIN pg_roles AS r ON r.oid = a.grantee
    WHERE c.oid = format('%I.receipt_jobs', queue_schema)::regclass
      AND a.privilege_type = 'DELETE' AND r.oid <> c.relowner
  LOOP
    EXECUTE format('GRANT EXECUTE ON FUNCTION %I.receipts_prune(float8, integer) TO %I',
                   queue_schema, grantee_name);
  END LOOP;

  EXECUTE format('REVOKE EXECUTE ON FUNCTION %1$I.receipts_record_attempts(uuid[], int[], '
                 'text[], int[], text[], float8[], text[]) FROM PUBLIC', queue_schema);
  EXECUTE format('REVOKE EXECUTE ON FUNCTION %1$I.receipts_prune(float8, integer) FROM PUBLIC',
                 queue_schema);
  EXECUTE format('REVOKE EXECUTE ON FUNCTION %1$I.receipts_refuse_unguarded_done() FROM PUBLIC',
                 queue_schema);
END
$migration$;

COMMENT ON FUNCTION receipts_record_attempts(uuid[], int[], text[], int[], text[], float8[],
                                             text[]) IS
  'Append attempt records to their jobs'' histories (a ring of 20 per job); the only way a '
  'service role writes receipt_attempts.';
COMMENT ON FUNCTION receipts_prune(float8, integer) IS
  'Delete one batch of finished jobs (done, failed, discarded) older than the retention, '
  'with their histories; never a ready or running job.';
