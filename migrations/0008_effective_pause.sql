-- The effective pause reason, written once.
--
-- Every statement that reads the fleet-wide pause (the claims, the waker's
-- probe, the flow control's extension and probe, the operator's fleet view,
-- pause and resume) needs the same rule, which was spelled out in each of
-- them (docs/design.md §11, "Fleet-wide state lives in PostgreSQL"):
--
-- * no pause_reason: no pause;
-- * a 'retry_after' pause (a provider's Retry-After, or an operator's pause,
--   which released workers read as one) ends by itself at paused_until: from
--   then on it is no pause, though its columns stay until something clears
--   them; an outage, auth or rejecting pause ends only when a probe succeeds;
-- * the cause columns apply while pause_cause_until = paused_until (a
--   released worker that extended or ended the pause wrote only pause_reason
--   and paused_until): then the reason is pause_cause when set, else
--   pause_reason.
--
-- receipts_pause_reason() is that rule as a function of the row's columns and
-- a moment: the reason in force at as_of (statement_timestamp() in the
-- statements), or, with as_of NULL, the pause the row describes whether or
-- not its time is up (what an operator who lifts it lifted).
--
-- LANGUAGE sql, IMMUTABLE (it reads no table and no clock: the moment is an
-- argument), not STRICT, no SET clause and a single SELECT of an expression:
-- the planner inlines it, so a claim plans and runs as it did with the rule
-- written out (tests/integration/test_pause_rule.py reads the claims' plans).
-- EXECUTE stays with PUBLIC, as for any new function: it reads nothing and
-- writes nothing, so every role that reads receipt_flow may call it.
--
-- Expand-only: nothing existing changes, and released workers, which spell
-- the rule out in their own statements, run beside this migration untouched.

CREATE FUNCTION receipts_pause_reason(
  pause_reason text,
  paused_until timestamptz,
  pause_cause text,
  pause_cause_until timestamptz,
  as_of timestamptz
) RETURNS text
LANGUAGE sql
IMMUTABLE
PARALLEL SAFE
AS $function$
  SELECT CASE WHEN pause_reason IS NULL
                OR (pause_reason = 'retry_after' AND paused_until <= as_of)
              THEN NULL
              WHEN pause_cause_until = paused_until THEN coalesce(pause_cause, pause_reason)
              ELSE pause_reason END
$function$;

COMMENT ON FUNCTION receipts_pause_reason(text, timestamptz, text, timestamptz, timestamptz) IS
  'The effective reason of the fleet-wide pause described by a receipt_flow row''s '
  'columns, in force at as_of (NULL: none); with as_of NULL, whatever its time.';
