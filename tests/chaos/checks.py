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
from datetime import datetime
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
    *at*: the statement's time (epoch seconds; 0 when not known).
    """

    job_id: str
    old_state: str
    new_state: str
    old_token: str | None
    new_token: str | None
    lease_held: bool
    attempts: int
    app: str
    at: float = 0.0


@dataclass(frozen=True, slots=True)
class Finding:
    """One named check and whether it passed; *detail* says what was counted."""

    name: str
    passed: bool
    detail: str = ""


def all_passed(checks: list[Finding]) -> bool:
    """True when every check passed (a run's report is ok)."""
    return all(f.passed for f in checks)


def failed_lines(checks: list[Finding]) -> list[str]:
    """The failed checks as ``name: detail`` lines."""
    return [f"{f.name}: {f.detail}" for f in checks if not f.passed]


@dataclass(slots=True)
class WorkerView:
    """What the harness knows of one worker process at the end of the run.

    *app*: its ``application_name``; *killed*: SIGKILLed during the run (its
    counters died with it); *paused*: SIGSTOPped at some point; *proxied*:
    it reached PostgreSQL through the proxy (so cut claims count as its
    claims); *metrics*: its last scrape; *stale*: its ``stale_ack`` /
    ``stale_reschedule`` log records (JSON objects); *unconfirmed*: its
    ``lease_lost`` records of writes given up unconfirmed (``write_unconfirmed``);
    *undone*: its ``write_undone`` records of writes refused within their lease
    after a reconnection, counted as undone by a database crash.
    """

    name: str
    app: str
    killed: bool = False
    paused: bool = False
    proxied: bool = False
    metrics: MetricSamples = field(default_factory=MetricSamples)
    stale: tuple[dict[str, Any], ...] = ()
    unconfirmed: tuple[dict[str, Any], ...] = ()
    undone: tuple[dict[str, Any], ...] = ()


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
    #: every claimed token, with the process that claimed it, and its job.
    claimer: dict[str, str] = field(default_factory=dict)
    claimed_job: dict[str, str] = field(default_factory=dict)
    #: every claimed token's attempt number (not unique: a refunded attempt, one the
    #: provider failed, gives its number to the job's next attempt).
    claim_attempt: dict[str, int] = field(default_factory=dict)
    #: (token, process that claimed it, process that wrote the outcome, why).
    foreign: list[tuple[str | None, str | None, str, str]] = field(default_factory=list)
    #: tokens whose outcome was written after their lease had expired.
    expired: list[str | None] = field(default_factory=list)
    #: each job's outcome writes by workers, in order: (old token, new state, app, at).
    outcomes: dict[str, list[tuple[str | None, str, str, float]]] = field(
        default_factory=lambda: defaultdict(list))


def read_trail(rows: Iterable[AuditRow]) -> Trail:
    """Replay the audit trail (in ``seq`` order): who claimed, finished, took back what.

    A transition out of ``running`` by a worker is *foreign* when its old
    token is not the job's current token (the one of its latest change) or
    was claimed by another process; it is *expired* when the lease had run
    out at that statement.
    """
    trail = Trail()
    claimer = trail.claimer
    current: dict[str, str | None] = {}
    for row in rows:
        before = current.get(row.job_id)
        current[row.job_id] = row.new_token
        if row.old_state != "running" and row.new_state == "running":
            if row.new_token is not None:
                claimer[row.new_token] = row.app
                trail.claimed_job[row.new_token] = row.job_id
                trail.claim_attempt[row.new_token] = row.attempts
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
        trail.outcomes[row.job_id].append((row.old_token, row.new_state, row.app, row.at))
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
                     requested: Mapping[str, list[str]], trail: Trail,
                     lost_rows: Sequence[CutRow] = ()) -> Finding:
    """No attempt whose claim answer was cut reached the provider; recovery took each back.

    *lost_rows*: committed claims whose answer the worker gave up on (a
    half-open hold past its deadline) are held to the same rule.
    """
    rows = [*cut_rows, *lost_rows]
    numbered: dict[str, Counter[int]] = defaultdict(Counter)
    for token, job in trail.claimed_job.items():
        numbered[job][trail.claim_attempt[token]] += 1

    def delivered_by_it(r: CutRow) -> bool:
        # An attempt sends at most one request, with its number. A refunded attempt
        # gives its number to the job's next one, so the requests with a cut
        # attempt's number are its own only beyond one per other attempt so numbered.
        sent = requested.get(f"receipt:{r.order_id}", []).count(str(r.attempt))
        others = numbered[r.job_id][r.attempt] - (r.token in trail.claimed_job)
        return sent > others

    delivered = [r for r in rows if delivered_by_it(r)]
    unrecovered = [r for r in rows if r.token not in trail.recovered_tokens]
    return Finding("no attempt whose claim answer was cut reached the provider; recovery took "
                   "each one back",
                   bool(cut_rows) and not delivered and not unrecovered,
                   f"{len(cut_rows)} cut job(s) in {cuts} cut(s)"
                   + (f" and {len(lost_rows)} job(s) of claims given up on at the deadline"
                      if lost_rows else "")
                   + f", {len(delivered)} delivered by the cut attempt, "
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


def _log_time(record: Mapping[str, Any]) -> float:
    """A JSON log record's time, epoch seconds (its millisecond rounded up); -inf if none."""
    try:
        return datetime.fromisoformat(str(record["time"])).timestamp() + 0.001
    except (KeyError, ValueError):
        return float("-inf")


def unconfirmable_reschedules(w: WorkerView, trail: Trail) -> list[str]:
    """Tokens (first 8 hex digits) of *w*'s reschedules that landed, though *w* could not
    confirm them: the one case ``resolve_writes`` cannot tell (docs/design.md §4).

    The answer was lost (a half-open hold outlived the deadline), and before *w* asked,
    the job, ready again, was claimed and written by a newer attempt, which replaced
    ``last_token``. *w* then gave the write up as a lost lease (``lease_lost``,
    ``write_unconfirmed``) or had its retry refused (``stale_reschedule``, or, with
    asynchronous commits, ``write_undone``: refused within the lease after a reconnect,
    which is what a crash that undid the claim looks like), so its
    ``receipts_retries_total`` lacks one the audit trail has. Only a write that the trail
    shows landed *and* overwritten by another attempt before *w*'s log line counts.
    """
    out = []
    given_up = [*(r for r in w.unconfirmed if r.get("statement") == "reschedule"),
                *(r for r in w.stale if r.get("event") == "stale_reschedule"),
                *(r for r in w.undone if r.get("statement") == "reschedule")]
    for rec in given_up:
        token8, when = rec.get("token"), _log_time(rec)
        writes = trail.outcomes.get(str(rec.get("job_id")), [])
        for i, (old, new, app, _) in enumerate(writes):
            if (app == w.app and new == "ready" and old is not None
                    and old.replace("-", "")[:8] == token8):
                if any(other != old and at <= when for other, _, _, at in writes[i + 1:]):
                    out.append(str(token8))
                break
    return out


@dataclass(frozen=True, slots=True)
class ProxiedClaims:
    """What the proxy saw of the proxied worker's claims (the rows that carry a job).

    *answered*: forwarded whole to a client that went on with them, so the
    worker took each one and must have counted it; *cut*: the armed claim
    cuts; *lost*: committed, but the worker had given up on the statement (its
    deadline fired during a half-open hold) before it took the answer;
    *unsure*: broken off in mid-answer by the server's side, committed or not
    (the audit trail says which).
    """

    answered: Sequence[CutRow] = ()
    cut: Sequence[CutRow] = ()
    lost: Sequence[CutRow] = ()
    unsure: Sequence[CutRow] = ()


def _claim_names(tokens: Iterable[str], trail: Trail, limit: int = 3) -> str:
    named = [f"job {trail.claimed_job.get(t, '?')} token {t[:8]}" for t in sorted(tokens)]
    return ", ".join(named[:limit]) + (f" and {len(named) - limit} more" if len(named) > limit
                                        else "")


def proxied_claim_mismatches(w: WorkerView, trail: Trail, proxied: ProxiedClaims) -> list[str]:
    """The proxied worker's claims, job by job: its counter equals the claimed jobs whose
    answer it took, and every claim the audit trail has from it was answered, cut or lost
    on the way (an unsure one only if the trail has it). Empty when all agree."""
    out = []
    answered = {r.token for r in proxied.answered}
    metric = int(w.metrics.total("receipts_jobs_claimed_total"))
    if metric != len(answered):
        out.append(f"{w.name} jobs_claimed_total={metric} vs {len(answered)} claimed jobs "
                   "whose answer it took (proxy)")
    committed = {t for t, app in trail.claimer.items() if app == w.app}
    not_taken = {r.token for r in (*proxied.cut, *proxied.lost)}
    seen = answered | not_taken | ({r.token for r in proxied.unsure} & committed)
    if committed != seen:
        unseen, phantom = committed - seen, (answered | not_taken) - committed
        out.append(
            f"{w.name} claims in the audit trail={len(committed)} vs {len(seen)} answered, cut"
            f" or lost by the proxy"
            + (f"; no answer seen for {_claim_names(unseen, trail)}" if unseen else "")
            + (f"; not in the trail: {len(phantom)} token(s) {sorted(phantom)[:3]}"
               if phantom else ""))
    return out


def counter_mismatches(workers: Iterable[WorkerView], trail: Trail,
                       proxied: ProxiedClaims) -> list[str]:
    """``"<worker> <counter>=<scraped> vs <truth>"`` for each counter of a surviving worker
    that differs from the audit trail (acks, retries, failures, claims) or from its own log
    (stale acks); empty when all agree. The proxied worker's claims are compared job by
    job with what the proxy saw (:func:`proxied_claim_mismatches`): claims whose answer it
    never took (cut, or given up on at its deadline) are in the trail, not in its counter;
    so are reschedules that landed but could not be confirmed
    (:func:`unconfirmable_reschedules`)."""
    out = []
    for w in workers:
        if w.killed:
            continue
        m, app = w.metrics, w.app
        pairs = {
            "acks_total": (m.total("receipts_acks_total"), trail.done_by[app]),
            "failures_total": (m.total("receipts_failures_total"), trail.failed_by[app]),
            # A job claimed ahead and given back unsent (a pause, or a second's wait for
            # a slot) is a reschedule in the trail, counted in claims_returned_total.
            "retries_total": (m.total("receipts_retries_total")
                              + m.total("receipts_claims_returned_total"),
                              trail.retried_by[app] - len(unconfirmable_reschedules(w, trail))),
            "stale_acks_total": (m.total("receipts_stale_acks_total"), len(w.stale)),
        }
        if not w.proxied:
            pairs["jobs_claimed_total"] = (m.total("receipts_jobs_claimed_total"),
                                           trail.claimed_by[app])
        out += [f"{w.name} {name}={int(scraped)} vs {truth}"
                for name, (scraped, truth) in pairs.items() if int(scraped) != truth]
        if w.proxied:
            out += proxied_claim_mismatches(w, trail, proxied)
    return out


def check_counters(workers: Sequence[WorkerView], trail: Trail,
                   proxied: ProxiedClaims) -> Finding:
    """Counters of the surviving workers equal the audit trail and their own logs."""
    mismatches = counter_mismatches(workers, trail, proxied)
    notes = [f"{w.name}: {len(u)} landed reschedule(s) it could not confirm (the job was"
             f" re-claimed and written by a newer attempt first), counted as lost leases"
             for w in workers if not w.killed and (u := unconfirmable_reschedules(w, trail))]
    return Finding("counters of surviving workers equal the database's audit trail "
                   "(acks, retries, failures, claims) and their own logs (stale acks)",
                   not mismatches and any(not w.killed for w in workers),
                   "; ".join([*mismatches[:8], *notes]))


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
    *answered_rows* / *lost_rows* / *unsure_rows*: the proxied worker's other
    claimed rows, by fate (see :class:`ProxiedClaims`);
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
    answered_rows: list[CutRow] = field(default_factory=list)
    lost_rows: list[CutRow] = field(default_factory=list)
    unsure_rows: list[CutRow] = field(default_factory=list)
    faults: Mapping[str, int] = field(default_factory=dict)
    exit_codes: dict[str, int | None] = field(default_factory=dict)


@dataclass(slots=True)
class Evaluation:
    """The findings of :func:`evaluate` and the figures and effects for the report."""

    findings: list[Finding]
    figures: dict[str, float]
    effects: dict[str, int]


def proxied_claims(ev: Evidence) -> ProxiedClaims:
    """The proxied worker's claimed rows of *ev*, by fate."""
    return ProxiedClaims(ev.answered_rows, ev.cut_rows, ev.lost_rows, ev.unsure_rows)


def evaluate(ev: Evidence) -> Evaluation:
    """Every check over *ev*, in the report's order, with the figures they counted."""
    requested: dict[str, list[str]] = defaultdict(list)
    for key, attempt in ev.requests:
        requested[key].append(attempt)
    trail = read_trail(ev.audit)
    stale = stale_records(ev.workers)
    claims = proxied_claims(ev)
    not_taken = [*claims.lost, *(r for r in claims.unsure if r.token in trail.claimer)]
    lost = len(ev.expected - set(ev.states)) + sum(
        1 for s in ev.states.values() if s not in FINISHED)
    findings = [
        check_nothing_lost(ev.expected, ev.states),
        check_invariants(ev.violations),
        check_done_were_delivered(ev.states, ev.receipts, requested),
        check_one_receipt_per_order(ev.receipts, ev.provider_stats["receipts"], ev.expected),
        check_outcomes_by_current_attempt(trail),
        check_cut_claims(ev.cut_rows, ev.cuts, requested, trail, not_taken),
        check_stale_refused(stale, trail, ev.states, requested),
        check_counters(ev.workers, trail, claims),
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
        "claim_jobs_given_up": len(not_taken),
        "stale_from_sigstop": sum(1 for s in stale if s["_worker"] in paused),
        "stale_from_stall": sum(1 for s in stale if s["_worker"] in proxied),
        "timeouts": int(sum(w.metrics.by_label("receipts_retries_total", "reason")
                            .get("timeout", 0) for w in ev.workers)),
    }
    return Evaluation(findings, figures, effects)
