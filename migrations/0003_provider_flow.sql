-- Fleet-wide provider flow control (docs/design.md §11).
--
-- One row holds what every worker pod must agree on about the provider:
--   * a pause: while pause_reason is set, no pod claims (except the one probe
--     that won begin_probe); paused_until is when the next probe may start;
--     pause_seconds is the current pause length (doubled by a failed probe);
--     probe_until bounds the probe in flight (another pod probes after it).
--     Any pod may extend the pause, never shorten it; only a delivered probe
--     (or a probe the provider answered properly) ends it.
--   * a token bucket for RECEIPTS_PROVIDER_RATE_LIMIT_PER_SECOND: tokens
--     available at tokens_at; a claim refills it by rate x elapsed (capped at
--     the burst) and spends exactly one token per job it returns, in the same
--     statement.
-- Updates touch no indexed column, so with room left on the page (fillfactor)
-- they are HOT updates and the hot row does not bloat the table.
CREATE TABLE receipt_flow (
  id             SMALLINT PRIMARY KEY DEFAULT 1 CHECK (id = 1),
  pause_reason   TEXT CHECK (pause_reason IN ('auth', 'outage', 'retry_after')),
  paused_until   TIMESTAMPTZ,
  pause_seconds  DOUBLE PRECISION NOT NULL DEFAULT 0 CHECK (pause_seconds >= 0),
  probe_until    TIMESTAMPTZ,
  tokens         DOUBLE PRECISION NOT NULL DEFAULT 0,
  tokens_at      TIMESTAMPTZ NOT NULL DEFAULT '2000-01-01 00:00:00+00',  -- a full bucket
  CHECK ((pause_reason IS NULL) = (paused_until IS NULL))
) WITH (fillfactor = 20);

ALTER TABLE receipt_flow SET (
  autovacuum_vacuum_threshold = 1000,
  autovacuum_vacuum_scale_factor = 0
);

INSERT INTO receipt_flow (id) VALUES (1);

-- A 409 "request in progress" answer is the provider working on our key, not a
-- failed attempt: it gives the attempt back, up to a separate budget counted here.
ALTER TABLE receipt_jobs
  ADD COLUMN in_progress_count INTEGER NOT NULL DEFAULT 0 CHECK (in_progress_count >= 0);

-- The token of the attempt whose outcome was written last (ack or reschedule).
-- When a write's commit succeeded but its answer was lost, the worker asks on a
-- fresh connection whether its own token is here: written, or not written.
ALTER TABLE receipt_jobs ADD COLUMN last_token UUID;
