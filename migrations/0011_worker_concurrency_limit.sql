-- Adaptive concurrency (RECEIPTS_ADAPTIVE_CONCURRENCY): each worker reports its
-- current AIMD limit on deliveries in flight in its heartbeat row, about every
-- 20 s and never per claim or per delivery. A starting worker begins at the
-- fleet's mean limit, and the KEDA signal caps the pods it asks for at what the
-- fleet's limits can use (docs/scaling.md). NULL: adaptation is off in that
-- worker (or it runs an older release). Expand-only: older workers and pages
-- run beside it untouched.
ALTER TABLE receipt_workers
  ADD COLUMN concurrency_limit INTEGER CHECK (concurrency_limit >= 0);
