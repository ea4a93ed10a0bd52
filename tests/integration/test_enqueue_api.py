"""The orders team's API on a real PostgreSQL: enqueue, enqueue_many and their async twins.

Covers what a job id and a duplicate return, scheduled jobs, order id types,
one statement for many jobs, no NOTIFY from any path (counted on a real
listening connection), autocommit connections, and SQLAlchemy Core connections
and ORM sessions, sync and async, on the psycopg driver.
"""

from __future__ import annotations

import time
import uuid
import warnings
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest

from receipts import (
    AutocommitWarning,
    InvalidOrderId,
    enqueue,
    enqueue_async,
    enqueue_many,
    enqueue_many_async,
)
from receipts.enqueue import NOTIFY_CHANNEL
from tests.conftest import fetch_rows


def stored(dsn: str) -> dict[str, uuid.UUID]:
    return {str(o): i for o, i in fetch_rows(dsn, "SELECT order_id, id FROM receipt_jobs")}


class CountingCursor(psycopg.Cursor[Any]):
    """Counts the statements a connection sends through ``Connection.execute``."""

    sent = 0

    def execute(self, *args: Any, **kwargs: Any) -> Any:
        type(self).sent += 1
        return super().execute(*args, **kwargs)


# ------------------------------------------------------------ what comes back


def test_enqueue_returns_the_new_job_id_and_none_for_a_duplicate(dsn):
    with psycopg.connect(dsn) as conn:
        job_id = enqueue(conn, "order-1")
        assert isinstance(job_id, uuid.UUID)
        assert enqueue(conn, "order-1") is None
    assert stored(dsn) == {"order-1": job_id}


def test_job_ids_are_time_ordered_uuidv7_with_the_database_clock(dsn):
    with psycopg.connect(dsn) as conn:
        first = enqueue(conn, "order-a")
        many = enqueue_many(conn, [f"order-{i}" for i in range(50)])
    ids = [first, *many]
    assert all(i is not None and i.version == 7 and i.variant == uuid.RFC_4122 for i in ids)
    assert len(set(ids)) == len(ids)
    assert many == sorted(many)  # one statement: one random start, incremented per row
    millis = int(first.hex[:12], 16)  # type: ignore[union-attr]
    assert abs(millis / 1000 - time.time()) < 60


def test_a_rolled_back_order_takes_its_job_with_it(dsn):
    with psycopg.connect(dsn) as conn, pytest.raises(ZeroDivisionError), conn.transaction():
        assert enqueue(conn, "order-gone") is not None
        assert enqueue_many(conn, ["order-gone-2"]) != [None]
        raise ZeroDivisionError
    assert stored(dsn) == {}


def test_enqueue_many_answers_per_input_position_new_id_or_none(dsn):
    with psycopg.connect(dsn) as conn:
        before = enqueue(conn, "old")
        result = enqueue_many(conn, ["a", "old", "b", "a", 7, "7", uuid.UUID(int=5)])
    assert len(result) == 7
    a, old, b, a_again, seven, seven_text, by_uuid = result
    assert old is None and a_again is None and seven_text is None
    rows = stored(dsn)
    assert rows == {"old": before, "a": a, "b": b, "7": seven,
                    "00000000-0000-0000-0000-000000000005": by_uuid}
    assert sum(x is not None for x in result) == 4


def test_enqueue_many_aligns_a_large_batch_of_new_queued_and_repeated_orders(dsn):
    orders = [f"o-{i}" for i in range(3000)] + [f"o-{i}" for i in range(0, 3000, 5)]
    with psycopg.connect(dsn) as conn:
        queued = enqueue_many(conn, [f"o-{i}" for i in range(0, 3000, 7)])
        result = enqueue_many(conn, orders)
        everything_new = enqueue_many(conn, [f"n-{i}" for i in range(3000)])
    rows = stored(dsn)
    assert None not in queued and None not in everything_new
    assert everything_new == [rows[f"n-{i}"] for i in range(3000)]
    assert len(result) == len(orders)
    seen: set[str] = set()
    for order, job_id in zip(orders, result, strict=True):
        if order in seen or int(order[2:]) % 7 == 0:
            assert job_id is None, order
        else:
            assert job_id == rows[order], order
        seen.add(order)


