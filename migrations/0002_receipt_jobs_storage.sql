-- Storage settings for the hot queue table (measured by bench/).
--
-- Every job is written three times (enqueue, claim, ack) and neither update
-- can be HOT (state, lease_until and finished_at are indexed or in index
-- predicates), so each job leaves two dead heap tuples and dead entries in
-- several indexes. With the default autovacuum_vacuum_scale_factor (0.2) a
-- table holding 1,000,000 done rows (the retention window) is vacuumed only
-- after ~200,000 dead tuples: the benchmark measured 220,000 dead tuples
-- right after 200,000 jobs were worked off, claims up to 2-5x slower until
-- the dead entries were skipped or removed, and no autovacuum at all in the
-- next minute. At 1 % (+ 1,000) the table is vacuumed on the next
-- autovacuum round, and without the cost delay that vacuum finishes in
-- seconds instead of throttling behind the queue's own write rate.
ALTER TABLE receipt_jobs SET (
  autovacuum_vacuum_scale_factor = 0.01,
  autovacuum_vacuum_threshold = 1000,
  autovacuum_vacuum_insert_scale_factor = 0.01,
  autovacuum_vacuum_insert_threshold = 1000,
  autovacuum_analyze_scale_factor = 0.02,
  autovacuum_vacuum_cost_delay = 0
);
