-- The receipt job queue (docs/design.md §1: the classic lease-based job table).
-- One row per order; state moves ready -> running -> done | failed.
CREATE TABLE receipt_jobs (
  id           UUID PRIMARY KEY,
  order_id     TEXT NOT NULL UNIQUE,
  state        TEXT NOT NULL DEFAULT 'ready'
               CHECK (state IN ('ready', 'running', 'done', 'failed')),
  run_at       TIMESTAMPTZ NOT NULL DEFAULT now(),
  attempts     INTEGER NOT NULL DEFAULT 0 CHECK (attempts >= 0),
  lease_token  UUID,
  lease_until  TIMESTAMPTZ,
  last_error   TEXT,
  -- Additions: enqueue time (lag, review) and finish time (retention).
  created_at   TIMESTAMPTZ NOT NULL DEFAULT now(),
  finished_at  TIMESTAMPTZ,
  CHECK ((state = 'running') = (lease_token IS NOT NULL)),
  CHECK ((lease_token IS NULL) = (lease_until IS NULL)),
  CHECK ((state IN ('done', 'failed')) = (finished_at IS NOT NULL))
);

-- "Find the earliest due jobs" (claim, ready-depth gauge, KEDA trigger).
CREATE INDEX receipt_jobs_ready
  ON receipt_jobs (run_at, id)
  WHERE state = 'ready';

-- "Find abandoned attempts" (recovery, expired-lease gauge).
CREATE INDEX receipt_jobs_expired
  ON receipt_jobs (lease_until, id)
  WHERE state = 'running';

-- "Find finished rows past retention" (pruning) and failed-job review.
CREATE INDEX receipt_jobs_finished
  ON receipt_jobs (finished_at, id)
  WHERE state IN ('done', 'failed');

-- Failed-job review and the failed-count gauge, without walking done rows.
CREATE INDEX receipt_jobs_failed
  ON receipt_jobs (finished_at, id)
  WHERE state = 'failed';
