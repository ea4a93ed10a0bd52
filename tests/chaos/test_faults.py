"""The chaos faults that find statements by their text still find today's statements."""

from __future__ import annotations

import re

import pytest

from receipts.statements import DEFAULT_SCHEMA, claim_query, query
from tests.chaos.faults import TERMINATE_PATTERNS
from tests.chaos.pgproxy import _kind


def _like(text: str, pattern: str) -> bool:
    """SQL LIKE (``%`` and ``_``, no escapes), as pg_stat_activity.query is matched."""
    regex = "".join(".*" if c == "%" else "." if c == "_" else re.escape(c) for c in pattern)
    return re.fullmatch(regex, text, flags=re.DOTALL) is not None


@pytest.mark.parametrize("limited", [False, True])
def test_the_terminate_fault_and_the_proxy_recognise_a_claim(limited):
    text = claim_query(16, limited=limited, schema=DEFAULT_SCHEMA).as_string(None)
    assert all(_like(text, p) for p in TERMINATE_PATTERNS["claim"])
    assert not all(_like(text, p) for p in TERMINATE_PATTERNS["ack"])
    assert _kind(text.encode()) == "claim"


@pytest.mark.parametrize("schema", [DEFAULT_SCHEMA, "receipts"])
def test_the_terminate_fault_recognises_an_ack_and_nothing_else(schema):
    ack = query("ack", schema).as_string(None)
    assert all(_like(ack, p) for p in TERMINATE_PATTERNS["ack"])
    assert _kind(ack.encode()) == "write"
    for other in ("reschedule", "resolve_writes", "recover_expired"):
        text = query(other, schema).as_string(None)
        assert not all(_like(text, p) for p in TERMINATE_PATTERNS["ack"]), other
        assert not all(_like(text, p) for p in TERMINATE_PATTERNS["claim"]), other