def test_two_transactions_enqueueing_the_same_orders_concurrently_make_one_job_each(dsn):
    import threading

    first_ids = [f"c-{i}" for i in range(0, 2000)]
    second_ids = [f"c-{i}" for i in range(1000, 3000)]
    answers: dict[str, Any] = {}
    with psycopg.connect(dsn) as first, psycopg.connect(dsn) as second:
        answers["first"] = enqueue_many(first, first_ids)  # its transaction stays open

        def other() -> None:
            try:
                answers["second"] = enqueue_many(second, second_ids)  # waits for `first`
                second.commit()
            except Exception as exc:  # pragma: no cover - reported below
                answers["error"] = exc

        thread = threading.Thread(target=other)
        thread.start()
        thread.join(0.5)
        assert thread.is_alive()  # blocked on the first transaction's order ids
        first.commit()
        thread.join(30)
    assert "error" not in answers
    rows = stored(dsn)
    assert len(rows) == 3000
    assert answers["first"] == [rows[o] for o in first_ids]
    assert answers["second"] == [None] * 1000 + [rows[o] for o in second_ids[1000:]]


def test_enqueue_many_sends_one_statement_and_nothing_for_an_empty_list(dsn):
    with psycopg.connect(dsn, cursor_factory=CountingCursor) as conn:
        CountingCursor.sent = 0
        result = enqueue_many(conn, (f"order-{i}" for i in range(1000)))
        assert CountingCursor.sent == 1
        assert enqueue_many(conn, []) == []
        assert CountingCursor.sent == 1
    assert len(stored(dsn)) == 1000 and None not in result


def test_enqueue_many_refuses_a_single_string_instead_of_a_list(dsn):
    with psycopg.connect(dsn) as conn, pytest.raises(TypeError, match="not one str"):
        enqueue_many(conn, "order-1")
    assert stored(dsn) == {}


@pytest.mark.slow
def test_enqueue_many_validates_every_id_before_sending_anything(dsn):
    with psycopg.connect(dsn) as conn, conn.transaction():
        with pytest.raises(InvalidOrderId, match="control characters"):
            enqueue_many(conn, ["fine-1", "fine-2", "bad\nid"])
        # Nothing was sent: the order transaction is still usable.
        enqueue(conn, "after")
    assert set(stored(dsn)) == {"after"}


# ------------------------------------------------------------ scheduled jobs


@pytest.mark.slow
def test_run_at_schedules_the_job_and_none_means_due_now(dsn):
    later = datetime.now(UTC) + timedelta(hours=2)
    with psycopg.connect(dsn) as conn:
        enqueue(conn, "later", run_at=later)
        enqueue_many(conn, ["later-1", "later-2"], run_at=later)
        enqueue(conn, "now")
        started = conn.execute("SELECT now()").fetchone()[0]  # type: ignore[index]
    rows = dict(fetch_rows(dsn, "SELECT order_id, run_at FROM receipt_jobs"))
    assert rows["later"] == rows["later-1"] == rows["later-2"] == later
    assert rows["now"] == started  # the transaction's start, as the column default


@pytest.mark.slow
def test_a_naive_run_at_is_refused_before_anything_is_sent(dsn):
    with psycopg.connect(dsn) as conn, conn.transaction():
        with pytest.raises(ValueError, match="timezone-aware"):
            enqueue(conn, "x", run_at=datetime(2030, 1, 1))
        with pytest.raises(TypeError, match="datetime"):
            enqueue(conn, "x", run_at="2030-01-01")  # type: ignore[arg-type]
        enqueue(conn, "after")
    assert set(stored(dsn)) == {"after"}


# ------------------------------------------------------------ order id types


@pytest.mark.slow
def test_int_and_uuid_order_ids_are_stored_as_their_canonical_text(dsn):
    order_uuid = uuid.UUID("A0EEBC99-9C0B-4EF8-BB6D-6BB9BD380A11")
    with psycopg.connect(dsn) as conn:
        assert enqueue(conn, 42) is not None
        assert enqueue(conn, "42") is None  # the same order
        assert enqueue(conn, -7) is not None
        assert enqueue(conn, order_uuid) is not None
        assert enqueue(conn, str(order_uuid)) is None
    assert set(stored(dsn)) == {"42", "-7", "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11"}


@pytest.mark.slow
@pytest.mark.parametrize("bad", [True, 4.2, b"order-1", None, ["order-1"]],
                         ids=["bool", "float", "bytes", "None", "list"])
def test_other_order_id_types_are_refused_naming_what_is_accepted(dsn, bad):
    with psycopg.connect(dsn) as conn:
        with pytest.raises(InvalidOrderId, match=r"must be str, int or uuid\.UUID, not "):
            enqueue(conn, bad)
        with pytest.raises(InvalidOrderId, match=r"must be str, int or uuid\.UUID"):
            enqueue_many(conn, ["fine", bad])
    assert stored(dsn) == {}


