"""The chaos run's end checks: pure functions from what was observed to findings.

Nothing here touches a process, a socket or the database: the harness
(:mod:`tests.chaos.run`) gathers an :class:`Evidence` — the job rows, the
database's audit trail, the provider's view, what each worker process said
(its scraped counters and its log) — and :func:`evaluate` turns it into
named :class:`Finding` s plus the figures of the report. Each check is also
a function of its own, so it can be tried on a synthetic audit trail.

The audit trail is written by a trigger on ``receipt_jobs`` (see
``AUDIT_SQL`` in :mod:`tests.chaos.run`): one :class:`AuditRow` per change of
state or lease token, with the session's ``application_name`` of the
process that made it.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from receipts.supervisor import MetricSamples
from tests.chaos.pgproxy import CutRow

FAULT_KINDS = (
    "sigkill", "sigstop", "pg_restart", "terminate", "claim_cut", "write_cut", "half_open",
    "db_stall",
    "latency_spike", "burst_5xx", "burst_429", "hang_after_headers", "reset", "hang",
)
RECOVERY_SUFFIX = "-recover"  # application_name of the recovery process ends so
FINISHED = ("done", "failed")


@dataclass(frozen=True, slots=True)
class AuditRow:
    """One change of a job's state or token, as the audit trigger recorded it.

    *lease_held*: the old lease had not expired at that statement's time.
    *app*: the ``application_name`` of the session that made the change.
    """

    job_id: str
    old_state: str
    new_state: str
    old_token: str | None
    new_token: str | None
    lease_held: bool
    attempts: int
    app: str


@dataclass(frozen=True, slots=True)
class Finding:
    """One named check and whether it passed; *detail* says what was counted."""

    name: str
    passed: bool
    detail: str = ""


@dataclass(slots=True)
class WorkerView:
    """What the harness knows of one worker process at the end of the run.

    *app*: its ``application_name``; *killed*: SIGKILLed during the run (its
    counters died with it); *paused*: SIGSTOPped at some point; *proxied*:
    it reached PostgreSQL through the proxy (so cut claims count as its
    claims); *metrics*: its last scrape; *stale*: its ``stale_ack`` /
    ``stale_reschedule`` log records (JSON objects).
    """

    name: str
    app: str
    killed: bool = False
    paused: bool = False
    proxied: bool = False
    metrics: MetricSamples = field(default_factory=MetricSamples)
    stale: tuple[dict[str, Any], ...] = ()


@dataclass(slots=True)
class Trail:
    """What the audit trail says each process did, by ``application_name``."""

    claimed_by: Counter[str] = field(default_factory=Counter)
    done_by: Counter[str] = field(default_factory=Counter)
    retried_by: Counter[str] = field(default_factory=Counter)
    failed_by: Counter[str] = field(default_factory=Counter)
    #: tokens whose attempt completed its job (moved it to done).
    completed_tokens: set[str] = field(default_factory=set)
    #: tokens whose expired lease the recovery process took back.
    recovered_tokens: set[str] = field(default_factory=set)
    #: (token, process that claimed it, process that wrote the outcome, why).
    foreign: list[tuple[str | None, str | None, str, str]] = field(default_factory=list)
    #: tokens whose outcome was written after their lease had expired.
    expired: list[str | None] = field(default_factory=list)


def read_trail(rows: Iterable[AuditRow]) -> Trail:
    """Replay the audit trail (in ``seq`` order): who claimed, finished, took back what.

    A transition out of ``running`` by a worker is *foreign* when its old
    token is not the job's current token (the one of its latest change) or
    was claimed by another process; it is *expired* when the lease had run
    out at that statement.
    """
    trail = Trail()
    claimer: dict[str, str] = {}
    current: dict[str, str | None] = {}
    for row in rows:
        before = current.get(row.job_id)
        current[row.job_id] = row.new_token
        if row.old_state != "running" and row.new_state == "running":
            if row.new_token is not None:
                claimer[row.new_token] = row.app
            trail.claimed_by[row.app] += 1
            continue
        if row.old_state != "running":
            continue
        if row.app.endswith(RECOVERY_SUFFIX):
            if row.old_token is not None:
                trail.recovered_tokens.add(row.old_token)
            continue
        claimed = claimer.get(row.old_token) if row.old_token is not None else None
        if row.old_token is None or row.old_token != before:
            trail.foreign.append((row.old_token, claimed, row.app,
                                  "not the current attempt's token"))
        elif claimed != row.app:
            trail.foreign.append((row.old_token, claimed, row.app, "claimed by another process"))
        if not row.lease_held:
            trail.expired.append(row.old_token)
        if row.new_state == "done":
            if row.old_token is not None:
                trail.completed_tokens.add(row.old_token)
            trail.done_by[row.app] += 1
        elif row.new_state == "ready":
            trail.retried_by[row.app] += 1
        elif row.new_state == "failed":
            trail.failed_by[row.app] += 1
    return trail


# ------------------------------------------------------------------ checks


def check_nothing_lost(expected: set[str], states: Mapping[str, str]) -> Finding:
    """Every expected order has a job row, and every row is done or failed."""
    missing = expected - set(states)
    unfinished = [o for o, s in states.items() if s not in FINISHED]
    return Finding("no job lost or stuck: every job is done or failed",
                   not missing and not unfinished,
                   f"{len(missing)} missing, {len(unfinished)} not finished")


def check_invariants(violations: Sequence[str]) -> Finding:
    """No invariant violation was sampled while the run went on."""
    return Finding("invariants held at every sample (no ready job with attempts >= max, "
                   "no running job without token and deadline)", not violations,
                   "; ".join(violations[:5]))


def check_done_were_delivered(states: Mapping[str, str], receipts: Mapping[str, Any],
                              requested: Mapping[str, list[str]]) -> Finding:
    """Each done job's receipt is at the provider and was requested with its key."""
    keys = {f"receipt:{o}" for o, s in states.items() if s == "done"}
    no_receipt = [k for k in keys if k not in receipts]
    never_requested = [k for k in keys if k not in requested]
    return Finding("every done job was delivered with key receipt:<order_id>",
                   not no_receipt and not never_requested,
                   f"{len(no_receipt)} done without a receipt, "
                   f"{len(never_requested)} never requested")


