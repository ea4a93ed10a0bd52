"""Summaries over rounds (median, min–max), the target ratios, the table.

The top of the core: it reads every scenario's runs, the bill's included
(:mod:`bench.bill`); nothing in the core imports it back (a run's document is
written by :func:`bench.document.write_json`)."""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Sequence
from datetime import datetime
from operator import itemgetter
from pathlib import Path
from typing import Any

from bench import bill
from bench.document import write_json as write_json  # re-exported: bench.run

LITTLE_BOUND = 400 / 0.2  # 400 slots / 200 ms: deliveries/s by Little's law
POLL_BOUND_MS = 1000 * 1.25  # poll interval 1 s + its 25 % jitter
WAKER_PICKUP_GOAL_MS = 100.0  # pickup p99 with the defaults (the fleet's waker, no NOTIFY)
#: Targets of the capacity figures (ratios measured in one run on one machine).
RAW_RATIO_GOAL = 0.8  # no-op receipts / raw pgbench limit, batch 100
LITTLE_RATIO_GOAL = 0.9  # 400 slots @ 200 ms / Little's bound
HTTP_CPU_GOAL_US = 200.0  # worker CPU per HTTP delivery, µs
CHECKOUT_P99_GOAL = 1.5  # checkout p99 under a drain / idle
ADMISSION_RATE_GOAL = 0.5  # drain rate with admission control on / off (default settings)
RATE_LIMIT_TOLERANCE = 0.10  # requests/s per window within ±10 % of the fleet limit
FLOW_CHECK_GOAL = 0.95  # claim with the pause check / without it (jobs/s)
BILL_GOAL = 1.2  # the worker's DB CPU and WAL per job / the raw limit's (bench.bill)


def stat(values: Sequence[float]) -> dict[str, float]:
    """Median, min and max of the rounds' values."""
    vals = [float(v) for v in values]
    if not vals:
        return {"median": 0.0, "min": 0.0, "max": 0.0, "n": 0}
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals),
            "n": len(vals)}


def _over(runs: list[dict[str, Any]], pick: Callable[[dict[str, Any]], Any]) -> dict[str, float]:
    return stat([float(pick(r)) for r in runs])


def _at(runs: list[dict[str, Any]], *path: str) -> dict[str, float]:
    """:func:`stat` of ``run[path[0]][path[1]]…`` over the runs."""
    values = []
    for run in runs:
        value: Any = run
        for key in path:
            value = value[key]
        values.append(float(value))
    return stat(values)


