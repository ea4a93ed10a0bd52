"""Which asynchronously committed writes are known durable: the completer counts only those.

The worker's sessions commit with ``synchronous_commit = off`` by default
(docs/design.md §2, "What a database crash may undo"): a write returns once
its commit record is in the server's WAL buffers, and a crash of the server
in the next fraction of a second undoes it. Counting an ack when it returns
would then count acks that never happened (the same job is acked again
later, and ``receipts_acks_total`` outgrows the done rows). So an outcome
that returned is *held* here until it is proven durable:

* a read of the server's WAL positions (:class:`~receipts.jobqueue.WalPosition`)
  that started after the write returned bounds its commit record by the
  read's insert position;
* a read whose flush position has reached that bound proves it on disk.

Both reads must come from the server incarnation that ran the write. A crash
ends every connection, so a read over a connection this process already used
before it sent the write (``connection_since < sent_at``) is one. A read over
a younger connection cannot prove the write, and may be talking to a server
that restarted since: the write is reported *unproven* at once (so after a
crash the worker learns what it lost within one read), as is a write no read
proved within ``timeout_seconds``. The completer then asks the rows
(``resolve_writes``): a write still there is held again, from then on; one
that is gone was undone, and is written again. A connection that is merely
new (the pool grew, or replaced an old one) costs one such question.

This module is pure bookkeeping (no I/O, no clock of its own), tested on
synthetic reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

from receipts.jobqueue import WalPosition

T = TypeVar("T")

#: A held write that no read has proven after this long is checked against its
#: row, seconds. The WAL writer flushes every 200 ms (wal_writer_delay), so a
#: healthy server proves a write within about half a second.
PROOF_TIMEOUT_SECONDS = 5.0


@dataclass(slots=True)
class _Held(Generic[T]):
    item: T
    sent_at: float
    returned_at: float
    held_at: float
    bound: int | None = None


class CommitWatch(Generic[T]):
    """Writes that returned, waiting to be proven durable (see the module doc).

    Args:
        timeout_seconds: how long a write may wait for a proof before it is
            reported unproven (checked against its row by the caller).

    Times are ``time.monotonic()`` seconds, passed in by the caller.
    """

    def __init__(self, *, timeout_seconds: float = PROOF_TIMEOUT_SECONDS) -> None:
        self.timeout_seconds = timeout_seconds
        self._held: list[_Held[T]] = []

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, item: T, *, sent_at: float, returned_at: float, now: float) -> None:
        """Hold *item*, whose write was sent at *sent_at* and returned at *returned_at*."""
        self._held.append(_Held(item, sent_at, returned_at, now))

    def observe(self, position: WalPosition, *, read_at: float, now: float
                ) -> tuple[list[T], list[T]]:
        """Take one read that started at *read_at*; returns (durable items, unproven items).

        Both returned lists leave the watch: durable ones are to be counted,
        unproven ones checked against their rows.
        """
        durable: list[T] = []
        unproven: list[T] = []
        keep: list[_Held[T]] = []
        for held in self._held:
            if position.connection_since < held.sent_at:  # same server as the write
                if held.bound is None and read_at > held.returned_at:
                    held.bound = position.insert_lsn
                if held.bound is not None and position.flush_lsn >= held.bound:
                    durable.append(held.item)
                    continue
            else:  # a younger connection: the server may have restarted since the write
                unproven.append(held.item)
                continue
            if now - held.held_at > self.timeout_seconds:
                unproven.append(held.item)
                continue
            keep.append(held)
        self._held = keep
        return durable, unproven

    def release(self) -> list[T]:
        """Every item still held (at shutdown), emptying the watch."""
        items = [held.item for held in self._held]
        self._held = []
        return items
