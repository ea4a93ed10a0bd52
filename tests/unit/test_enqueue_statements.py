"""The enqueue statements: the traced variant differs only by the traceparent column."""

from __future__ import annotations

import re

from receipts.statements import statements


def normalised(sql: str) -> str:
    return re.sub(r"\s+", " ", sql).strip()


def test_enqueue_traced_is_enqueue_plus_the_traceparent_column():
    plain, traced = statements()["enqueue"], statements()["enqueue_traced"]
    assert "traceparent" not in plain
    without = (normalised(traced).replace(", traceparent)", ")")
               .replace(", %(traceparent)s", ""))
    assert without == normalised(plain)


def test_enqueue_sends_the_order_ids_as_one_binary_array_and_notifies_at_most_once():
    for name in ("enqueue", "enqueue_traced"):
        sql = normalised(statements()[name])
        assert sql.count("unnest(%(order_ids)b::text[])") == 1
        assert sql.count("pg_notify(") == 1
        assert "ON CONFLICT (order_id) DO NOTHING" in sql
