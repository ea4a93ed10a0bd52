"""Deadlines for many concurrent operations, kept by one periodic timer.

``asyncio.timeout_at`` arms a timer of its own per call. On uvloop (the
worker's event loop when installed) every timer is a libuv handle allocated
and closed again, which cost about as much CPU as a tenth of a whole HTTP
delivery (bench/README.md, "A maintained HTTP client"). A delivery needs a
deadline of seconds, not of microseconds, so :class:`Deadlines` keeps every
open scope in one table and checks the table with one timer every
``resolution_seconds``, armed only while a scope is open: a scope expires
between its deadline and one resolution later.

A scope behaves as ``asyncio.timeout_at``'s does (Python 3.11): when it
expires, the task running it is cancelled, and the ``CancelledError`` leaving
the ``with`` block becomes ``TimeoutError``, unless someone else cancelled the
task too (then the cancellation goes on). It is a plain ``with`` block, used
inside the task whose work it bounds.
"""

from __future__ import annotations

import asyncio
from types import TracebackType

#: Default seconds between two checks of the open scopes (the most a deadline is late).
RESOLUTION_SECONDS = 0.05


class DeadlineScope:
    """One open deadline (:meth:`Deadlines.at`); a context manager for one ``with`` block.

    Attributes:
        when: the deadline, on the event loop's clock (``loop.time()``, seconds).
        expired: True once the deadline has passed and the task was cancelled.
    """

    __slots__ = ("_cancelling", "_owner", "_task", "expired", "when")

    def __init__(self, owner: Deadlines, when: float) -> None:
        self._owner = owner
        self.when = when
        self.expired = False
        self._task: asyncio.Task[object] | None = None
        self._cancelling = 0

    def reschedule(self, when: float) -> None:
        """Move the deadline to *when* (loop clock, seconds); no effect once expired."""
        self.when = when
        if when < self._owner._earliest:
            self._owner._earliest = when

    def __enter__(self) -> DeadlineScope:
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("a deadline scope must be entered inside a task")
        self._task = task
        self._cancelling = task.cancelling()
        self._owner._open(self, task.get_loop())
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._owner._scopes.pop(self, None)
        if self.expired:
            assert self._task is not None
            if (self._task.uncancel() <= self._cancelling
                    and exc_type is asyncio.CancelledError):
                raise TimeoutError from exc


class Deadlines:
    """Open :class:`DeadlineScope` objects of one owner, checked by one timer.

    Args:
        resolution_seconds: seconds between two checks (> 0); a scope expires at
            most this much after its deadline.

    One instance may serve any number of concurrent tasks on one event loop at
    a time (a later loop, once the earlier one has no open scope, is fine).
    """

    def __init__(self, resolution_seconds: float = RESOLUTION_SECONDS) -> None:
        if resolution_seconds <= 0:
            raise ValueError("resolution_seconds must be positive")
        self.resolution_seconds = resolution_seconds
        self._scopes: dict[DeadlineScope, None] = {}
        #: No open scope is due before this (a bound: scopes that closed may have set it).
        self._earliest = float("inf")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None

    def at(self, when: float) -> DeadlineScope:
        """A scope that expires at *when* (the running loop's ``time()``, seconds)."""
        return DeadlineScope(self, when)

    def close(self) -> None:
        """Stop the timer (open scopes then no longer expire)."""
        if self._timer is not None:
            self._timer.cancel()
        self._timer = None
        self._loop = None

    def _open(self, scope: DeadlineScope, loop: asyncio.AbstractEventLoop) -> None:
        if self._loop is not loop:  # first use, or a new loop: forget the old one's
            self.close()
            self._scopes.clear()
            self._earliest = float("inf")
            self._loop = loop
        self._scopes[scope] = None
        if scope.when < self._earliest:
            self._earliest = scope.when
        if self._timer is None:
            self._timer = loop.call_at(loop.time() + self.resolution_seconds, self._check)

    def _check(self) -> None:
        """Cancel the task of every scope past its deadline; re-arm while scopes are open.

        The scopes are looked at only once the earliest deadline seen may have
        passed (most close long before theirs), then the earliest is recomputed.
        """
        self._timer = None
        loop = self._loop
        if loop is None or not self._scopes:
            self._earliest = float("inf")
            return
        now = loop.time()
        if self._earliest <= now:
            earliest = float("inf")
            for scope in self._scopes:
                if scope.expired:
                    continue
                if scope.when <= now:
                    scope.expired = True
                    assert scope._task is not None
                    scope._task.cancel()  # delivered at the task's next step, not here
                elif scope.when < earliest:
                    earliest = scope.when
            self._earliest = earliest
        self._timer = loop.call_at(now + self.resolution_seconds, self._check)