@pytest.mark.slow
def test_a_huge_int_is_held_to_the_length_rule(dsn):
    with psycopg.connect(dsn) as conn, pytest.raises(InvalidOrderId, match="longer than 200"):
        enqueue(conn, 10**250)


# ------------------------------------------------------------ connections


@pytest.mark.slow
def test_a_wrong_connection_gets_an_error_that_says_what_works(dsn):
    with pytest.raises(TypeError, match="psycopg 3 connection or a SQLAlchemy"):
        enqueue(object(), "x")
    with pytest.raises(TypeError, match="psycopg 3 connection or a SQLAlchemy"):
        enqueue_many("host=localhost", ["x"])


async def test_sync_and_async_connections_are_not_mixed_up(dsn):
    async with await psycopg.AsyncConnection.connect(dsn) as aconn:
        with pytest.raises(TypeError, match="enqueue_async"):
            enqueue(aconn, "x")
    with psycopg.connect(dsn) as conn, pytest.raises(TypeError, match="enqueue / enqueue_many"):
        await enqueue_async(conn, "x")


def test_autocommit_outside_a_transaction_warns_and_the_job_commits_alone(dsn):
    with psycopg.connect(dsn, autocommit=True) as conn:
        with pytest.warns(AutocommitWarning, match="committed on its own") as record:
            enqueue(conn, "auto-1")
        assert record[0].filename == __file__  # points at the caller's line
        with pytest.warns(AutocommitWarning):
            enqueue_many(conn, ["auto-2"])
        # Inside a transaction block an autocommit connection is fine.
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with conn.transaction():
                enqueue(conn, "auto-3")
    assert set(stored(dsn)) == {"auto-1", "auto-2", "auto-3"}


@pytest.mark.slow
def test_the_autocommit_warning_can_be_made_an_error_that_sends_nothing(dsn):
    with psycopg.connect(dsn, autocommit=True) as conn, warnings.catch_warnings():
        warnings.simplefilter("error", AutocommitWarning)
        with pytest.raises(AutocommitWarning):
            enqueue(conn, "never")
    assert stored(dsn) == {}


@pytest.mark.slow
def test_a_normal_connection_does_not_warn(dsn):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with psycopg.connect(dsn) as conn:
            enqueue(conn, "quiet")


# ------------------------------------------------------------ async twins


@pytest.mark.slow
async def test_the_async_twins_behave_like_the_sync_api(dsn):
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        job_id = await enqueue_async(conn, "a-1")
        assert isinstance(job_id, uuid.UUID)
        assert await enqueue_async(conn, "a-1") is None
        result = await enqueue_many_async(conn, ["a-2", "a-1", 3, "a-2"])
        assert result[1] is None and result[3] is None and None not in (result[0], result[2])
        assert await enqueue_many_async(conn, []) == []
        with pytest.raises(InvalidOrderId):
            await enqueue_many_async(conn, ["ok", ""])
        await conn.rollback()
        await enqueue_async(conn, "a-3")
    assert set(stored(dsn)) == {"a-3"}


@pytest.mark.slow
async def test_async_autocommit_warns_too(dsn):
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        with pytest.warns(AutocommitWarning) as record:
            await enqueue_async(conn, "auto")
        assert record[0].filename == __file__


# ------------------------------------------------------------ NOTIFY


