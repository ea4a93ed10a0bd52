"""The enqueue statements (the traced variants differ only by the traceparent column; none
notifies), the client-made UUIDv7 ids, the batch check of order ids and the alignment of
the statement's answer."""

from __future__ import annotations

import re
import uuid

import pytest

from receipts.enqueue import _SEPARATOR, _aligned, _joined_order_ids, new_job_id, order_id_text
from receipts.errors import InvalidOrderId
from receipts.statements import statements


def normalised(sql: str) -> str:
    return re.sub(r"\s+", " ", sql).strip()


@pytest.mark.parametrize("name", ["enqueue", "enqueue_one"])
def test_the_traced_variant_is_the_statement_plus_the_traceparent_column(name):
    plain, traced = statements()[name], statements()[f"{name}_traced"]
    assert "traceparent" not in plain
    without = (normalised(traced).replace(", traceparent)", ")")
               .replace(", %(traceparent)s", ""))
    assert without == normalised(plain)


def test_no_enqueue_statement_notifies_and_each_is_a_no_op_for_a_queued_order():
    assert ord(_SEPARATOR) == 31  # the server splits on chr(31)
    for name in ("enqueue", "enqueue_traced", "enqueue_one", "enqueue_one_traced"):
        sql = normalised(statements()[name]).lower()
        assert "notify" not in sql
        # no conflict target: naming order_id there needs SELECT on it (grants.py)
        assert "on conflict do nothing" in sql
    for name in ("enqueue", "enqueue_traced"):
        sql = normalised(statements()[name])
        assert sql.count("unnest(string_to_array(%(order_ids)s::text, chr(31)))") == 1


def test_new_job_ids_are_uuidv7_of_this_millisecond_and_distinct():
    import time

    before = time.time_ns() // 1_000_000
    ids = [new_job_id() for _ in range(2000)]
    after = time.time_ns() // 1_000_000
    assert all(i.version == 7 and i.variant == uuid.RFC_4122 for i in ids)
    assert len(set(ids)) == len(ids)
    assert all(before <= int(i.hex[:12], 16) <= after for i in ids)
    millis = [int(i.hex[:12], 16) for i in sorted(ids)]
    assert millis == sorted(millis)  # an id's order is its time's first


# ------------------------------------------------------------ the batch check

GOOD = ["order-1", "ü-ß-東京", "a b", "x" * 200, "a\u00a0b", "tab\u00adsoft", 42, -7,
        uuid.UUID(int=5), "😀"]
BAD = ["", " lead", "trail ", "\u3000wide", "x" * 201, "nul\x00", "new\nline", "del\x7f",
       "sep\x1fsep", "\ud800lone", 10**250, True, 4.2, b"bytes", None]


def one_by_one(ids: list[object]) -> list[str]:
    texts = []
    for position, order_id in enumerate(ids):
        try:
            texts.append(order_id_text(order_id))
        except InvalidOrderId as exc:
            raise InvalidOrderId(f"order_ids[{position}]: {exc}") from None
    return texts


def error_of(call, ids):
    with pytest.raises((InvalidOrderId, ValueError)) as info:
        call(ids)
    return type(info.value), str(info.value)


def test_the_batch_check_accepts_what_one_by_one_accepts_with_the_same_texts():
    count, joined = _joined_order_ids(GOOD)
    assert count == len(GOOD)
    assert joined.split(_SEPARATOR) == one_by_one(GOOD)
    assert _joined_order_ids(iter(["a", "b"])) == (2, "a\x1fb")
    assert _joined_order_ids([]) == (0, "")


class Text(str):
    pass


@pytest.mark.parametrize("bad", BAD, ids=repr)
@pytest.mark.parametrize("where", [0, 3, 9])
def test_the_batch_check_raises_the_first_bad_ids_error_as_one_by_one_does(bad, where):
    ids: list[object] = [*GOOD]
    ids.insert(where, bad)
    ids.append("\x01")  # a later bad id: never the one reported
    assert error_of(_joined_order_ids, ids) == error_of(one_by_one, ids)
    assert error_of(_joined_order_ids, [Text("ok"), bad]) \
        == error_of(one_by_one, [Text("ok"), bad])


@pytest.mark.parametrize("bad", ["nul\x00", "x" * 201, " lead", "\ud800lone", None,
                                 pytest.param(10**5000, id="an int of 5001 digits")])
def test_the_batch_error_names_the_bad_ids_position_and_not_the_id(bad):
    with pytest.raises(InvalidOrderId) as info:
        _joined_order_ids(["a", "b", "c", bad, "\x01"])
    message = str(info.value)
    assert message.startswith("order_ids[3]: order id ")
    assert message.removeprefix("order_ids[3]: ") == error_of(order_id_text, bad)[1]
    if isinstance(bad, str) and bad:
        assert bad not in message


def test_a_str_subclass_is_checked_one_by_one_and_stored_as_its_text():
    assert _joined_order_ids([Text("a"), "b", 3]) == (3, "a\x1fb\x1f3")


# ------------------------------------------------------------ the answer's alignment


def job_id(head: int, start: int, position: int) -> uuid.UUID:
    """An id as the enqueue statement makes it: head, variant, start + position."""
    return uuid.UUID(int=(head << 64) | (1 << 63) | (start + position))


def test_aligned_every_new_job_in_position_order():
    start = (1 << 61) - 3  # the largest starts do not reach the variant bits
    ids = [job_id(0x0123456789AB7CDE, start, n) for n in (1, 2, 3)]
    assert all(i.version == 7 and i.variant == uuid.RFC_4122 for i in ids)
    assert _aligned(3, (ids, start)) == ids


def test_aligned_places_each_new_job_by_the_position_in_its_id():
    start = 12345
    ids = [job_id(0x0123456789AB7CDE, start, n) for n in (2, 5)]
    assert _aligned(5, (ids, start)) == [None, ids[0], None, None, ids[1]]
    assert _aligned(4, (None, start)) == [None] * 4
    assert _aligned(2, None) == [None, None]
