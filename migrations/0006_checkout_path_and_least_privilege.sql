-- The checkout's commit path, least privilege, and richer pause state.
--
-- 1. receipts_enqueue() sends no notification any more. A transaction that
--    has called pg_notify takes one instance-wide lock at commit and holds it
--    through its WAL flush, so every enqueuing checkout commit was serialised
--    behind every other (docs/design.md, "The checkout's commit path").
--    Workers are woken from outside the order's transaction instead.
-- 2. It is SECURITY DEFINER: a role that may only enqueue needs EXECUTE on it
--    (and USAGE on the schema), no right on the table, so it cannot write a
--    done row, an unchecked order id or a job due at 'infinity'. Its
--    search_path is pinned to this schema with pg_temp last, so neither a
--    caller's schema nor a temporary table can shadow receipt_jobs.
--    EXECUTE is revoked from PUBLIC; every role that could already insert
--    into receipt_jobs (and so could call the function before) is granted
--    EXECUTE, so no running orders service loses its enqueue in the upgrade.
-- 3. receipt_flow gains the pause's cause and who set it. pause_reason keeps
--    the three values every released worker understands (a worker that reads
--    a value it does not know would stop claiming): a systemic rejection is
--    written as pause_reason 'outage' (resumed by a probe, as an outage is)
--    and an operator's pause as 'retry_after' (it ends by itself at its time);
--    pause_cause says which it really is, and pause_note, paused_by and
--    paused_at describe it, while pause_cause_until equals paused_until: a
--    released worker that extends or ends the pause writes only the old
--    columns, so its pause is read by its pause_reason alone, and a stale
--    cause never outlives the pause it was written with. No constraint ties
--    the new columns to the old ones, for the same reason. Expand-only:
--    nothing is dropped or renamed.

DO $migration$
DECLARE
  queue_schema text := current_schema();
  grantee_name text;
BEGIN
  EXECUTE format($create$
CREATE OR REPLACE FUNCTION %1$I.receipts_enqueue(
  order_id text,
  run_at timestamptz DEFAULT now(),
  traceparent text DEFAULT NULL
) RETURNS uuid
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = %1$I, pg_temp
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
  ON CONFLICT (order_id) DO NOTHING
  RETURNING id INTO new_id;
  RETURN new_id;
END
$body$
$create$, queue_schema);

  EXECUTE format('REVOKE EXECUTE ON FUNCTION %I.receipts_enqueue(text, timestamptz, text) FROM PUBLIC',
                 queue_schema);
  FOR grantee_name IN
    SELECT DISTINCT r.rolname
    FROM pg_class AS c
    JOIN pg_namespace AS n ON n.oid = c.relnamespace
    CROSS JOIN LATERAL aclexplode(c.relacl) AS a
    JOIN pg_roles AS r ON r.oid = a.grantee
    WHERE n.nspname = queue_schema AND c.relname = 'receipt_jobs'
      AND a.privilege_type = 'INSERT' AND r.oid <> c.relowner
  LOOP
    EXECUTE format('GRANT EXECUTE ON FUNCTION %I.receipts_enqueue(text, timestamptz, text) TO %I',
                   queue_schema, grantee_name);
  END LOOP;
END
$migration$;

COMMENT ON FUNCTION receipts_enqueue(text, timestamptz, text) IS
  'Enqueue the receipt job of one order inside the caller''s transaction; returns the new '
  'job id, or NULL when the order already has a job. Sends no notification.';

ALTER TABLE receipt_flow
  ADD COLUMN pause_cause TEXT
    CHECK (pause_cause IN ('auth', 'outage', 'retry_after', 'rejecting', 'manual')),
  ADD COLUMN pause_note TEXT CHECK (length(pause_note) <= 200),
  ADD COLUMN paused_by TEXT CHECK (length(paused_by) <= 100),
  ADD COLUMN paused_at TIMESTAMPTZ,
  ADD COLUMN pause_cause_until TIMESTAMPTZ,
  ADD COLUMN last_probe_at TIMESTAMPTZ,
  ADD COLUMN last_probe_outcome TEXT CHECK (length(last_probe_outcome) <= 64);