def check_one_receipt_per_order(receipts: Mapping[str, Any], provider_receipts: int,
                                expected: set[str]) -> Finding:
    """The provider holds one receipt per delivered order, each under its own key."""
    orders = [v["order_id"] for v in receipts.values()]
    strangers = [k for k in receipts if k.removeprefix("receipt:") not in expected]
    return Finding(
        "the provider's deduplicated view holds exactly one receipt per delivered order",
        len(orders) == len(set(orders)) == len(receipts) == provider_receipts
        and all(receipts[k]["order_id"] == k.removeprefix("receipt:") for k in receipts)
        and not strangers,
        f"{len(receipts)} receipts, {len(set(orders))} orders, {len(strangers)} unknown")


def check_outcomes_by_current_attempt(trail: Trail) -> Finding:
    """Every accepted ack or reschedule came from the current attempt, within its lease."""
    return Finding("every ack or reschedule the database accepted came from the attempt that "
                   "held the current token, under an unexpired lease",
                   not trail.foreign and not trail.expired,
                   f"{len(trail.foreign)} foreign, {len(trail.expired)} after expiry")


def check_cut_claims(cut_rows: Sequence[CutRow], cuts: int,
                     requested: Mapping[str, list[str]], trail: Trail) -> Finding:
    """No attempt whose claim answer was cut reached the provider; recovery took each back."""
    delivered = [r for r in cut_rows
                 if str(r.attempt) in requested.get(f"receipt:{r.order_id}", [])]
    unrecovered = [r for r in cut_rows if r.token not in trail.recovered_tokens]
    return Finding("no attempt whose claim answer was cut reached the provider; recovery took "
                   "each one back",
                   bool(cut_rows) and not delivered and not unrecovered,
                   f"{len(cut_rows)} cut job(s) in {cuts} cut(s), "
                   f"{len(delivered)} delivered by the cut attempt, "
                   f"{len(unrecovered)} not recovered")


