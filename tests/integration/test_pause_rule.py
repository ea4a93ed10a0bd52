"""The effective pause reason is one SQL function (migration 0008), and the planner inlines it.

Every statement that reads the fleet-wide pause calls ``receipts_pause_reason()``
(tests/unit/test_flow_statements.py holds them to it); here the function answers
each case of the rule on a real PostgreSQL, and the claims' plans show its
expression, not a call: the claim costs what it did with the rule written out.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest

from receipts.statements import claim_query

NOW = datetime(2026, 6, 1, 12, 0, tzinfo=UTC)
PAST, LATER, OTHER = NOW - timedelta(seconds=5), NOW + timedelta(minutes=5), NOW + timedelta(1)

#: (pause_reason, paused_until, pause_cause, pause_cause_until, as_of) -> the effective reason
CASES: list[tuple[tuple[Any, ...], str | None]] = [
    ((None, None, None, None, NOW), None),                               # no pause
    ((None, LATER, "manual", LATER, NOW), None),                         # cleared reason wins
    (("retry_after", LATER, None, None, NOW), "retry_after"),
    (("retry_after", PAST, None, None, NOW), None),                      # ended by itself
    (("retry_after", NOW, None, None, NOW), None),                       # ends at its time
    (("retry_after", LATER, "manual", LATER, NOW), "manual"),            # an operator's
    (("retry_after", PAST, "manual", PAST, NOW), None),
    (("retry_after", PAST, "manual", PAST, None), "manual"),             # whatever its time
    (("retry_after", LATER, "manual", OTHER, NOW), "retry_after"),       # a released worker's
    (("outage", PAST, None, None, NOW), "outage"),                       # probed: never ends
    (("outage", LATER, "rejecting", LATER, NOW), "rejecting"),
    (("outage", LATER, "rejecting", OTHER, NOW), "outage"),
    (("outage", LATER, None, LATER, NOW), "outage"),                     # no cause written
    (("auth", PAST, "auth", PAST, NOW), "auth"),
]


def test_the_function_answers_every_case_of_the_rule(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        for args, expected in CASES:
            (row,) = conn.execute(
                "SELECT receipts_pause_reason(%s::text, %s::timestamptz, %s::text,"
                " %s::timestamptz, %s::timestamptz)", args).fetchall()
            assert row[0] == expected, (args, row[0])


@pytest.mark.parametrize("limited", [False, True])
@pytest.mark.parametrize("plan_mode", ["force_custom_plan", "force_generic_plan"])
def test_the_claims_plans_carry_the_rule_inlined_not_a_call(
        dsn: str, limited: bool, plan_mode: str) -> None:
    claim = claim_query(10, limited=limited).as_string(None)  # type: ignore[arg-type]
    for key, n in (("max_attempts", 1), ("lease_seconds", 2), ("probe", 3), ("rate", 4),
                   ("burst", 5)):
        claim = claim.replace(f"%({key})s", f"${n}")
    types = "int, float8, bool" + (", float8, float8" if limited else "")
    args = "5, 60.0, false" + (", 10, 10" if limited else "")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"SET plan_cache_mode = {plan_mode}")
        conn.execute(f"PREPARE claim_stmt({types}) AS {claim}")
        plan = "\n".join(r[0] for r in conn.execute(
            f"EXPLAIN (VERBOSE, COSTS OFF) EXECUTE claim_stmt({args})").fetchall())
    assert "receipts_pause_reason" not in plan, plan
    assert "'retry_after'::text" in plan, plan  # the function's own expression

