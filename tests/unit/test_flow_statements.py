"""The flow statements read the pause the same way: one effective-reason rule everywhere."""

from __future__ import annotations

import re

from receipts.statements import statements

#: The effective reason of docs/design.md §11, written once: migration 0008's function.
EFFECTIVE_REASON = ('"public".receipts_pause_reason(pause_reason, paused_until, pause_cause,'
                    " pause_cause_until, statement_timestamp())")


def normalised(sql: str) -> str:
    return re.sub(r"\s+", " ", sql).replace("( ", "(").strip()


def test_every_statement_that_reports_the_pause_reports_its_effective_reason():
    for name in ("claim", "claim_limited", "extend_pause", "begin_probe", "flow_state",
                 "provider_pause", "waker_probe"):
        assert EFFECTIVE_REASON in normalised(statements()[name]), name
    assert ('"public".receipts_pause_reason(f.pause_reason, f.paused_until, f.pause_cause,'
            " f.pause_cause_until, statement_timestamp())") in normalised(
                statements()["fleet_flow"])


def test_no_statement_spells_the_rule_out_again():
    """Every reader of the pause calls the function; only the probe's own updates test
    the stored reason (outage and auth pauses are probed, whatever their cause)."""
    readers = {name for name, text in statements().items()
               if "receipt_flow" in text and "pause_reason" in text}
    calling = {name for name in readers if ".receipts_pause_reason(" in statements()[name]}
    assert readers - calling == {"resume"}
    for name, text in statements().items():
        assert "'retry_after' AND" not in normalised(text), name
        assert "coalesce(pause_cause" not in text and "pause_cause IS NOT NULL" not in text, name


def test_only_the_probe_and_the_claims_treat_outage_and_auth_as_probed_pauses():
    for name in ("claim", "claim_limited", "begin_probe", "resume"):
        assert "pause_reason IN ('outage', 'auth')" in normalised(statements()[name]), name
    # A systemic rejection is stored as an outage, with its cause beside it.
    assert "WHEN %(reason)s::text = 'rejecting' THEN 'outage'" in normalised(
        statements()["extend_pause"])
