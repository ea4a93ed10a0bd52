-- Failed-job review: a terminal `discarded` state and a bounded attempt history.

-- discarded: an operator gave up on a ready or failed job (`receipts jobs
-- discard`, the review page). Terminal like done and failed: finished_at is
-- set, and the row keeps its order_id, so enqueueing the same order again is
-- still a no-op until retention prunes the row. The constraint names are the
-- ones PostgreSQL gave the unnamed checks of 0001; adding both checks in one
-- ALTER TABLE validates them in one scan of the table. The whole file took
-- 0.29 s on 1,000,000 done + 100,000 ready rows (PostgreSQL 18, 2 cores),
-- during which claims and acks wait on the table lock.
ALTER TABLE receipt_jobs
  DROP CONSTRAINT receipt_jobs_state_check,
  DROP CONSTRAINT receipt_jobs_check2,
  ADD CONSTRAINT receipt_jobs_state_check
    CHECK (state IN ('ready', 'running', 'done', 'failed', 'discarded')),
  ADD CONSTRAINT receipt_jobs_finished_check
    CHECK ((state IN ('done', 'failed', 'discarded')) = (finished_at IS NOT NULL));

-- "Find discarded rows": their count (gauge, review page), their listing and
-- their pruning, without walking done rows.
CREATE INDEX receipt_jobs_discarded
  ON receipt_jobs (finished_at, id)
  WHERE state = 'discarded';

-- One row per attempt: when it ended (database time), the job's attempt
-- number, the outcome reason (the metrics' reason vocabulary), the HTTP status
-- when one arrived, a short error, how long the attempt took (seconds) and
-- which worker made it (pod or application name).
--
-- Bounded per job without any delete: `seq` counts the job's records (1, 2,
-- …) and a record lives in ring slot (seq - 1) % 20, so the 21st record
-- overwrites the 1st. Writing a record is one insert (an update once the ring
-- is full); reading a job's history is one primary-key range.
--
-- No foreign key: a key check would lock the job row (FOR KEY SHARE, a write
-- to the hot table) on every record. The `prune` statement deletes a job's
-- history together with the job instead, and `record_attempts` writes only
-- records of jobs that exist.
CREATE TABLE receipt_attempts (
  job_id            UUID NOT NULL,
  slot              SMALLINT NOT NULL CHECK (slot >= 0 AND slot < 20),
  seq               INTEGER NOT NULL CHECK (seq >= 1),
  attempt           INTEGER NOT NULL CHECK (attempt >= 0),
  at                TIMESTAMPTZ NOT NULL DEFAULT statement_timestamp(),
  reason            TEXT NOT NULL CHECK (length(reason) <= 64),
  status            INTEGER,
  error             TEXT CHECK (length(error) <= 500),
  duration_seconds  DOUBLE PRECISION CHECK (duration_seconds >= 0),
  worker            TEXT CHECK (length(worker) <= 100),
  PRIMARY KEY (job_id, slot)
);

-- Insert-mostly, like receipt_jobs: vacuum (visibility map, dead rows left by
-- pruning) on the same early schedule as migration 0002 gives the job table.
ALTER TABLE receipt_attempts SET (
  autovacuum_vacuum_scale_factor = 0.01,
  autovacuum_vacuum_threshold = 1000,
  autovacuum_vacuum_insert_scale_factor = 0.01,
  autovacuum_vacuum_insert_threshold = 1000,
  autovacuum_analyze_scale_factor = 0.02,
  autovacuum_vacuum_cost_delay = 0
);
