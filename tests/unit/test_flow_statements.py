"""The flow statements read the pause the same way: one effective-reason rule everywhere."""

from __future__ import annotations

import re

from receipts.statements import statements

#: The effective reason of docs/design.md §11 (the rule migration 0006 describes), plus the
#: end of a pause that ends by itself: one spelling in every statement that reads the pause.
EFFECTIVE_REASON = (
    "CASE WHEN pause_reason IS NULL"
    " OR (pause_reason = 'retry_after' AND paused_until <= statement_timestamp())"
    " THEN NULL"
    " WHEN pause_cause_until = paused_until THEN coalesce(pause_cause, pause_reason)"
    " ELSE pause_reason END")


def normalised(sql: str) -> str:
    return re.sub(r"\s+", " ", sql).replace("( ", "(").strip()


def test_every_statement_that_reports_the_pause_reports_its_effective_reason():
    for name in ("claim", "claim_limited", "extend_pause", "begin_probe", "flow_state",
                 "provider_pause"):
        assert EFFECTIVE_REASON in normalised(statements()[name]), name


def test_only_the_probe_and_the_claims_treat_outage_and_auth_as_probed_pauses():
    for name in ("claim", "claim_limited", "begin_probe", "resume"):
        assert "pause_reason IN ('outage', 'auth')" in normalised(statements()[name]), name
    # A systemic rejection is stored as an outage, with its cause beside it.
    assert "WHEN %(reason)s::text = 'rejecting' THEN 'outage'" in normalised(
        statements()["extend_pause"])