def stale_records(workers: Iterable[WorkerView]) -> list[dict[str, Any]]:
    """Every worker's refused acks and reschedules, each tagged ``_worker``: its name."""
    return [{**rec, "_worker": w.name} for w in workers for rec in w.stale]


def check_stale_refused(stale: Sequence[Mapping[str, Any]], trail: Trail,
                        states: Mapping[str, str],
                        requested: Mapping[str, list[str]]) -> Finding:
    """Late acks were refused: none completed its job, each job finished by a newer attempt.

    A refused ack's attempt was delivered (the provider logged that attempt
    number), so it must be in the request log; its job was finished by
    another attempt. Log records carry the token's first 8 hex digits.
    """
    completed_prefixes = {t.replace("-", "")[:8] for t in trail.completed_tokens}
    completed = [s for s in stale if s.get("token") in completed_prefixes]
    acks = [s for s in stale if s["event"] == "stale_ack"]
    finished_elsewhere = [s for s in acks if states.get(s["order_id"]) in FINISHED]
    delivered = [s for s in acks
                 if str(s.get("attempt")) in requested.get(f"receipt:{s['order_id']}", [])]
    return Finding("stale acks are refused: late acks of delivered receipts and late "
                   "reschedules were issued, none completed its job, each of those receipts "
                   "reached the provider, and each job was finished by a newer attempt",
                   bool(acks) and not completed
                   and len(finished_elsewhere) == len(delivered) == len(acks),
                   f"{len(stale)} refused ({len(acks)} acks of delivered receipts, "
                   f"{len(delivered)} of them seen by the provider), "
                   f"{len(completed)} completed anyway")


def counter_mismatches(workers: Iterable[WorkerView], trail: Trail, cut_jobs: int) -> list[str]:
    """``"<worker> <counter>=<scraped> vs <truth>"`` for each counter of a surviving worker
    that differs from the audit trail (acks, retries, failures, claims plus the rows the
    proxy cut) or from its own log (stale acks); empty when all agree."""
    out = []
    for w in workers:
        if w.killed:
            continue
        m, app = w.metrics, w.app
        pairs = {
            "acks_total": (m.total("receipts_acks_total"), trail.done_by[app]),
            "failures_total": (m.total("receipts_failures_total"), trail.failed_by[app]),
            "retries_total": (m.total("receipts_retries_total"), trail.retried_by[app]),
            "jobs_claimed_total": (m.total("receipts_jobs_claimed_total")
                                   + (cut_jobs if w.proxied else 0), trail.claimed_by[app]),
            "stale_acks_total": (m.total("receipts_stale_acks_total"), len(w.stale)),
        }
        out += [f"{w.name} {name}={int(scraped)} vs {truth}"
                for name, (scraped, truth) in pairs.items() if int(scraped) != truth]
    return out


def check_counters(workers: Sequence[WorkerView], trail: Trail, cut_jobs: int) -> Finding:
    """Counters of the surviving workers equal the audit trail and their own logs."""
    mismatches = counter_mismatches(workers, trail, cut_jobs)
    return Finding("counters of surviving workers equal the database's audit trail "
                   "(acks, retries, failures, claims) and their own logs (stale acks)",
                   not mismatches and any(not w.killed for w in workers),
                   "; ".join(mismatches[:8]))


def check_exits(exit_codes: Mapping[str, int | None], killed: set[str]) -> Finding:
    """Every process the run did not SIGKILL exited 0 on SIGTERM."""
    bad = {n: code for n, code in exit_codes.items() if code != 0 and n not in killed}
    return Finding("every surviving process exited 0 on SIGTERM", not bad, str(bad))


def check_every_fault(faults: Mapping[str, int]) -> Finding:
    """Each kind of :data:`FAULT_KINDS` was injected at least once."""
    return Finding("every fault kind was injected",
                   all(faults.get(k, 0) > 0 for k in FAULT_KINDS),
                   ", ".join(k for k in FAULT_KINDS if not faults.get(k)))