def build(results: dict[str, list[Any]], *, plan: dict[str, Any], machine: dict[str, Any],
          started: datetime, finished: datetime) -> dict[str, Any]:
    """The JSON document: every raw run, the summaries and the target checks."""
    s: dict[str, Any] = {}
    raw: dict[str, Any] = {}
    raw_cpu: dict[str, Any] = {}
    for key, runs in results.items():
        if key.startswith("raw:"):
            _, batch, clients = key.split(":")
            raw.setdefault(batch, {})[clients] = _over(runs, lambda r: r["jobs_per_second"])
            if all(r.get("db_cpu_us_per_job") is not None for r in runs):
                raw_cpu.setdefault(batch, {})[clients] = {
                    k: _over(runs, itemgetter(k))
                    for k in ("db_cpu_us_per_job", "client_cpu_us_per_job")}
    s["raw"] = raw
    if raw_cpu:
        s["raw_cpu"] = raw_cpu
    s["raw_best"] = {b: max(by.items(), key=lambda kv: kv[1]["median"]) for b, by in raw.items()}
    s["raw_best"] = {b: {"clients": int(c), **v} for b, (c, v) in s["raw_best"].items()}

    def drains(prefix: str) -> dict[str, Any]:
        out = {}
        for key, runs in results.items():
            if key == prefix or key.startswith(prefix + ":"):
                out[key] = {
                    "jobs_per_second": _over(runs, lambda r: r["jobs_per_second"]),
                    "worker_cpu_us_per_job": _over(runs, lambda r: r["worker_cpu_us_per_job"]),
                    "max_connections": max(r["max_connections"] for r in runs),
                    "connections_by_application": _peak_by_app(runs),
                }
                if all("db_cpu_us_per_job" in r for r in runs):
                    out[key]["db_cpu_us_per_job"] = _over(runs, lambda r: r["db_cpu_us_per_job"])
        return out

    s["receipts"] = drains("receipts:noop")
    s["pgqueuer"] = drains("pgqueuer")
    s["procrastinate"] = drains("procrastinate")
    s["http0"] = drains("receipts:http0")
    s["connections"] = drains("connections")
    s["admission"] = drains("admission")
    s["capacity"] = capacity(results)
    s["pickup"] = {
        key.removeprefix("pickup:"): {
            "p50_ms": _over(runs, lambda r: r["p50_ms"]),
            "p99_ms": _over(runs, lambda r: r["p99_ms"]),
        }
        for key, runs in results.items() if key.startswith("pickup:")
    }
    if "claim" in results:
        runs = results["claim"]
        s["claim"] = {
            case: {q: _at(runs, case, q) for q in ("p50_ms", "p99_ms")}
            for case in ("empty", "scale", "after_update")
        }
        s["claim"]["after_update"]["first_claim_ms"] = _over(
            runs, lambda r: r["after_update"]["first_claim_ms"])
        s["claim"]["uses_ready_index"] = all(r["scale"]["uses_ready_index"] for r in runs)
        s["claim"]["plan"] = runs[-1]["scale"]["plan"]
        s["claim"]["dead_tuples_after_update"] = runs[-1]["after_update"]["dead_tuples"]
    if "vacuum" in results:
        s["vacuum"] = results["vacuum"][0]
    for key in ("checkout", "checkout:slots32"):
        if key not in results:
            continue
        s[key] = _checkout_summary(results[key])
    if "outage" in results:
        runs = results["outage"]
        s["outage"] = {f: stat([r[f] for r in runs if r[f] is not None])
                       for f in ("failed", "requests_during_outage", "resume_seconds",
                                 "drained_seconds", "wall_seconds", "max_attempts")}
        s["outage"].update(jobs=runs[0]["jobs"], outage_seconds=runs[0]["outage_seconds"],
                           concurrency=runs[0]["concurrency"])
    if "ratelimit:accuracy" in results:
        runs = results["ratelimit:accuracy"]
        s["ratelimit_accuracy"] = {
            "limit_per_second": runs[0]["limit_per_second"],
            "processes": runs[0]["processes"],
            "window_seconds": runs[0]["window_seconds"],
            "mean_per_second": _over(runs, lambda r: r["mean_per_second"]),
            # The worst window of every round (largest deviation either way).
            "worst_deviation": max((r["worst_deviation"] for r in runs), key=abs),
            "windows": [w for r in runs for w in r["window_rates"]],
            "flow_row": runs[-1]["flow_row"],
        }
    if "ratelimit:overhead" in results:
        runs = results["ratelimit:overhead"]
        s["ratelimit_overhead"] = {
            "clients": runs[0]["clients"], "batch": runs[0]["batch"],
            "with_check": _at(runs, "with_check", "jobs_per_second"),
            "without_check": _at(runs, "without_check", "jobs_per_second"),
            "ratio": _over(runs, lambda r: r["ratio"]),
            "limited": {n: _at(runs, "limited", n, "jobs_per_second")
                        for n in runs[0]["limited"]},
            "flow_row": runs[-1]["flow_row"],
        }
    bill_runs = {k.removeprefix("bill:"): v for k, v in results.items() if k.startswith("bill:")}
    if bill_runs:
        s["bill"] = bill.summarise(bill_runs)
    return {
        "started": started.isoformat(timespec="seconds"),
        "finished": finished.isoformat(timespec="seconds"),
        "machine": machine,
        "plan": plan,
        "summary": s,
        "targets": targets(s),
        "runs": results,
    }


