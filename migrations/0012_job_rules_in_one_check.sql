-- The job row's rules in one CHECK constraint that calls one function.
--
-- receipt_jobs carried nine CHECK constraints (0001, 0003, 0004, 0005, 0009).
-- PostgreSQL prepares every CHECK expression of a table again in every
-- statement that writes a row to it (it reads the stored expression back,
-- simplifies it and builds its evaluator, per constraint), so the nine cost
-- every enqueue, claim, ack and reschedule a fixed 60-80 µs whatever the
-- number of rows (against no CHECK at all: 61 µs of a 107 µs single-row
-- enqueue, 74 of a 266 µs claim of four jobs, 82 of a 415 µs ack of four;
-- bench/README.md, "The job row's rules in one check"). Merged into one
-- expression they cost nearly the same: the price is the expressions'
-- preparation, not their number.
--
-- receipts_job_rules() is every one of those rules, unchanged, as a PL/pgSQL
-- function of the row's columns: a statement prepares one call of it, and
-- PL/pgSQL keeps its expression planned for the session, so a write pays for
-- one function call per row instead. It is
-- * IMMUTABLE and PARALLEL SAFE: it reads its arguments only;
-- * written with every function, operator and type of its body qualified
--   (pg_catalog.length, OPERATOR(pg_catalog.=), pg_catalog.text, …) and no SET
--   clause: a CHECK's own expression is bound to its operators when it is
--   created, but a PL/pgSQL body is resolved with the caller's search_path, so
--   a role that put its own `=` or length() ahead of pg_catalog could
--   otherwise pass its own rows through;
-- * EXECUTE stays with PUBLIC, as for receipts_pause_reason() (0008): it reads
--   and writes nothing, and every role that writes the table must run it.
--   `receipts migrate --print-grants owner=…` hands it to the owner with the
--   tables (its owner could replace it);
-- * true when the row keeps every rule; otherwise it raises check_violation
--   naming the constraint (receipt_jobs_rules) and, in the message, the rule
--   broken by its former constraint's name, so logs and tests that looked for
--   receipt_jobs_order_id_rules or receipt_jobs_traceparent_format still find
--   it. No column's value is echoed (the old constraints' "Failing row
--   contains" detail printed the whole row, order id included).
--
-- The rules (the old constraints' names):
-- * receipt_jobs_state_check: state is ready, running, done, failed or
--   discarded;
-- * receipt_jobs_attempts_check, receipt_jobs_in_progress_count_check: the
--   counters are not negative;
-- * receipt_jobs_check, receipt_jobs_check1: a running row has a lease token
--   and a lease end, any other row neither;
-- * receipt_jobs_finished_check: finished_at is set exactly on done, failed
--   and discarded rows;
-- * receipt_jobs_order_id_rules, receipt_jobs_run_at_finite (0009): a pending
--   row's order id is 1-200 characters with no C0 control character (U+0001-
--   U+001F) and no DEL (U+007F), and no whitespace at either end; its run_at
--   is finite; finished rows are exempt;
-- * receipt_jobs_traceparent_format (0004): a traceparent is NULL or has the
--   shape of a W3C version-00 traceparent (lower-case hex fields; the
--   standard's all-zero ids are not refused).
-- A rule whose test is NULL passes, as a CHECK does.
--
-- The new constraint is added NOT VALID: it holds for every row written from
-- this migration's commit on, and adding it scans nothing under the
-- migration's ACCESS EXCLUSIVE lock (a few milliseconds on any size of
-- table). `receipts migrate` then validates it outside that lock
-- (receipts.migrate.validate_constraints, SHARE UPDATE EXCLUSIVE: claims,
-- acks and enqueues go on).
--
-- Expand and contract at once, safely: released workers and orders services
-- name no constraint, and the one constraint accepts and refuses exactly the
-- rows the nine did (tests/integration/test_database_rules.py).

CREATE FUNCTION receipts_job_rules(
  state text,
  attempts integer,
  in_progress_count integer,
  lease_token uuid,
  lease_until timestamptz,
  finished_at timestamptz,
  order_id text,
  run_at timestamptz,
  traceparent text
) RETURNS boolean
LANGUAGE plpgsql
IMMUTABLE
PARALLEL SAFE
AS $function$
DECLARE
  finished pg_catalog.bool := state OPERATOR(pg_catalog.=) ANY ('{done,failed,discarded}'::pg_catalog.text[]);
  broken pg_catalog.text;