class Listener:
    """A real LISTENing connection that counts wake-ups between two sentinels."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.conn = psycopg.connect(dsn, autocommit=True)
        self.conn.execute(f"LISTEN {NOTIFY_CHANNEL}")

    def count(self) -> int:
        """Wake-ups received since the last call (up to a sentinel sent now)."""
        sentinel = uuid.uuid4().hex
        with psycopg.connect(self.dsn, autocommit=True) as other:
            other.execute("SELECT pg_notify(%s, %s)", (NOTIFY_CHANNEL, sentinel))
        for seen, note in enumerate(self.conn.notifies(timeout=10)):
            if note.payload == sentinel:
                return seen
            assert note.payload == ""
        raise AssertionError("the sentinel notification never arrived")

    def close(self) -> None:
        self.conn.close()


@pytest.fixture
def listener(dsn):
    listening = Listener(dsn)
    yield listening
    listening.close()


@pytest.mark.slow
def test_no_enqueue_path_notifies_from_the_callers_transaction(dsn, listener):
    # A transaction with a pending notification takes one instance-wide lock at
    # commit and holds it through the WAL flush: the checkout must never carry one.
    with psycopg.connect(dsn) as conn:
        with conn.transaction():
            for i in range(25):
                enqueue(conn, f"loop-{i}")
        with conn.transaction():
            enqueue_many(conn, [f"many-{i}" for i in range(500)])
        with conn.transaction():
            enqueue(conn, "scheduled", run_at=datetime.now(UTC) + timedelta(hours=1))
        enqueue(conn, "implicit-transaction")
        conn.commit()
    with psycopg.connect(dsn, autocommit=True) as conn, pytest.warns(AutocommitWarning):
        enqueue(conn, "autocommit")
    assert listener.count() == 0
    assert len(stored(dsn)) == 25 + 500 + 3


@pytest.mark.slow
async def test_no_async_enqueue_path_notifies(dsn, listener):
    async with await psycopg.AsyncConnection.connect(dsn) as conn, conn.transaction():
        for i in range(10):
            await enqueue_async(conn, f"a-{i}")
        await enqueue_many_async(conn, ["b-1", "b-2"])
    assert listener.count() == 0
    assert len(stored(dsn)) == 12


@pytest.mark.slow
@pytest.mark.parametrize("notify", [True, False])
def test_the_old_notify_argument_warns_that_it_is_ignored_and_sends_nothing(
        dsn, listener, notify):
    with psycopg.connect(dsn) as conn, conn.transaction():
        with pytest.warns(DeprecationWarning, match="notify=.*ignored") as record:
            assert enqueue(conn, "old-caller", notify=notify) is not None
        assert record[0].filename == __file__  # points at the caller's line
        with pytest.warns(DeprecationWarning):
            assert enqueue_many(conn, ["old-many"], notify=notify) != [None]
    assert listener.count() == 0
    assert set(stored(dsn)) == {"old-caller", "old-many"}


async def test_the_async_twins_warn_about_notify_too(dsn, listener):
    async with await psycopg.AsyncConnection.connect(dsn) as conn, conn.transaction():
        with pytest.warns(DeprecationWarning):
            await enqueue_async(conn, "old-async", notify=True)
        with pytest.warns(DeprecationWarning):
            await enqueue_many_async(conn, ["old-async-many"], notify=True)
    assert listener.count() == 0


def test_concurrent_enqueues_of_one_order_make_one_job_and_never_fail_the_checkout(dsn):
    """Per-order deduplication under contention: many transactions enqueue the same
    orders at once; each order gets exactly one job, and no caller gets an error."""
    import threading

    orders = [f"race-{i}" for i in range(20)]
    barrier = threading.Barrier(8)
    results: list[list[uuid.UUID | None]] = []
    errors: list[BaseException] = []

    def checkout() -> None:
        try:
            with psycopg.connect(dsn) as conn, conn.transaction():
                barrier.wait(timeout=10)
                results.append([enqueue(conn, order) for order in orders])
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=checkout) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert errors == []
    rows = stored(dsn)
    assert set(rows) == set(orders)
    for i, order in enumerate(orders):
        winners = [r[i] for r in results if r[i] is not None]
        assert winners == [rows[order]], order


# ------------------------------------------------------------ SQLAlchemy


@pytest.fixture
def engine(dsn):
    from sqlalchemy import create_engine

    eng = create_engine("postgresql+psycopg://", creator=lambda: psycopg.connect(dsn))
    with eng.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE orders (id text PRIMARY KEY)")
    yield eng
    eng.dispose()


@pytest.fixture
async def async_engine(dsn, engine):
    from sqlalchemy.ext.asyncio import create_async_engine

    eng = create_async_engine("postgresql+psycopg://",
                              async_creator=lambda: psycopg.AsyncConnection.connect(dsn))
    yield eng
    await eng.dispose()


def orders(dsn: str) -> set[str]:
    return {str(r[0]) for r in fetch_rows(dsn, "SELECT id FROM orders")}


@pytest.mark.slow
def test_sqlalchemy_core_connection_commits_and_rolls_back_with_the_order(dsn, engine, listener):
    from sqlalchemy import text

    insert = text("INSERT INTO orders (id) VALUES (:id)")
    with engine.begin() as conn:
        conn.execute(insert, {"id": "o-1"})
        assert isinstance(enqueue(conn, "o-1"), uuid.UUID)
        assert enqueue_many(conn, ["o-1", "o-1b"])[0] is None
    with pytest.raises(ZeroDivisionError), engine.begin() as conn:
        conn.execute(insert, {"id": "o-2"})
        enqueue(conn, "o-2")
        raise ZeroDivisionError
    # engine.connect(): enqueue begins SQLAlchemy's transaction as autobegin
    # would, so conn.commit() commits the job (it would be a no-op otherwise).
    with engine.connect() as conn:
        assert not conn.in_transaction()
        enqueue(conn, "o-3")
        assert conn.in_transaction()
        conn.commit()
    with engine.connect() as conn:
        enqueue(conn, "o-4")  # closed without commit: rolled back
    assert orders(dsn) == {"o-1"}
    assert set(stored(dsn)) == {"o-1", "o-1b", "o-3"}
    assert listener.count() == 0


@pytest.mark.slow
def test_sqlalchemy_orm_session_commits_and_rolls_back_with_the_order(dsn, engine, listener):
    from sqlalchemy import String
    from sqlalchemy.orm import DeclarativeBase, Session, mapped_column

    class Base(DeclarativeBase):
        pass

    class Order(Base):
        __tablename__ = "orders"
        id = mapped_column(String, primary_key=True)

    with Session(engine) as session, session.begin():
        session.add(Order(id="s-1"))
        session.flush()
        assert enqueue(session, "s-1") is not None
    with Session(engine) as session:
        session.add(Order(id="s-2"))
        enqueue_many(session, ["s-2", "s-2b"])
        session.rollback()
    with Session(engine) as session:
        enqueue(session, "s-3")
        session.add(Order(id="s-3"))
        session.commit()
    assert orders(dsn) == {"s-1", "s-3"}
    assert set(stored(dsn)) == {"s-1", "s-3"}
    assert listener.count() == 0


def test_sqlalchemy_scoped_session_works_like_a_session(dsn, engine):
    from sqlalchemy.orm import scoped_session, sessionmaker

    scoped = scoped_session(sessionmaker(engine))
    try:
        enqueue(scoped, "scoped-1")
        scoped.commit()
    finally:
        scoped.remove()
    assert set(stored(dsn)) == {"scoped-1"}


def test_sqlalchemy_autocommit_engine_warns(dsn, engine):
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn, \
            pytest.warns(AutocommitWarning):
        enqueue(conn, "sa-auto")
    assert set(stored(dsn)) == {"sa-auto"}


def test_a_sqlalchemy_engine_on_another_driver_is_refused_naming_the_url_to_use():
    from sqlalchemy import create_engine
    from sqlalchemy.orm import Session

    other = create_engine("sqlite://")  # a real SQLAlchemy engine whose driver is not psycopg
    try:
        with other.connect() as conn, pytest.raises(TypeError, match=r"sqlite3.*postgresql\+psycopg://"):
            enqueue(conn, "x")
        with Session(other) as session, pytest.raises(TypeError, match="postgresql\\+psycopg://"):
            enqueue_many(session, ["x"])
    finally:
        other.dispose()


@pytest.mark.slow
def test_sqlalchemy_async_objects_need_the_async_twins(dsn, async_engine):
    from sqlalchemy.ext.asyncio import AsyncSession

    with pytest.raises(TypeError, match="enqueue_async"):
        enqueue(AsyncSession(async_engine), "x")


@pytest.mark.slow
async def test_sqlalchemy_async_connection_and_session(dsn, async_engine, listener):
    from sqlalchemy import text
    from sqlalchemy.ext.asyncio import AsyncSession, async_scoped_session, async_sessionmaker

    insert = text("INSERT INTO orders (id) VALUES (:id)")
    async with async_engine.begin() as conn:
        await conn.execute(insert, {"id": "ac-1"})
        assert isinstance(await enqueue_async(conn, "ac-1"), uuid.UUID)
    async with async_engine.connect() as conn:
        await enqueue_many_async(conn, ["ac-2", "ac-3"])
        await conn.rollback()
    async with AsyncSession(async_engine) as session:
        await session.execute(insert, {"id": "as-1"})
        assert await enqueue_async(session, "as-1") is not None
        await session.commit()
    async with AsyncSession(async_engine) as session:
        await enqueue_async(session, "as-2")
        await session.rollback()
    import asyncio

    scoped = async_scoped_session(async_sessionmaker(async_engine),
                                  scopefunc=asyncio.current_task)
    await enqueue_many_async(scoped, ["as-3"])
    await scoped.commit()
    await scoped.remove()
    assert orders(dsn) == {"ac-1", "as-1"}
    assert set(stored(dsn)) == {"ac-1", "as-1", "as-3"}
    assert listener.count() == 0