def _checkout_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """p50/p99 (ms) per phase; for drains their rate (jobs/s) and whether they lasted;
    the last run's claim-rate limit trace (admission-on phase)."""
    out: dict[str, Any] = {}
    phases = [k for k, v in runs[0].items() if isinstance(v, dict) and "p99_ms" in v]
    for phase in phases:
        first = runs[0][phase]
        v: dict[str, Any] = {q: _at(runs, phase, q) for q in ("p50_ms", "p99_ms")}
        v["concurrency"] = first.get("concurrency", runs[0]["concurrency"])
        v["batch"] = first.get("batch", runs[0]["batch"])
        v["admission"] = first.get("admission", True)
        if "drain_jobs_per_second" in first:
            v["drain_jobs_per_second"] = _at(runs, phase, "drain_jobs_per_second")
            v["still_running"] = all(r[phase]["jobs_left_at_end"] > 0 for r in runs)
        if "limit_trace" in first:
            v["limit_trace"] = runs[-1][phase]["limit_trace"]
            v["window_start_seconds"] = runs[-1][phase]["window_start_seconds"]
        out[phase] = v
    out["drain_still_running"] = all(r["drain"]["jobs_left_at_end"] > 0 for r in runs)
    out["concurrency"] = out["drain"]["concurrency"]
    out["batch"] = out["drain"]["batch"]
    return out


def capacity(results: dict[str, list[Any]]) -> dict[str, Any]:
    """The figures a capacity planner reads, under stable keys (bench/README.md).

    ``worker_cpu_us_per_http_delivery``: µs of worker-process CPU (user +
    system, from "go" to exit, divided by the jobs drained) per HTTP delivery
    with 400 slots against the reference provider at 200 ms, admission
    control off; ``…_0ms`` the same with 100 slots at 0 ms;
    ``worker_cpu_us_per_noop_job`` the queue machinery alone (one process,
    no-op deliverer); ``http_deliveries_per_second_per_process`` the 400-slot
    drain rate. Each is :func:`stat` (median, min, max, n) over the rounds;
    absent when its scenario did not run.
    """
    out: dict[str, Any] = {}
    for name, key, field in (
        ("worker_cpu_us_per_http_delivery", "connections", "worker_cpu_us_per_job"),
        ("worker_cpu_us_per_http_delivery_0ms", "receipts:http0", "worker_cpu_us_per_job"),
        ("worker_cpu_us_per_noop_job", "receipts:noop:1", "worker_cpu_us_per_job"),
        ("http_deliveries_per_second_per_process", "connections", "jobs_per_second"),
    ):
        if results.get(key):
            out[name] = _over(results[key], itemgetter(field))
    return out


def _peak_by_app(runs: list[dict[str, Any]]) -> dict[str, int]:
    """The most connections seen per application_name, over every run."""
    peak: dict[str, int] = {}
    for run in runs:
        for app, n in run["connections_by_application"].items():
            peak[app] = max(peak.get(app, 0), int(n))
    return peak


def _best(group: dict[str, Any]) -> tuple[str, float]:
    if not group:
        return "", 0.0
    key, value = max(group.items(), key=lambda kv: kv[1]["jobs_per_second"]["median"])
    return key, float(value["jobs_per_second"]["median"])


def _check(name: str, value: float | None, goal: str, met: bool | None,
           detail: str = "") -> dict[str, Any]:
    return {"target": name, "value": value, "goal": goal, "met": met, "detail": detail}


