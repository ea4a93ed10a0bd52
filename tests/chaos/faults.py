"""The chaos run's faults: a seeded schedule and one coroutine per kind.

:class:`FaultInjector` fires one round of every kind of
:data:`~tests.chaos.checks.FAULT_KINDS` per ``cycle_seconds`` of enqueueing,
at times drawn from the run's seed, and counts what it injected
(:attr:`FaultInjector.faults`) and what followed (:attr:`FaultInjector.effects`).
Processes are reached through the run's :class:`~receipts.supervisor.Supervisor`,
the database through the run's embedded server and :class:`~tests.chaos.pgproxy.PgProxy`.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import httpx
import psycopg

from receipts.supervisor import ChildError
from tests.chaos.checks import FAULT_KINDS
from tests.chaos.pgproxy import CLAIM_MARKERS

if TYPE_CHECKING:
    from tests.chaos.run import ChaosRun, WorkerProc

#: The provider's settings outside a fault window (PUT /faults).
PROVIDER_BASELINE: dict[str, Any] = {
    "latency_seconds": 0.005, "latency_jitter_seconds": 0.02, "error_rate": 0.0,
    "rate_limit_rate": 0.0, "retry_after_seconds": 1.0, "timeout_rate": 0.0,
    "reset_rate": 0.0, "hang_after_headers_rate": 0.0,
}


#: What pg_stat_activity.query looks like (LIKE, all of them) for the statements the
#: terminate fault catches: a claim (the proxy's markers) and an ack. The statements
#: start with their flow-control CTE and name their schema, so only markers inside
#: them are stable.
TERMINATE_PATTERNS: dict[str, tuple[str, ...]] = {
    "claim": tuple(f"%{m.decode()}%" for m in CLAIM_MARKERS),
    "ack": ("%UPDATE %receipt_jobs AS j%", "%SET state = 'done'%", "%last_token = a.token%"),
}

#: How long the proxy holds connections half-open: past the chaos workers' statement
#: deadline (statement timeout 2 s + 5 s), short of the watchdog (2 × 7 + 10 s).
HALF_OPEN_SECONDS = 9.0


class FaultInjector:
    """Inject the faults of one run; see the module doc."""

    def __init__(self, run: ChaosRun, rng: random.Random) -> None:
        self.run = run
        self.cfg = run.cfg
        self.rng = rng
        self.faults: Counter[str] = Counter()
        self.effects: Counter[str] = Counter()
        self.crashes: list[str] = []  # fault coroutines that raised
        self.provider_windows = 0  # provider fault windows open now
        self.stalling = False  # a db_stall is in progress (provider windows wait)
        self.provider_quiet_at = 0.0  # monotonic time the last window's requests are over

    def schedule(self, duration: float) -> list[tuple[float, str]]:
        """``(seconds from start, kind)`` for *duration* seconds: one round per cycle."""
        cycles = max(1, math.ceil(duration / self.cfg.cycle_seconds))
        span = duration / cycles
        events = []
        for c in range(cycles):
            lo = c * span + (1.0 if c == 0 else 0.0)
            for kind in FAULT_KINDS:
                # The proxy's faults need jobs still flowing to the proxied worker: early
                # in the cycle.
                early = kind in ("db_stall", "claim_cut", "write_cut")
                hi = lo + 0.4 * span if early else (c + 1) * span - 0.5
                events.append((self.rng.uniform(lo, max(lo + 0.1, hi)), kind))
        return sorted(events)

    async def inject(self, duration: float) -> None:
        """Fire the :meth:`schedule` for *duration*; return when every fault is over."""
        started = time.monotonic()
        tasks = []
        for at, kind in self.schedule(duration):
            pause = started + at - time.monotonic()
            if pause > 0:
                await asyncio.sleep(pause)
            tasks.append(asyncio.create_task(self.fault(kind), name=kind))
        results = await asyncio.gather(*tasks, return_exceptions=True)
        for task, result in zip(tasks, results, strict=True):
            if isinstance(result, BaseException):
                self.crashes.append(f"fault {task.get_name()} crashed: {result!r}")

    async def fault(self, kind: str) -> None:
        """Inject one fault of *kind*."""
        handler = getattr(self, f"_fault_{kind}", None)
        if handler is not None:
            await handler()
            return
        await self._provider_window(kind)

    # ------------------------------------------------------------ provider

    async def set_provider(self, **changes: Any) -> None:
        """PUT *changes* to the provider's ``/faults``."""
        response = await asyncio.to_thread(self.run.provider.request, "PUT", "/faults",
                                           json=changes)
        response.raise_for_status()

    async def _provider_window(self, kind: str) -> None:
        windows: dict[str, tuple[dict[str, Any], float]] = {
            "latency_spike": ({"latency_seconds": self.cfg.delivery_timeout_seconds + 0.5}, 1.5),
            "burst_5xx": ({"error_rate": 0.6}, 1.0),
            "burst_429": ({"rate_limit_rate": 0.5, "retry_after_seconds": 1.0}, 1.0),
            "hang_after_headers": ({"hang_after_headers_rate": 0.15}, 1.5),
            "reset": ({"reset_rate": 0.15}, 1.5),
            "hang": ({"timeout_rate": 0.15}, 1.5),
        }
        changes, seconds = windows[kind]
        self.faults[kind] += 1
        deadline = time.monotonic() + 15
        while self.stalling and time.monotonic() < deadline:
            await asyncio.sleep(0.05)  # keep the stall's deliveries successful
        self.run.say(f"provider: {kind} for {seconds:g}s")
        self.provider_windows += 1
        try:
            await self.set_provider(**changes)
            await asyncio.sleep(seconds)  # the window's length
            await self.set_provider(**{k: PROVIDER_BASELINE[k] for k in changes})
        finally:
            self.provider_windows -= 1
            self.provider_quiet_at = max(
                self.provider_quiet_at,
                time.monotonic() + self.cfg.delivery_timeout_seconds + 0.3)

    # ------------------------------------------------------------ processes

    async def _victim(self) -> WorkerProc | None:
        """A direct (unproxied), running, unpaused worker with deliveries in flight, if one
        shows up within 3 s (else any of them)."""
        deadline = time.monotonic() + 3.0
        candidates = [w for w in self.run.live_workers()
                      if not w.proxied and not w.child.paused]
        if not candidates:
            return None
        self.rng.shuffle(candidates)
        while time.monotonic() < deadline:
            for w in candidates:
                with contextlib.suppress(httpx.HTTPError, ChildError, ValueError):
                    m = await asyncio.to_thread(w.child.scrape)
                    if m.total("receipts_inflight_deliveries") > 0:
                        w.metrics = m
                        return w
            await asyncio.sleep(0.02)
        return candidates[0]

    async def _fault_sigkill(self) -> None:
        victim = await self._victim()
        if victim is None:
            return
        inflight = int(victim.metrics.total("receipts_inflight_deliveries"))
        victim.killed = True
        await asyncio.to_thread(victim.child.kill)
        self.faults["sigkill"] += 1
        self.effects["jobs_abandoned"] += inflight
        replacement = await self.run.start_worker()
        self.run.say(f"SIGKILL {victim.child.name} ({inflight} in flight); "
                     f"replacement {replacement.child.name}")

    async def _fault_sigstop(self) -> None:
        victim = await self._victim()
        if victim is None:
            return
        hold = self.cfg.lease_seconds + 2.0
        victim.paused = True
        victim.child.pause()
        self.faults["sigstop"] += 1
        self.run.say(f"SIGSTOP {victim.child.name} for {hold:g}s "
                     f"(lease {self.cfg.lease_seconds:g}s)")
        await asyncio.sleep(hold)  # the fault: paused past its leases
        victim.child.resume()
        self.run.say(f"SIGCONT {victim.child.name}")

    # ------------------------------------------------------------- database

    async def _fault_pg_restart(self) -> None:
        self.faults["pg_restart"] += 1
        started = time.monotonic()
        await asyncio.to_thread(self.run.pg.restart, "fast")
        self.run.say(f"PostgreSQL restarted (fast) in {time.monotonic() - started:.1f}s")

    async def _fault_terminate(self) -> None:
        """Terminate worker backends caught mid-claim and mid-ack (≤ 2 each, ≤ 3 s)."""
        self.faults["terminate"] += 1
        wanted = {"claim": 2, "ack": 2}
        patterns = TERMINATE_PATTERNS
        deadline = time.monotonic() + 3.0
        try:
            async with await psycopg.AsyncConnection.connect(
                self.run.dsn, autocommit=True, application_name="chaos-harness",
                connect_timeout=3,
            ) as conn:
                while time.monotonic() < deadline and any(wanted.values()):
                    for what, pattern in patterns.items():
                        if not wanted[what]:
                            continue
                        cur = await conn.execute(
                            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                            " WHERE state = 'active' AND application_name LIKE 'chaos-w%%'"
                            " AND query LIKE ALL (%s) LIMIT 1", (list(pattern),))
                        if await cur.fetchone():
                            wanted[what] -= 1
                            self.effects[f"terminated_{what}"] += 1
                    await asyncio.sleep(0.002)
        except psycopg.Error:
            pass
        self.run.say(f"terminated backends: {self.effects['terminated_claim']} mid-claim,"
                     f" {self.effects['terminated_ack']} mid-ack so far")

    async def _quiet_provider(self, seconds: float) -> None:
        """Wait (at most *seconds*) until no provider fault window is open.

        A provider window makes the fleet pause (flow control), and a paused
        fleet claims and writes nothing for a proxy fault to catch.
        """
        deadline = time.monotonic() + seconds
        while ((self.provider_windows or time.monotonic() < self.provider_quiet_at)
               and time.monotonic() < deadline):
            await asyncio.sleep(0.05)

    async def _cut(self, kind: str, cuts: list[Any], arm: Callable[[int], None]) -> bool:
        """Arm one proxy cut of *kind* once the provider is quiet; True when it happened.

        *cuts* is the proxy's record of that kind of cut, *arm* arms more (or,
        with a negative count, disarms what did not fire within 15 s).
        """
        await self._quiet_provider(10)
        self.faults[kind] += 1
        before = len(cuts)
        arm(1)
        deadline = time.monotonic() + 15
        while len(cuts) == before and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if len(cuts) > before:
            return True
        arm(-1)
        return False

    async def _fault_claim_cut(self) -> None:
        proxy = self.run.proxy
        if await self._cut("claim_cut", proxy.cuts, proxy.arm_cut):
            self.run.say(f"proxy cut a committed claim of {len(proxy.cuts[-1].rows)} job(s)")

    async def _fault_write_cut(self) -> None:
        """Let the proxied worker's next ack or reschedule commit; drop its answer."""
        proxy = self.run.proxy
        if await self._cut("write_cut", proxy.write_cuts, proxy.arm_cut_write):
            self.effects["write_answers_cut"] += 1
            self.run.say("proxy cut the answer of a committed ack/reschedule")

    async def _fault_half_open(self) -> None:
        """Hold every proxied connection half-open past the worker's statement deadline."""
        seconds = HALF_OPEN_SECONDS
        self.faults["half_open"] += 1
        self.run.say(f"proxy holds the proxied worker's connections half-open for {seconds:g}s")
        self.run.proxy.hold(seconds)
        await asyncio.sleep(seconds)

    async def _fault_db_stall(self) -> None:
        """Stall the proxied worker's link right after a claim, while the provider is sane."""
        proxy = self.run.proxy
        hold = self.cfg.lease_seconds + 1.5
        deadline = time.monotonic() + 10
        while ((self.provider_windows or time.monotonic() < self.provider_quiet_at)
               and time.monotonic() < deadline):
            await asyncio.sleep(0.05)  # deliveries must succeed, so that acks are late
        self.stalling = True
        try:
            proxy.arm_stall(hold)
            while proxy.stall_armed and time.monotonic() < deadline + 5:
                await asyncio.sleep(0.02)
            if proxy.stall_armed:  # no claim with rows came: nothing injected
                proxy.arm_stall(0.0)
                self.run.say("proxy stall not triggered (no claim with rows)")
                return
            self.faults["db_stall"] += 1
            self.run.say(f"proxy stalls the proxied worker's database link for {hold:g}s"
                         " right after a claim")
            await asyncio.sleep(hold)  # the fault: the link is held this long
        finally:
            self.stalling = False
