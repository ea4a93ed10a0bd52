"""Benchmark child processes: a receipts worker, a PgQueuer or a Procrastinate consumer.

``python -m bench.child KIND --dsn DSN [options]``. Each child imports what it
needs, prints ``ready`` and waits for one line on stdin before it touches the
queue, so process start-up is never part of a measured interval. It runs
until SIGTERM (or, for the peers, until its queue is empty when ``--drain``),
then writes what it recorded (``--record FILE``: order id → wall-clock time
a delivery started, ``time.time()``) as JSON.

The deliverers and handlers are no-ops: they return at once (no HTTP), so
what is measured is the queue machinery of each system; a receipts worker
given ``--provider-url`` delivers over HTTP with the real deliverer.

``--profile FILE`` (receipts only) samples the worker with py-spy (the bench
extra) from "go" for ``--profile-seconds``, in py-spy's raw (collapsed stack)
format; ``python -m bench.experiments.profile`` turns it into a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from receipts.transport import TransportName

_CPU_AT_GO = [0.0]
_PROFILER: list[Any] = []


def _cpu() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _wait_for_go() -> None:
    print("ready", flush=True)
    sys.stdin.readline()
    _CPU_AT_GO[0] = _cpu()


def _start_profiler(path: str | None, seconds: float) -> None:
    """py-spy on this process (non-blocking sampling, 200 Hz) for *seconds*."""
    if not path:
        return
    import os
    import shutil
    import subprocess

    exe = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    _PROFILER.append(subprocess.Popen(
        [exe, "record", "--pid", str(os.getpid()), "--rate", "200", "--nonblocking",
         "--duration", str(max(1, round(seconds))), "--format", "raw", "--output", path],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))


def _write(path: str | None, record: dict[str, float]) -> None:
    for profiler in _PROFILER:
        profiler.wait(60)  # it writes its file when its duration is over
    if path:
        with open(path, "w") as fh:
            json.dump(record, fh)
    # The last stderr line: CPU seconds since "go" (read by bench.procs).
    print(json.dumps({"cpu_seconds": _cpu() - _CPU_AT_GO[0]}), file=sys.stderr)


# ----------------------------------------------------------------- receipts


class NoopDeliverer:
    """Delivers instantly, or after *delay_seconds* × U(0.5, 1.5) without any I/O
    (a provider's latency without its CPU); answers *fail_share* of the
    attempts with a 503 (retried later); optionally records when each delivery
    started."""

    def __init__(self, record: dict[str, float] | None, delay_seconds: float = 0.0,
                 fail_share: float = 0.0) -> None:
        from receipts.model import Outcome, Reason, Verdict

        self._outcome = Outcome(Verdict.DELIVERED, Reason.DELIVERED, 200)
        self._failure = Outcome(Verdict.RETRY, Reason.PROVIDER_5XX, 503, detail="injected 503")
        self._record = record
        self._delay = delay_seconds
        self._fail_share = fail_share

    async def deliver(self, job: Any) -> Any:
        import random

        if self._record is not None:
            self._record.setdefault(job.order_id, time.time())
        if self._delay:
            await asyncio.sleep(self._delay * random.uniform(0.5, 1.5))
        if self._fail_share and random.random() < self._fail_share:
            return self._failure
        return self._outcome

    async def aclose(self) -> None:
        return None


class RecordingHttp:
    """The real HTTP deliverer, recording delivery start times."""

    def __init__(self, inner: Any, record: dict[str, float]) -> None:
        self._inner = inner
        self._record = record

    async def deliver(self, job: Any) -> Any:
        self._record.setdefault(job.order_id, time.time())
        return await self._inner.deliver(job)

    async def aclose(self) -> None:
        await self._inner.aclose()


#: --transport choices: the HTTP client under the deliverer (RECEIPTS_PROVIDER_TRANSPORT's).
TRANSPORTS = ("aiohttp", "httpx")


def http_deliverer(settings: Any, transport: str) -> Any:
    """The deliverer ``make_deliverer`` builds, over *transport* (:data:`TRANSPORTS`):
    ``aiohttp`` (the default) or ``httpx`` (httpx's own transport, httpcore + h11),
    both behind :mod:`receipts.transport`'s one door."""
    from receipts.delivery import HttpDeliverer

    name: TransportName = "httpx" if transport == "httpx" else "aiohttp"
    if transport != name:
        raise SystemExit(f"--transport: one of {', '.join(TRANSPORTS)}")
    return HttpDeliverer(settings.provider_url, timeout_seconds=settings.delivery_timeout_seconds,
                         max_connections=settings.concurrency, transport=name)


def _log_claims(path: str) -> None:
    """Time every claim statement of this worker: one line per claim appended to
    *path*: Unix time (s), duration (ms), jobs claimed, acks it carried (the soak
    reads it; a claim that carries acks is also their ack statement).

    Wraps ``JobQueue.claim`` in this process only: the worker runs unchanged.
    """
    from receipts.jobqueue import JobQueue

    original = JobQueue.claim
    out = open(path, "a", buffering=1)  # noqa: SIM115 - open for the process's lifetime

    async def claim(self: Any, limit: int, **kwargs: Any) -> Any:
        start = time.perf_counter()
        result = await original(self, limit, **kwargs)
        out.write(f"{time.time():.3f} {(time.perf_counter() - start) * 1000:.3f} "
                  f"{len(result.attempts)} {len(kwargs.get('acks') or ())}\n")
        return result

    JobQueue.claim = claim  # type: ignore[method-assign]


def run_receipts(args: argparse.Namespace) -> None:
    from receipts.logs import configure_logging
    from receipts.runtime import run_on_loop, run_worker
    from receipts.settings import load_settings

    configure_logging("WARNING")
    settings = load_settings(
        database_url=args.dsn,
        provider_url=args.provider_url or "http://127.0.0.1:9/receipts",
        concurrency=args.concurrency,
        claim_batch_max=args.batch,
        listen_notify=not args.no_listen,
        poll_interval_seconds=args.poll_seconds,
        metrics_port=args.metrics_port,
        log_level="WARNING",
        pool_max_size=args.pool,
        application_name=args.app_name,
        shutdown_grace_seconds=10.0,
        provider_rate_limit_per_second=args.rate_limit,
        provider_burst=args.burst,
        event_loop=args.event_loop,
        synchronous_commit=args.synchronous_commit,
        **({"queue_stats_interval_seconds": args.queue_stats_seconds}
           if args.queue_stats_seconds is not None else {}),
        **({"retry_base_seconds": args.retry_base_seconds}
           if args.retry_base_seconds is not None else {}),
        **({"admission_control": args.admission == "on"} if args.admission else {}),
    )
    if args.claim_log:
        _log_claims(args.claim_log)
    record: dict[str, float] | None = {} if args.record else None
    deliverer: Any
    if args.provider_url:
        from receipts.runtime import make_deliverer

        # What `receipts worker` builds (None: run_worker builds it the same way),
        # or the same deliverer over another transport (--transport, for A/B runs).
        deliverer = http_deliverer(settings, args.transport) if args.transport else None
        if record is not None:
            deliverer = RecordingHttp(deliverer or make_deliverer(settings), record)
    else:
        deliverer = NoopDeliverer(record, args.delay_ms / 1000.0, args.fail_percent / 100.0)
    _wait_for_go()
    _start_profiler(args.profile, args.profile_seconds)
    # The loop `receipts worker` runs on (RECEIPTS_EVENT_LOOP; --event-loop here).
    run_on_loop(settings, run_worker(settings, deliverer))
    _write(args.record, record or {})


# ----------------------------------------------------------------- PgQueuer


def run_pgqueuer(args: argparse.Namespace) -> None:
    """PgQueuer's own benchmark set-up (tools/benchmark.py): asyncpg, uvloop,
    ``dequeue`` consumers of ``batch_size`` 10 each on its own connection."""
    import asyncpg
    import uvloop
    from pgqueuer import PgQueuer, types
    from pgqueuer.db import AsyncpgDriver

    record: dict[str, float] = {}

    async def main() -> None:
        conns = [await asyncpg.connect(dsn=args.dsn) for _ in range(args.consumers)]
        pgqs = [PgQueuer(AsyncpgDriver(c)) for c in conns]
        for pgq in pgqs:
            @pgq.entrypoint("noop")  # type: ignore[untyped-decorator]
            async def noop(job: Any) -> None:
                if args.record:
                    record.setdefault((job.payload or b"").decode(), time.time())

        def stop() -> None:
            for pgq in pgqs:
                pgq.shutdown.set()

        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop)
        await loop.run_in_executor(None, _wait_for_go)
        mode = types.QueueExecutionMode.drain if args.drain else types.QueueExecutionMode.continuous
        await asyncio.gather(*(p.run(batch_size=args.batch, mode=mode) for p in pgqs))
        for c in conns:
            await c.close()

    uvloop.run(main())
    _write(args.record, record)


# ------------------------------------------------------------- Procrastinate


def run_procrastinate(args: argparse.Namespace) -> None:
    """A Procrastinate worker (PsycopgConnector, LISTEN/NOTIFY, ``concurrency``)."""
    import logging

    import procrastinate

    logging.basicConfig(level=logging.WARNING)
    record: dict[str, float] = {}
    app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=args.dsn))

    @app.task(name="noop")  # type: ignore[untyped-decorator]
    async def noop(order: str = "") -> None:
        if args.record:
            record.setdefault(order, time.time())

    async def main() -> None:
        async with app.open_async():
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, _wait_for_go)
            await app.run_worker_async(
                concurrency=args.concurrency,
                wait=not args.drain,
                listen_notify=not args.no_listen,
                fetch_job_polling_interval=args.poll_seconds,
                delete_jobs="successful" if args.delete_jobs else "never",
                install_signal_handlers=True,
            )

    asyncio.run(main())
    _write(args.record, record)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.child")
    p.add_argument("kind", choices=["receipts", "pgqueuer", "procrastinate"])
    p.add_argument("--dsn", required=True)
    p.add_argument("--concurrency", type=int, default=200)
    p.add_argument("--batch", type=int, default=100)
    p.add_argument("--consumers", type=int, default=5)
    p.add_argument("--pool", type=int, default=2)
    p.add_argument("--no-listen", action="store_true")
    p.add_argument("--poll-seconds", type=float, default=1.0)
    p.add_argument("--provider-url")
    p.add_argument("--record")
    p.add_argument("--drain", action="store_true")
    p.add_argument("--delete-jobs", action="store_true")
    p.add_argument("--app-name", default="receipts")
    p.add_argument("--admission", choices=["on", "off"], default=None,
                   help="receipts: admission control (default: the setting's default)")
    p.add_argument("--no-admission", dest="admission", action="store_const", const="off",
                   help="receipts: the same as --admission off")
    p.add_argument("--event-loop", choices=["auto", "asyncio", "uvloop"], default="auto",
                   help="receipts: RECEIPTS_EVENT_LOOP (default auto, as `receipts worker`)")
    p.add_argument("--metrics-port", type=int, default=0,
                   help="receipts: serve /metrics on this port (default 0: not served)")
    p.add_argument("--rate-limit", type=float, default=0.0,
                   help="receipts: fleet-wide provider rate limit, jobs/s (default 0: none)")
    p.add_argument("--burst", type=float, default=None,
                   help="receipts: token bucket capacity, jobs (default: 1 s of the limit)")
    p.add_argument("--transport", choices=TRANSPORTS,
                   help="receipts over HTTP: the client under the deliverer (default: "
                        "what `receipts worker` builds)")
    p.add_argument("--synchronous-commit", choices=["on", "off", "local"], default="off",
                   help="receipts: RECEIPTS_SYNCHRONOUS_COMMIT (default off, as the service)")
    p.add_argument("--delay-ms", type=float, default=0.0,
                   help="receipts: the no-op deliverer answers after this × U(0.5, 1.5) ms")
    p.add_argument("--fail-percent", type=float, default=0.0,
                   help="receipts: the no-op deliverer answers this share (%%) with a 503")
    p.add_argument("--queue-stats-seconds", type=float, default=None,
                   help="receipts: RECEIPTS_QUEUE_STATS_INTERVAL_SECONDS (default: the setting's)")
    p.add_argument("--retry-base-seconds", type=float, default=None,
                   help="receipts: RECEIPTS_RETRY_BASE_SECONDS (default: the setting's)")
    p.add_argument("--claim-log",
                   help="receipts: append 'unix time, ms, jobs, acks' per claim here")
    p.add_argument("--profile", help="receipts: py-spy raw profile to this file")
    p.add_argument("--profile-seconds", type=float, default=6.0)
    args = p.parse_args(argv)
    {"receipts": run_receipts, "pgqueuer": run_pgqueuer,
     "procrastinate": run_procrastinate}[args.kind](args)


if __name__ == "__main__":
    main()