def targets(s: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets, each with its measured ratio and whether it is met."""
    out = []
    r_key, receipts = _best(s.get("receipts", {}))
    raw100 = s.get("raw_best", {}).get("100", {}).get("median", 0.0)
    if receipts and raw100:
        ratio = receipts / raw100
        detail = f"{receipts:,.0f} vs {raw100:,.0f} jobs/s ({r_key})"
        mine = s["receipts"][r_key]
        best = s["raw_best"]["100"]
        raw_cpu = s.get("raw_cpu", {}).get("100", {}).get(str(best["clients"]))
        if "db_cpu_us_per_job" in mine and raw_cpu:
            # where the two cores went, per job: the reason when the ratio falls short
            detail += (f"; CPU/job: worker {mine['worker_cpu_us_per_job']['median']:.0f}"
                       f" + db {mine['db_cpu_us_per_job']['median']:.0f} µs vs pgbench "
                       f"{raw_cpu['client_cpu_us_per_job']['median']:.0f}"
                       f" + db {raw_cpu['db_cpu_us_per_job']['median']:.0f} µs")
        out.append(_check("receipts / raw limit (batch 100)", ratio, f">= {RAW_RATIO_GOAL:g}",
                          ratio >= RAW_RATIO_GOAL, detail))
    for peer, goal in (("pgqueuer", 1.5), ("procrastinate", 15.0)):
        p_key, best = _best(s.get(peer, {}))
        if receipts and best:
            ratio = receipts / best
            out.append(_check(f"receipts / {peer} best", ratio, f">= {goal:g}", ratio >= goal,
                              f"{receipts:,.0f} vs {best:,.0f} jobs/s ({p_key})"))
    conn = s.get("connections", {}).get("connections")
    if conn:
        rate = conn["jobs_per_second"]["median"]
        by_app = conn["connections_by_application"]
        # Only the worker's own sessions: a backend still starting up has no
        # application_name yet ('') and may be anyone's (the bench's probes too).
        ours = {app: n for app, n in by_app.items() if app.startswith("receipts-")}
        pool = sum(n for app, n in ours.items() if not app.endswith("-listen"))
        listen = sum(n for app, n in ours.items() if app.endswith("-listen"))
        out.append(_check("400 slots @ 200 ms / Little's bound 2,000/s", rate / LITTLE_BOUND,
                          f">= {LITTLE_RATIO_GOAL:g}", rate / LITTLE_BOUND >= LITTLE_RATIO_GOAL,
                          f"{rate:,.0f} deliveries/s, admission control off"))
        out.append(_check("DB connections held (pool + LISTEN)", float(pool + listen),
                          "<= 2 + 1", pool <= 2 and listen <= 1, f"pool {pool}, listen {listen}"))
    cpu = s.get("capacity", {}).get("worker_cpu_us_per_http_delivery")
    if cpu:
        us = cpu["median"]
        out.append(_check("worker CPU per HTTP delivery (µs), 400 slots @ 200 ms", us,
                          f"<= {HTTP_CPU_GOAL_US:g}", us <= HTTP_CPU_GOAL_US,
                          "summary.capacity.worker_cpu_us_per_http_delivery"))
    adm = s.get("admission", {}).get("admission")
    if adm:
        rate = adm["jobs_per_second"]["median"]
        out.append(_check("same, admission control on / Little's bound",
                          rate / LITTLE_BOUND, "(none)", None, f"{rate:,.0f} deliveries/s"))
    pick = s.get("pickup", {})
    if "receipts:waker" in pick:
        mine = pick["receipts:waker"]["p99_ms"]["median"]
        out.append(_check("pickup p99 with the defaults (waker, no NOTIFY in the txn, ms)",
                          mine, f"<= {WAKER_PICKUP_GOAL_MS:.0f}", mine <= WAKER_PICKUP_GOAL_MS,
                          "bench/README.md: at 4/s, python -m bench.experiments.wakeups"))
    if "receipts:notify" in pick:
        mine = pick["receipts:notify"]["p99_ms"]["median"]
        peers = [v["p99_ms"]["median"] for k, v in pick.items() if not k.startswith("receipts")]
        if peers:
            out.append(_check("pickup p99, NOTIFY in the txn (0.2.0's default, ms) vs best peer",
                              mine, f"<= {min(peers):.1f}", mine <= min(peers),
                              f"peers {', '.join(f'{p:.1f}' for p in peers)} ms"))
    if "receipts:poll" in pick:
        mine = pick["receipts:poll"]["p99_ms"]["median"]
        out.append(_check("pickup p99 polling only (ms)", mine, f"<= {POLL_BOUND_MS:.0f}",
                          mine <= POLL_BOUND_MS, "poll 1 s + 25 % jitter"))
    claim = s.get("claim")
    if claim:
        ratio = claim["scale"]["p99_ms"]["median"] / max(claim["empty"]["p99_ms"]["median"], 1e-9)
        out.append(_check("claim p99 at 1M done + 100k ready / empty", ratio, "<= 1.5",
                          ratio <= 1.5, f"ready index used: {claim['uses_ready_index']}"))
    for key in ("checkout", "checkout:slots32"):
        chk = s.get(key)
        if chk:
            idle = max(chk["idle"]["p99_ms"]["median"], 1e-9)
            ratio = chk["drain"]["p99_ms"]["median"] / idle
            off = "admission off" if not chk["drain"]["admission"] else "admission on"
            out.append(_check(
                f"checkout p99 under drain / idle ({chk['concurrency']} slots, claim "
                f"{chk['batch']})", ratio, f"<= {CHECKOUT_P99_GOAL:g}",
                ratio <= CHECKOUT_P99_GOAL,
                f"{off}; drain lasted the whole window: {chk['drain_still_running']}"))
            on, offp = chk.get("drain_on"), chk.get("drain_off")
            if on and offp:
                ratio = on["p99_ms"]["median"] / idle
                out.append(_check(
                    "checkout p99 under drain, admission on (defaults) / idle", ratio,
                    f"<= {CHECKOUT_P99_GOAL:g}", ratio <= CHECKOUT_P99_GOAL,
                    f"{on['concurrency']} slots, claim {on['batch']}; admission off: "
                    f"{offp['p99_ms']['median'] / idle:.2f}"))
                r_on = on["drain_jobs_per_second"]["median"]
                r_off = offp["drain_jobs_per_second"]["median"]
                ratio = r_on / max(r_off, 1e-9)
                out.append(_check(
                    "drain rate admission on / off (defaults)", ratio,
                    f">= {ADMISSION_RATE_GOAL:g}", ratio >= ADMISSION_RATE_GOAL,
                    f"{r_on:,.0f} vs {r_off:,.0f} jobs/s; drains lasted the window: "
                    f"{on['still_running'] and offp['still_running']}"))
    bill = s.get("bill", {})
    ref = bill.get("raw:1")
    for n in (1, 16):
        row = bill.get(f"receipts:{n}")
        if not (ref and row):
            continue
        same = bill.get(f"raw:{n}")
        for what, key, unit in (("DB CPU", "db_cpu_us", "µs"), ("WAL", "wal_bytes", "B")):
            ratio = row[key] / max(ref[key], 1e-9)
            detail = f"{row[key]:,.1f} vs {ref[key]:,.1f} {unit} per job (raw: 1 client)"
            if same and n != 1:
                detail += f"; raw with {n} clients {same[key]:,.1f}"
            out.append(_check(f"{what} per job, {n} process(es) / raw limit", ratio,
                              f"<= {BILL_GOAL:g}", ratio <= BILL_GOAL, detail))
    outage = s.get("outage")
    if outage:
        failed = outage["failed"]["max"]
        out.append(_check(f"jobs failed after a {outage['outage_seconds']:g} s provider outage",
                          failed, "== 0", failed == 0,
                          f"{outage['jobs']:,} jobs queued; worst round"))
    acc = s.get("ratelimit_accuracy")
    if acc:
        worst = acc["worst_deviation"]
        out.append(_check(
            f"fleet rate limit, worst {acc['window_seconds']:g} s window / limit - 1",
            worst, f"±{RATE_LIMIT_TOLERANCE:.0%}", abs(worst) <= RATE_LIMIT_TOLERANCE,
            f"limit {acc['limit_per_second']:g}/s, {acc['processes']} processes, mean "
            f"{acc['mean_per_second']['median']:.1f}/s"))
    ovh = s.get("ratelimit_overhead")
    if ovh:
        ratio = ovh["ratio"]["median"]
        out.append(_check(
            "claim with pause check / without (no limit set)", ratio,
            f">= {FLOW_CHECK_GOAL:g}", ratio >= FLOW_CHECK_GOAL,
            f"pgbench claim {ovh['batch']} + ack, {ovh['clients']} clients: "
            f"{ovh['with_check']['median']:,.0f} vs {ovh['without_check']['median']:,.0f} jobs/s"))
    return out


def _mm(st: dict[str, float], fmt: str = ",.0f") -> str:
    return f"{st['median']:{fmt}} ({st['min']:{fmt}}–{st['max']:{fmt}})"


def table(doc: dict[str, Any]) -> str:
    """The one table: every figure as median (min–max) over the rounds, then the targets."""
    s = doc["summary"]
    rows: list[tuple[str, str]] = []
    for batch, by in sorted(s.get("raw", {}).items(), key=lambda kv: int(kv[0])):
        for clients, st in sorted(by.items(), key=lambda kv: int(kv[0])):
            cpu = s.get("raw_cpu", {}).get(batch, {}).get(clients)
            rows.append((f"raw pgbench claim {batch} + ack, {clients} clients",
                         _mm(st) + " jobs/s" + (
                             f", db {cpu['db_cpu_us_per_job']['median']:.0f} + pgbench "
                             f"{cpu['client_cpu_us_per_job']['median']:.0f} µs CPU/job"
                             if cpu else "")))
    for group, label in (("receipts", "receipts no-op"), ("pgqueuer", "PgQueuer"),
                         ("procrastinate", "Procrastinate"), ("http0", "receipts HTTP 0 ms"),
                         ("connections", "receipts HTTP 200 ms, 400 slots"),
                         ("admission", "receipts HTTP 200 ms, 400 slots, admission on")):
        for key, v in sorted(s.get(group, {}).items()):
            rows.append((f"{label} [{key}]", _mm(v["jobs_per_second"]) + " jobs/s, "
                         f"{v['worker_cpu_us_per_job']['median']:.0f} µs CPU/job"
                         + (f" (db {v['db_cpu_us_per_job']['median']:.0f})"
                            if "db_cpu_us_per_job" in v else "")
                         + f", max {v['max_connections']} conns"))
    for key, v in sorted(s.get("pickup", {}).items()):
        rows.append((f"pickup {key} p50 / p99", f"{_mm(v['p50_ms'], '.1f')} / "
                     f"{_mm(v['p99_ms'], '.1f')} ms"))
    if "claim" in s:
        for case in ("empty", "scale", "after_update"):
            v = s["claim"][case]
            rows.append((f"claim 10 p50 / p99, {case}", f"{_mm(v['p50_ms'], '.2f')} / "
                         f"{_mm(v['p99_ms'], '.2f')} ms"))
        rows.append(("claim plan uses receipt_jobs_ready", str(s["claim"]["uses_ready_index"])))
    if "vacuum" in s:
        v = s["vacuum"]
        for name in ("defaults", "migration_0002"):
            c = v[name]
            after = c["autovacuum_after_seconds"]
            rows.append((f"{v['updated']:,} jobs worked off, table settings: {name}",
                         f"dead tuples {c['dead_tuples_at_update']:,} -> "
                         f"{c['dead_tuples_at_end']:,} after {v['wait_seconds']:.0f} s "
                         f"(autovacuum {'at ' + format(after, '.0f') + ' s' if after else 'none'})"
                         f", claim p50/p99 {c['claim_p50_ms']:.2f}/{c['claim_p99_ms']:.2f} ms"))
    for key in ("checkout", "checkout:slots32"):
        if key not in s:
            continue
        for phase, v in s[key].items():
            if not isinstance(v, dict) or "p99_ms" not in v:
                continue
            how = "" if phase == "idle" else (", admission on" if v["admission"]
                                              else ", admission off")
            rate = (f", drain {_mm(v['drain_jobs_per_second'])} jobs/s"
                    if "drain_jobs_per_second" in v else "")
            tag = "" if key == "checkout" else f" [{key}]"
            rows.append((f"checkout txn p50 / p99, worker ({v['concurrency']} slots{how}) "
                         f"{phase}{tag}",
                         f"{_mm(v['p50_ms'], '.2f')} / {_mm(v['p99_ms'], '.2f')} ms{rate}"))
            if "limit_trace" in v:
                rows.append((f"claim-rate limit, {phase} (jobs/s; python -m bench.report "
                             "--trace)", _trace_brief(v["limit_trace"])))
    if "outage" in s:
        v = s["outage"]
        rows.append((f"outage {v['outage_seconds']:g} s, {v['jobs']:,} jobs, 1 worker "
                     "(defaults)",
                     f"failed {v['failed']['median']:.0f}, {_mm(v['requests_during_outage'])} "
                     f"requests during it, first delivery {_mm(v['resume_seconds'], '.1f')} s "
                     f"/ all {_mm(v['drained_seconds'], '.1f')} s after recovery, wall "
                     f"{_mm(v['wall_seconds'], '.1f')} s"))
    if "ratelimit_accuracy" in s:
        v = s["ratelimit_accuracy"]
        rows.append((f"rate limit {v['limit_per_second']:g}/s, {v['processes']} processes, "
                     f"per {v['window_seconds']:g} s window",
                     f"mean {_mm(v['mean_per_second'], '.1f')} req/s, worst "
                     f"{v['worst_deviation']:+.1%}, windows "
                     f"{', '.join(f'{w:.0f}' for w in v['windows'])}"))
        rows.append(("receipt_flow after the rate-limited drain", _flow_row(v["flow_row"])))
    if "ratelimit_overhead" in s:
        v = s["ratelimit_overhead"]
        for label, st in (("with pause check", v["with_check"]),
                          ("without pause check", v["without_check"])):
            rows.append((f"pgbench claim {v['batch']} + ack, {v['clients']} clients, {label}",
                         _mm(st) + " jobs/s"))
        for n, st in v["limited"].items():
            rows.append((f"pgbench claim_limited (never binds) {v['batch']} + ack, {n} clients",
                         _mm(st) + " jobs/s"))
        rows.append(("receipt_flow after claim_limited, "
                     f"{max(v['limited'], key=int)} clients", _flow_row(v["flow_row"])))
    width = max((len(a) for a, _ in rows), default=10)
    lines = [f"{'figure (median (min–max) over rounds)':<{width}}  value", "-" * (width + 50)]
    lines += [f"{a:<{width}}  {b}" for a, b in rows]
    if "bill" in s:
        lines += ["", "the database's bill (python -m bench.bill; medians over rounds)",
                  bill.headline(s["bill"])]
    lines += ["", f"{'target':<52} {'value':>10}  {'goal':<10} met   detail", "-" * 110]
    for t in doc["targets"]:
        value = "" if t["value"] is None else f"{t['value']:.2f}"
        met = {True: "yes", False: "NO", None: "-"}[t["met"]]
        lines.append(f"{t['target']:<52} {value:>10}  {t['goal']:<10} {met:<5} {t['detail']}")
    m = doc["machine"]
    pg = m.get("postgres", {})
    lines += ["", f"machine: {m.get('cpus')} CPUs {m.get('cpu_model')}, PostgreSQL "
              f"{pg.get('server_version')} fsync={pg.get('fsync')} synchronous_commit="
              f"{pg.get('synchronous_commit')}, rounds={doc['plan']['rounds']}, load average "
              f"at start {tuple(round(x, 2) for x in m.get('load_average_at_start', ()))}"]
    return "\n".join(lines)


def _flow_row(f: dict[str, Any]) -> str:
    share = "-" if f["hot_share"] is None else f"{f['hot_share']:.1%}"
    return (f"{f['n_tup_upd']:,} updates, HOT {share}, dead tuples {f['n_dead_tup']:,}, "
            f"{f['table_bytes']:,} bytes")


def per_second(trace: Sequence[Sequence[float]]) -> list[tuple[int, float]]:
    """A limit trace ([seconds, jobs/s] pairs) as its last value in each whole second."""
    out: dict[int, float] = {}
    for t, value in trace:
        out[int(t)] = value
    return sorted(out.items())


def _trace_brief(trace: Sequence[Sequence[float]], points: int = 6) -> str:
    """A few evenly spaced (second, limit) pairs and the last value."""
    secs = per_second(trace)
    if not secs:
        return "(no samples)"
    step = max(1, len(secs) // points)
    shown = secs[::step]
    if shown[-1] != secs[-1]:
        shown.append(secs[-1])
    return ", ".join(f"{t} s: {v:,.0f}" for t, v in shown)


def trace_lines(doc: dict[str, Any]) -> list[str]:
    """Every claim-rate limit trace of *doc*'s runs, one line per second: t (s), limit (jobs/s)."""
    lines: list[str] = []
    for key, runs in doc.get("runs", {}).items():
        if not key.startswith("checkout"):
            continue
        for i, run in enumerate(runs):
            for phase, v in run.items():
                if not isinstance(v, dict) or "limit_trace" not in v:
                    continue
                lines.append(f"{key} round {i + 1} {phase}: {v['concurrency']} slots, claim "
                             f"{v['batch']}; checkout window from {v['window_start_seconds']:g} s"
                             f" for {v['seconds']:g} s")
                lines.append(f"{'t (s)':>6}  limit (jobs/s)")
                lines += [f"{t:>6}  {value:,.0f}" for t, value in per_second(v["limit_trace"])]
    return lines


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.report [FILE] [--trace]``: the table (or the limit traces) of a
    result file (default bench/results/latest.json)."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m bench.report",
                                description="Print a benchmark result file's table.")
    p.add_argument("file", nargs="?", type=Path,
                   default=Path(__file__).resolve().parent / "results" / "latest.json")
    p.add_argument("--trace", action="store_true",
                   help="print the claim-rate limit traces, one line per second")
    args = p.parse_args(argv)
    doc = json.loads(args.file.read_text())
    if args.trace:
        lines = trace_lines(doc)
        print("\n".join(lines) if lines else "no limit trace in this file")
    else:
        print(table(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