# --------------------------------------------------------------- all at once


@dataclass(slots=True)
class Evidence:
    """Everything a run observed, gathered after the queue drained.

    *states*: order id → job state; *requests*: the provider's request log
    as ``[key, attempt]`` pairs; *receipts*: its deduplicated receipts by
    key; *provider_stats*: its counters; *violations*: invariant breaches
    sampled during the run; *cut_rows* / *cuts*: what the proxy cut;
    *faults*: injections by kind; *exit_codes*: by process name.
    """

    expected: set[str]
    states: dict[str, str]
    audit: list[AuditRow]
    workers: list[WorkerView]
    provider_stats: dict[str, Any]
    receipts: dict[str, Any]
    requests: list[list[str]]
    violations: list[str] = field(default_factory=list)
    cut_rows: list[CutRow] = field(default_factory=list)
    cuts: int = 0
    faults: Mapping[str, int] = field(default_factory=dict)
    exit_codes: dict[str, int | None] = field(default_factory=dict)


@dataclass(slots=True)
class Evaluation:
    """The findings of :func:`evaluate` and the figures and effects for the report."""

    findings: list[Finding]
    figures: dict[str, float]
    effects: dict[str, int]


def evaluate(ev: Evidence) -> Evaluation:
    """Every check over *ev*, in the report's order, with the figures they counted."""
    requested: dict[str, list[str]] = defaultdict(list)
    for key, attempt in ev.requests:
        requested[key].append(attempt)
    trail = read_trail(ev.audit)
    stale = stale_records(ev.workers)
    lost = len(ev.expected - set(ev.states)) + sum(
        1 for s in ev.states.values() if s not in FINISHED)
    findings = [
        check_nothing_lost(ev.expected, ev.states),
        check_invariants(ev.violations),
        check_done_were_delivered(ev.states, ev.receipts, requested),
        check_one_receipt_per_order(ev.receipts, ev.provider_stats["receipts"], ev.expected),
        check_outcomes_by_current_attempt(trail),
        check_cut_claims(ev.cut_rows, ev.cuts, requested, trail),
        check_stale_refused(stale, trail, ev.states, requested),
        check_counters(ev.workers, trail, len(ev.cut_rows)),
        check_exits(ev.exit_codes, {w.name for w in ev.workers if w.killed}),
        check_every_fault(ev.faults),
    ]
    paused = {w.name for w in ev.workers if w.paused}
    proxied = {w.name for w in ev.workers if w.proxied}
    figures: dict[str, float] = {
        "lost": lost,
        "provider_requests": ev.provider_stats["requests"],
        "receipts": len(ev.receipts),
        "duplicates_suppressed": ev.provider_stats["duplicates_suppressed"],
        "redeliveries": sum(len(v) - 1 for v in requested.values()),
        "failed_with_receipt": sum(1 for k in ev.receipts
                                   if ev.states.get(k.removeprefix("receipt:")) == "failed"),
        "foreign_acks": len(trail.foreign),
        "recovered": len(trail.recovered_tokens),
        "stale_refused_logged": len(stale),
        "stale_acks_logged": sum(1 for s in stale if s["event"] == "stale_ack"),
        "stale_metric": sum(w.metrics.total("receipts_stale_acks_total")
                            for w in ev.workers if not w.killed),
        "worker_processes": len(ev.workers),
    }
    effects = {stat: int(ev.provider_stats.get(stat, 0))
               for stat in ("status_503", "status_429", "fault_hang_after_headers",
                            "fault_reset", "fault_timeout")}
    effects |= {
        "cut_jobs": len(ev.cut_rows),
        "stale_from_sigstop": sum(1 for s in stale if s["_worker"] in paused),
        "stale_from_stall": sum(1 for s in stale if s["_worker"] in proxied),
        "timeouts": int(sum(w.metrics.by_label("receipts_retries_total", "reason")
                            .get("timeout", 0) for w in ev.workers)),
    }
    return Evaluation(findings, figures, effects)