BEGIN
  -- The common case in one expression: every rule holds. The CASE below
  -- alone would give the same answer, but its IS FALSE tests cost 3-4 µs
  -- more per row written (bulk updates of 50,000 rows, median of 6).
  IF state OPERATOR(pg_catalog.=) ANY ('{ready,running,done,failed,discarded}'::pg_catalog.text[])
     AND attempts OPERATOR(pg_catalog.>=) 0
     AND in_progress_count OPERATOR(pg_catalog.>=) 0
     AND (state OPERATOR(pg_catalog.=) 'running') OPERATOR(pg_catalog.=) (lease_token IS NOT NULL)
     AND (lease_token IS NULL) OPERATOR(pg_catalog.=) (lease_until IS NULL)
     AND finished OPERATOR(pg_catalog.=) (finished_at IS NOT NULL)
     AND (finished
          OR (pg_catalog.length(order_id) OPERATOR(pg_catalog.>=) 1
              AND pg_catalog.length(order_id) OPERATOR(pg_catalog.<=) 200
              AND order_id OPERATOR(pg_catalog.!~) ('[\u0001-\u001f\u007f]'
                     '|^[ \u0085\u00a0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]'
                     '|[ \u0085\u00a0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]$')))
     AND (finished OR pg_catalog.isfinite(run_at))
     AND (traceparent IS NULL
          OR traceparent OPERATOR(pg_catalog.~) '^00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$')
  THEN
    RETURN true;
  END IF;
  -- Which rule is broken (the first one, in the order above). A test that is
  -- NULL passes, as it does in a CHECK constraint.
  broken := CASE
    WHEN (state OPERATOR(pg_catalog.=) ANY ('{ready,running,done,failed,discarded}'::pg_catalog.text[])) IS FALSE
      THEN 'receipt_jobs_state_check (state is ready, running, done, failed or discarded)'
    WHEN (attempts OPERATOR(pg_catalog.>=) 0) IS FALSE
      THEN 'receipt_jobs_attempts_check (attempts is not negative)'
    WHEN (in_progress_count OPERATOR(pg_catalog.>=) 0) IS FALSE
      THEN 'receipt_jobs_in_progress_count_check (in_progress_count is not negative)'
    WHEN ((state OPERATOR(pg_catalog.=) 'running') OPERATOR(pg_catalog.=) (lease_token IS NOT NULL)) IS FALSE
      THEN 'receipt_jobs_check (a running job has a lease token, any other none)'
    WHEN ((lease_token IS NULL) OPERATOR(pg_catalog.=) (lease_until IS NULL)) IS FALSE
      THEN 'receipt_jobs_check1 (a lease token and a lease end come together)'
    WHEN (finished OPERATOR(pg_catalog.=) (finished_at IS NOT NULL)) IS FALSE
      THEN 'receipt_jobs_finished_check (finished_at is set exactly on done, failed and discarded jobs)'
    WHEN (finished
          OR (pg_catalog.length(order_id) OPERATOR(pg_catalog.>=) 1
              AND pg_catalog.length(order_id) OPERATOR(pg_catalog.<=) 200
              AND order_id OPERATOR(pg_catalog.!~) ('[\u0001-\u001f\u007f]'
                     '|^[ \u0085\u00a0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]'
                     '|[ \u0085\u00a0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]$'))) IS FALSE
      THEN 'receipt_jobs_order_id_rules (a pending job''s order id is 1-200 characters, with no '
           'control character U+0001-U+001F or U+007F and no whitespace at either end)'
    WHEN (finished OR pg_catalog.isfinite(run_at)) IS FALSE
      THEN 'receipt_jobs_run_at_finite (a pending job''s run_at is finite)'
    WHEN (traceparent IS NULL
          OR traceparent OPERATOR(pg_catalog.~) '^00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$') IS FALSE
      THEN 'receipt_jobs_traceparent_format (a traceparent has the W3C version-00 format)'
  END;
  IF broken IS NULL THEN
    RETURN true;
  END IF;
  RAISE EXCEPTION 'receipts: a receipt_jobs row breaks the rule %', broken
    USING ERRCODE = 'check_violation', CONSTRAINT = 'receipt_jobs_rules',
          TABLE = 'receipt_jobs';
END
$function$;

COMMENT ON FUNCTION receipts_job_rules(text, integer, integer, uuid, timestamptz, timestamptz,
                                       text, timestamptz, text) IS
  'The rules every receipt_jobs row keeps (the receipt_jobs_rules constraint): true, or '
  'check_violation naming the broken rule.';

ALTER TABLE receipt_jobs
  DROP CONSTRAINT receipt_jobs_state_check,
  DROP CONSTRAINT receipt_jobs_attempts_check,
  DROP CONSTRAINT receipt_jobs_in_progress_count_check,
  DROP CONSTRAINT receipt_jobs_check,
  DROP CONSTRAINT receipt_jobs_check1,
  DROP CONSTRAINT receipt_jobs_finished_check,
  DROP CONSTRAINT receipt_jobs_order_id_rules,
  DROP CONSTRAINT receipt_jobs_run_at_finite,
  DROP CONSTRAINT receipt_jobs_traceparent_format,
  ADD CONSTRAINT receipt_jobs_rules CHECK (
    receipts_job_rules(state, attempts, in_progress_count, lease_token, lease_until,
                       finished_at, order_id, run_at, traceparent)
  ) NOT VALID;
