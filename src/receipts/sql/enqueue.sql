-- The orders service's statements: enqueue inside the order's transaction,
-- one named block each. enqueue.py sends them (receipts.statements loads this
-- file with the others); the SQL function receipts_enqueue() (migrations 0004,
-- 0006) is the same insert for callers that hold no table right.
-- Time is the database's now() (the order's transaction time).

-- name: enqueue_one
-- One order's job, inside the caller's (order) transaction: the statement
-- `receipts.enqueue()` sends. A plain single-row insert, so the checkout pays
-- for the row and its three index entries (primary key, order_id, ready) and
-- little else: the id is a UUIDv7 made by the client (its clock's
-- milliseconds, then random bits: time-ordered ids go to the right edge of
-- the primary key), and an order that already has a job is a no-op (ON
-- CONFLICT: the unique order_id index is the arbiter; a concurrent enqueue of
-- the same order waits for the first transaction and then does nothing).
-- Returns the new id, or no row. No notification (see enqueue below). Cost:
-- bench/README.md, "Checkout".
INSERT INTO {schema}.receipt_jobs (id, order_id, run_at)
VALUES (%(id)s, %(order_id)s, coalesce(%(run_at)s::timestamptz, now()))
ON CONFLICT DO NOTHING
RETURNING id;

-- name: enqueue_one_traced
-- enqueue_one, also storing the enqueuing span's W3C traceparent (migration
-- 0004); used only while a trace is active. Identical otherwise (tests/unit checks).
INSERT INTO {schema}.receipt_jobs (id, order_id, run_at, traceparent)
VALUES (%(id)s, %(order_id)s, coalesce(%(run_at)s::timestamptz, now()), %(traceparent)s)
ON CONFLICT DO NOTHING
RETURNING id;

-- name: enqueue
-- Runs inside the caller's (order) transaction, for many orders in one
-- statement (`enqueue_many`). The order ids arrive as ONE text, joined by
-- U+001F (chr(31): a control character, which no valid order id contains) and
-- split here; n is
-- each id's 1-based position (the two set-returning functions of the subquery
-- run in lockstep, and stream: unnest(...) WITH ORDINALITY in FROM would copy
-- all rows into a tuplestore first). The LIMIT changes no result (count is the
-- number of ids); it keeps the generic plan's estimate at 100 rows so that a
-- prepared `enqueue` called in a loop reuses its plan instead of replanning
-- each call. An order that already has a job, or that is repeated in the call,
-- is a no-op (ON CONFLICT DO NOTHING). Returns one row: the new jobs' ids in
-- ascending order (NULL when none is new) and the statement's random start.
-- Job ids are UUIDv7 (RFC 9562 §6.2, method 2: one random start per statement,
-- incremented per row; its top bit is 0, the RFC's guard against rollover, so
-- start + n never carries into the variant bits): time-ordered ids go to the
-- right edge of the primary key instead of scattering over it, and one strong
-- random number is drawn per statement, not per row (gen_random_uuid() and
-- PostgreSQL 18's uuidv7() draw one per row, which costs far more, and random
-- v4 ids also slowed enqueue_many: bench/README.md). The low 62
-- bits of an id are start + n, so the client places every new id at its
-- position without the order id coming back (receipts.enqueue._aligned).
-- No notification: a transaction that has called pg_notify takes one lock for
-- the whole instance at commit and holds it through its WAL flush, which would
-- serialise every enqueuing checkout (docs/design.md, "The checkout's commit
-- path"). The fleet's waker wakes the workers (waker_probe).
-- Cost: python -m bench.experiments.enqueue (bench/README.md). Nearly all of it is the
-- insert itself: heap and WAL, the primary key, order_id and ready indexes,
-- and ON CONFLICT's speculative insertion (an arbiter probe, a lock and a
-- confirm record per row); the client's part is small.
WITH seed AS MATERIALIZED (
  SELECT lpad(to_hex((extract(epoch FROM clock_timestamp()) * 1000)::int8), 12, '0')
         || '7' || substr(r, 1, 3) AS head,
         ('x' || substr(r, 4, 9) || substr(r, 18, 7))::bit(64)::int8
           & 2305843009213693951 AS start
  FROM (SELECT replace(gen_random_uuid()::text, '-', '') AS r) AS g
), new AS (
  INSERT INTO {schema}.receipt_jobs (id, order_id, run_at)
  SELECT (s.head || to_hex((s.start + o.n) | -9223372036854775808))::uuid,
         o.order_id, coalesce(%(run_at)s::timestamptz, now())
  FROM seed AS s,
       (SELECT unnest(string_to_array(%(order_ids)s::text, chr(31))) AS order_id,
               generate_series(1, %(count)s::int8) AS n
        LIMIT %(count)s) AS o
  ON CONFLICT DO NOTHING
  RETURNING id
)
SELECT array_agg(new.id ORDER BY new.id), (SELECT start FROM seed)
FROM new;

-- name: enqueue_traced
-- enqueue, also storing the enqueuing span's W3C traceparent (migration 0004).
-- Used only while a trace is active, so enqueue works on a schema without the
-- column. Identical to enqueue otherwise (tests/unit checks).
WITH seed AS MATERIALIZED (
  SELECT lpad(to_hex((extract(epoch FROM clock_timestamp()) * 1000)::int8), 12, '0')
         || '7' || substr(r, 1, 3) AS head,
         ('x' || substr(r, 4, 9) || substr(r, 18, 7))::bit(64)::int8
           & 2305843009213693951 AS start
  FROM (SELECT replace(gen_random_uuid()::text, '-', '') AS r) AS g
), new AS (
  INSERT INTO {schema}.receipt_jobs (id, order_id, run_at, traceparent)
  SELECT (s.head || to_hex((s.start + o.n) | -9223372036854775808))::uuid,
         o.order_id, coalesce(%(run_at)s::timestamptz, now()), %(traceparent)s
  FROM seed AS s,
       (SELECT unnest(string_to_array(%(order_ids)s::text, chr(31))) AS order_id,
               generate_series(1, %(count)s::int8) AS n
        LIMIT %(count)s) AS o
  ON CONFLICT DO NOTHING
  RETURNING id
)
SELECT array_agg(new.id ORDER BY new.id), (SELECT start FROM seed)
FROM new;
