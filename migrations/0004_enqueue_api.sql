-- Enqueue from any language, and trace context stored with the job.

-- The W3C traceparent of the span that enqueued the job (NULL when none). The
-- worker's delivery span links to it. NOT VALID: the CHECK holds for every row
-- written from now on, and every existing row is NULL, so no table scan is
-- needed while this migration holds its lock.
ALTER TABLE receipt_jobs ADD COLUMN traceparent TEXT;
ALTER TABLE receipt_jobs ADD CONSTRAINT receipt_jobs_traceparent_format
  CHECK (traceparent ~ '^00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$') NOT VALID;

-- receipts_enqueue(order_id, run_at, traceparent): the SQL twin of the Python
-- enqueue API, for order services in any language. Call it inside the order's
-- transaction:  SELECT receipts_enqueue('order-42');
-- * order_id: the same rules as receipts.enqueue.check_order_id: non-empty, at
--   most 200 characters, no control characters (U+0000-U+001F, U+007F), no
--   leading or trailing whitespace (Python's str.isspace set); otherwise it
--   raises invalid_parameter_value (SQLSTATE 22023) and inserts nothing.
-- * run_at: when the job becomes due; NULL or omitted means now().
-- * traceparent: optional W3C traceparent of the caller's span.
-- Returns the new job's id, or NULL when the order already has a job. When a
-- job is new, listening workers are woken on commit (NOTIFY receipts_ready;
-- the channel name is receipts.enqueue.NOTIFY_CHANNEL).
CREATE FUNCTION receipts_enqueue(
  order_id text,
  run_at timestamptz DEFAULT now(),
  traceparent text DEFAULT NULL
) RETURNS uuid
LANGUAGE plpgsql
VOLATILE
-- The table is found in the schema this migration ran in, whatever the caller's
-- search_path (and a caller's schema cannot shadow it).
SET search_path FROM CURRENT
AS $$
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
  INSERT INTO receipt_jobs (id, order_id, run_at, traceparent)
  VALUES (gen_random_uuid(), receipts_enqueue.order_id,
          coalesce(receipts_enqueue.run_at, now()), receipts_enqueue.traceparent)
  ON CONFLICT (order_id) DO NOTHING
  RETURNING id INTO new_id;
  IF new_id IS NOT NULL THEN
    PERFORM pg_notify('receipts_ready', '');
  END IF;
  RETURN new_id;
END
$$;
