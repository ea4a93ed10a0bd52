-- The operator console: who is working, bulk actions that survive a restart,
-- and review-page sessions that were signed out. Three new, small tables;
-- nothing existing changes, so released workers run beside this migration
-- untouched (expand-only). docs/design.md, "The operator console".

-- 1. Worker heartbeats. Each `receipts worker` process upserts its own row
--    about every 20 s (never per claim): a 16-pod idle fleet writes < 1 row a
--    second here. `tag` is the process's random 8-hex-digit key; the same
--    digits end the lease tokens it writes (the claim statement puts them
--    there), so the review page can name the worker that holds a running job
--    without a column on receipt_jobs. Times are the database's. Rows not
--    seen for a day are deleted by the next worker that starts.
CREATE TABLE receipt_workers (
  tag            TEXT PRIMARY KEY CHECK (tag ~ '^[0-9a-f]{8}$'),
  pod            TEXT NOT NULL CHECK (length(pod) <= 100),
  pid            INTEGER,
  version        TEXT CHECK (length(version) <= 40),
  slots          INTEGER CHECK (slots >= 0),
  inflight       INTEGER CHECK (inflight >= 0),
  claimed_total  BIGINT CHECK (claimed_total >= 0),
  started_at     TIMESTAMPTZ NOT NULL DEFAULT statement_timestamp(),
  seen_at        TIMESTAMPTZ NOT NULL DEFAULT statement_timestamp(),
  last_claim_at  TIMESTAMPTZ,
  stopped_at     TIMESTAMPTZ
) WITH (fillfactor = 50);  -- room on the page: every heartbeat is a HOT update

-- 2. Bulk actions ("retry every failed job matching this filter"), run in
--    bounded batches, each one statement that changes up to a batch of jobs
--    and advances this row's keyset cursor and counts in the same commit, so
--    progress is exact after any crash and a resumed action starts where the
--    last committed batch ended. `cutoff` is the moment the operator
--    confirmed: jobs that reach the state later are never touched. `runner`
--    is the token of the process running it (every batch is guarded by it,
--    as an ack is by its lease token); `expected` is the count shown at
--    confirmation (NULL when there were too many to count quickly).
CREATE TABLE receipt_bulk_actions (
  id              UUID PRIMARY KEY,
  action          TEXT NOT NULL CHECK (action IN ('retry', 'discard')),
  job_state       TEXT NOT NULL CHECK (job_state IN ('ready', 'failed')),
  reason          TEXT CHECK (length(reason) <= 64),
  http_status     INTEGER,
  since           TIMESTAMPTZ,
  until           TIMESTAMPTZ,
  order_contains  TEXT CHECK (length(order_contains) <= 200),
  cutoff          TIMESTAMPTZ NOT NULL,
  expected        BIGINT,
  status          TEXT NOT NULL DEFAULT 'running'
                  CHECK (status IN ('running', 'done', 'stopped', 'failed')),
  runner          UUID,
  cursor_at       TIMESTAMPTZ,
  cursor_id       UUID,
  examined        BIGINT NOT NULL DEFAULT 0,
  changed         BIGINT NOT NULL DEFAULT 0,
  batches         INTEGER NOT NULL DEFAULT 0,
  created_by      TEXT NOT NULL CHECK (length(created_by) <= 100),
  created_at      TIMESTAMPTZ NOT NULL DEFAULT statement_timestamp(),
  updated_at      TIMESTAMPTZ NOT NULL DEFAULT statement_timestamp(),
  finished_at     TIMESTAMPTZ,
  error           TEXT CHECK (length(error) <= 500),
  CHECK ((status = 'running') = (runner IS NOT NULL))
);

CREATE INDEX receipt_bulk_actions_created ON receipt_bulk_actions (created_at);

-- 3. Review-page sessions signed out before they expired. Session cookies are
--    signed, not stored, so sign-out records the session id here (every
--    replica of the page reads the list once per refresh interval) until the
--    cookie would have expired anyway.
CREATE TABLE receipt_ui_revoked (
  sid         TEXT PRIMARY KEY CHECK (length(sid) <= 64),
  expires_at  TIMESTAMPTZ NOT NULL
);
