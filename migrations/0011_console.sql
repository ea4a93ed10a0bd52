-- The console in an incident: failures grouped by cause, throughput and
-- latency over the last hour, and a queue-depth chart that survives a restart
-- of the page. Expand-only: released workers and pages run beside it
-- untouched. docs/design.md, "The operator console".

-- 1. Failed jobs grouped by the first 60 characters of their last error
--    (failure_groups). Only failed rows are in it, and a job enters the
--    failed state once, so a delivery, a claim or a retry never writes it.
--    At 1,000,000 failed rows in 20 causes the grouping reads this index
--    alone (an index-only scan), not the heap.
CREATE INDEX receipt_jobs_failed_cause
  ON receipt_jobs (left(last_error, 60), finished_at)
  WHERE state = 'failed';

-- 2. A bulk action may cover one such group: its error prefix is part of its
--    filter (review_matching), so a resumed action walks the same jobs.
ALTER TABLE receipt_bulk_actions
  ADD COLUMN error_prefix TEXT CHECK (length(error_prefix) <= 60);

-- 3. Attempt records by time (throughput and attempt-time percentiles of the
--    last hour). A BRIN index: records are appended in time order, so a
--    block range summary is enough, and it costs almost nothing per insert.
CREATE INDEX receipt_attempts_at ON receipt_attempts USING brin (at);

-- 4. The queue-depth chart's samples, one row a minute at most however many
--    pages run (the minute is the key), kept two hours (the insert deletes
--    older rows). A page that restarts draws its last hour from here.
CREATE TABLE receipt_ui_samples (
  minute   TIMESTAMPTZ PRIMARY KEY,
  ready    BIGINT NOT NULL CHECK (ready >= 0),
  running  BIGINT NOT NULL CHECK (running >= 0),
  failed   BIGINT NOT NULL CHECK (failed >= 0)
);
