-- The console in an incident: bulk actions over a failure group, throughput
-- and latency over the last hour, and a queue-depth chart that survives a
-- restart of the page. Expand-only: released workers and pages run beside it
-- untouched. docs/design.md, "The operator console".

-- 1. A bulk action may cover one failure group (failure_groups: the first 60
--    characters of last_error): its error prefix is part of its filter
--    (review_matching), so a resumed action walks the same jobs.
ALTER TABLE receipt_bulk_actions
  ADD COLUMN error_prefix TEXT CHECK (length(error_prefix) <= 60);

-- 2. Attempt records by time (throughput and attempt-time percentiles of the
--    last hour). A BRIN index: records are appended in time order, so a
--    block range summary is enough, and it costs almost nothing per insert.
CREATE INDEX receipt_attempts_at ON receipt_attempts USING brin (at);

-- 3. The queue-depth chart's samples, one row a minute at most however many
--    pages run (the minute is the key), kept two hours (the insert deletes
--    older rows). A page that restarts draws its last hour from here.
CREATE TABLE receipt_ui_samples (
  minute   TIMESTAMPTZ PRIMARY KEY,
  ready    BIGINT NOT NULL CHECK (ready >= 0),
  running  BIGINT NOT NULL CHECK (running >= 0),
  failed   BIGINT NOT NULL CHECK (failed >= 0)
);
