"""The durability watch: a write counts once a read from the same server proves it flushed."""

from __future__ import annotations

from receipts.durability import CommitWatch
from receipts.jobqueue import WalPosition


def read(insert: int, flush: int, since: float = 0.0) -> WalPosition:
    return WalPosition(insert_lsn=insert, flush_lsn=flush, connection_since=since)


def test_a_write_is_durable_once_a_later_read_flushed_past_the_insert_position_after_it():
    watch: CommitWatch[str] = CommitWatch()
    watch.hold("ack-1", sent_at=10.0, returned_at=10.1, now=10.1)
    # Started before the write returned: says nothing about it.
    assert watch.observe(read(500, 100), read_at=10.05, now=10.2) == ([], [])
    # Started after: bounds its commit record at 900, flushed only to 600 so far.
    assert watch.observe(read(900, 600), read_at=10.2, now=10.3) == ([], [])
    assert watch.observe(read(950, 899), read_at=10.3, now=10.4) == ([], [])
    assert watch.observe(read(990, 900), read_at=10.4, now=10.5) == (["ack-1"], [])
    assert len(watch) == 0


def test_a_read_that_finds_everything_flushed_proves_at_once():
    watch: CommitWatch[str] = CommitWatch()
    watch.hold("ack-1", sent_at=1.0, returned_at=1.1, now=1.1)
    assert watch.observe(read(700, 700), read_at=1.2, now=1.2) == (["ack-1"], [])


def test_a_connection_younger_than_the_write_cannot_prove_it_and_reports_it_at_once():
    """It may talk to a server that restarted after a crash since the write."""
    watch: CommitWatch[str] = CommitWatch()
    watch.hold("ack-1", sent_at=5.0, returned_at=5.1, now=5.1)
    assert watch.observe(read(100, 100, since=1.0), read_at=5.2, now=5.2) == (["ack-1"], [])
    watch.hold("ack-2", sent_at=6.0, returned_at=6.1, now=6.1)
    durable, unproven = watch.observe(read(100, 100, since=6.05), read_at=6.2, now=6.2)
    assert (durable, unproven) == ([], ["ack-2"])


def test_after_every_connection_was_replaced_the_older_writes_are_checked_not_counted():
    watch: CommitWatch[str] = CommitWatch()
    watch.hold("before-crash-1", sent_at=1.0, returned_at=1.01, now=1.01)
    watch.hold("before-crash-2", sent_at=1.02, returned_at=1.03, now=1.03)
    assert watch.observe(read(400, 100, since=0.0), read_at=1.05, now=1.05) == ([], [])
    # The crash: the next read runs over a connection first used after it.
    watch.hold("after-restart", sent_at=3.5, returned_at=3.6, now=3.6)
    durable, unproven = watch.observe(read(50, 50, since=3.0), read_at=3.7, now=3.7)
    assert durable == ["after-restart"]
    assert unproven == ["before-crash-1", "before-crash-2"]


def test_a_write_no_read_proves_in_time_is_reported_unproven():
    watch: CommitWatch[str] = CommitWatch(timeout_seconds=2.0)
    watch.hold("ack-1", sent_at=1.0, returned_at=1.1, now=1.1)
    assert watch.observe(read(100, 10), read_at=1.2, now=1.2) == ([], [])
    assert watch.observe(read(100, 50), read_at=2.0, now=2.0) == ([], [])
    assert watch.observe(read(100, 60), read_at=3.2, now=3.2) == ([], ["ack-1"])


def test_release_hands_back_what_is_still_held():
    watch: CommitWatch[int] = CommitWatch()
    for i in range(3):
        watch.hold(i, sent_at=1.0, returned_at=1.0, now=1.0)
    assert watch.release() == [0, 1, 2] and len(watch) == 0
