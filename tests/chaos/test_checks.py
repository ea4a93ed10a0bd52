"""The chaos run's end checks on synthetic evidence: what must pass passes, what must fail fails."""

from __future__ import annotations

from receipts.supervisor import parse_metrics
from tests.chaos.checks import (
    FAULT_KINDS,
    AuditRow,
    Evidence,
    ProxiedClaims,
    WorkerView,
    check_counters,
    check_cut_claims,
    check_nothing_lost,
    check_outcomes_by_current_attempt,
    check_stale_refused,
    evaluate,
    read_trail,
)
from tests.chaos.pgproxy import CutRow

T1 = "11111111-0000-4000-8000-000000000001"
T2 = "22222222-0000-4000-8000-000000000002"
T3 = "33333333-0000-4000-8000-000000000003"
T4 = "44444444-0000-4000-8000-000000000004"
T5 = "55555555-0000-4000-8000-000000000005"
T6 = "66666666-0000-4000-8000-000000000006"
W0, W1, REC = "chaos-w0-worker", "chaos-w1-worker", "chaos-recover"


def claim(job: str, token: str, app: str, attempts: int = 1, old: str = "ready") -> AuditRow:
    return AuditRow(job, old, "running", None, token, False, attempts, app)


def finish(job: str, token: str, app: str, new: str = "done", *, lease_held: bool = True,
           attempts: int = 1) -> AuditRow:
    return AuditRow(job, "running", new, token, None, lease_held, attempts, app)


def recovered(job: str, token: str, attempts: int = 1) -> AuditRow:
    return AuditRow(job, "running", "ready", token, None, False, attempts, REC)


# j1: claimed and acked by w0. j2: w1's lease expired, recovery took it back, w0 finished
# it. j3: w1 rescheduled it after a failed delivery, then w1 failed it for good.
HONEST = [
    claim("j1", T1, W0), claim("j2", T2, W1),
    finish("j1", T1, W0),
    recovered("j2", T2), claim("j2", T3, W0, attempts=2), finish("j2", T3, W0, attempts=2),
    claim("j3", T4, W1), finish("j3", T4, W1, new="ready"),
    claim("j3", T5, W1, attempts=2), finish("j3", T5, W1, new="failed", attempts=2),
]


def test_an_honest_trail_passes_and_counts_what_each_process_did():
    trail = read_trail(HONEST)
    assert check_outcomes_by_current_attempt(trail).passed
    assert trail.claimed_by == {W0: 2, W1: 3}
    assert trail.done_by == {W0: 2}
    assert trail.retried_by == {W1: 1}
    assert trail.failed_by == {W1: 1}
    assert trail.recovered_tokens == {T2}
    assert trail.completed_tokens == {T1, T3}


def test_a_late_ack_of_a_token_that_is_no_longer_current_fails():
    # w1's lease on j2 expired and recovery handed the job to w0 (T3); then the
    # database accepted w1's ack of T2: a foreign ack.
    rows = [claim("j2", T2, W1), recovered("j2", T2), claim("j2", T3, W0, attempts=2),
            finish("j2", T2, W1, attempts=2)]
    finding = check_outcomes_by_current_attempt(read_trail(rows))
    assert not finding.passed
    assert finding.detail == "1 foreign, 0 after expiry"
    assert read_trail(rows).foreign == [(T2, W1, W1, "not the current attempt's token")]


def test_an_ack_by_a_process_that_did_not_claim_the_token_fails():
    trail = read_trail([claim("j1", T1, W0), finish("j1", T1, W1)])
    assert trail.foreign == [(T1, W0, W1, "claimed by another process")]
    assert not check_outcomes_by_current_attempt(trail).passed


def test_an_ack_accepted_after_its_lease_expired_fails():
    trail = read_trail([claim("j1", T1, W0), finish("j1", T1, W0, lease_held=False)])
    finding = check_outcomes_by_current_attempt(trail)
    assert not finding.passed and finding.detail == "0 foreign, 1 after expiry"


def test_a_missing_or_unfinished_job_is_lost():
    assert check_nothing_lost({"a", "b"}, {"a": "done", "b": "failed"}).passed
    finding = check_nothing_lost({"a", "b", "c"}, {"a": "done", "b": "running"})
    assert not finding.passed and finding.detail == "1 missing, 1 not finished"


def _metrics(acks: int, retries: int, failures: int, claimed: int, stale: int = 0,
             returned: int = 0):
    return parse_metrics(
        f"receipts_acks_total {acks}\n"
        f'receipts_retries_total{{reason="status_503"}} {retries}\n'
        f'receipts_failures_total{{reason="rejected"}} {failures}\n'
        f"receipts_jobs_claimed_total {claimed}\n"
        f"receipts_stale_acks_total {stale}\n"
        f"receipts_claims_returned_total {returned}\n")


def test_a_job_given_back_unsent_is_a_reschedule_in_the_trail_and_no_retry():
    """A job claimed ahead and given back (a pause) runs -> ready in the trail; the worker
    counts it in claims_returned_total, not as a retry (seen in a full chaos run)."""
    trail = read_trail(HONEST)
    w1 = dict(acks=0, failures=1, claimed=3)
    assert check_counters([WorkerView("worker-1", W1, metrics=_metrics(retries=0, returned=1,
                                                                        **w1))],
                          trail, ProxiedClaims()).passed
    assert not check_counters([WorkerView("worker-1", W1, metrics=_metrics(retries=0, **w1))],
                              trail, ProxiedClaims()).passed


def test_counters_must_equal_the_trail_for_surviving_workers_only():
    trail = read_trail(HONEST)
    workers = [WorkerView("worker-0", W0, metrics=_metrics(2, 0, 0, 2)),
               WorkerView("worker-1", W1, metrics=_metrics(0, 1, 1, 3)),
               WorkerView("worker-2", "chaos-w2-worker", killed=True,
                          metrics=_metrics(99, 99, 99, 99))]
    assert check_counters(workers, trail, ProxiedClaims()).passed
    workers[0] = WorkerView("worker-0", W0, metrics=_metrics(3, 0, 0, 2))
    finding = check_counters(workers, trail, ProxiedClaims())
    assert not finding.passed and finding.detail == "worker-0 acks_total=3 vs 2"


def _row(job: str, token: str, attempt: int = 1) -> CutRow:
    return CutRow(job_id=job, order_id=f"o-{job}", token=token, attempt=attempt)


# The proxied worker w0 claimed j1 (T1) and j2 (T3), both answered and counted; its
# claim of j4 (T4) committed, but w0 had given up on it at its deadline (a half-open
# hold) before the answer reached it: never counted, recovered.
PROXIED = [*HONEST, claim("j4", T4, W0), recovered("j4", T4)]


def _proxied_worker(claimed: int) -> list[WorkerView]:
    return [WorkerView("worker-0", W0, proxied=True, metrics=_metrics(2, 0, 0, claimed)),
            WorkerView("worker-1", W1, metrics=_metrics(0, 1, 1, 3))]


def test_a_proxied_claim_the_worker_gave_up_on_is_in_the_trail_and_not_in_its_counter():
    trail = read_trail(PROXIED)
    claims = ProxiedClaims(answered=[_row("j1", T1), _row("j2", T3, 2)], lost=[_row("j4", T4)])
    assert check_counters(_proxied_worker(2), trail, claims).passed
    # A claim broken off in mid-answer may or may not have committed: either is fine.
    unsure = ProxiedClaims(answered=claims.answered, unsure=[_row("j4", T4), _row("j5", T5)])
    assert check_counters(_proxied_worker(2), trail, unsure).passed


def test_a_claim_answered_to_the_proxied_worker_but_not_counted_fails():
    # The worker received j4's claim answer (the proxy forwarded it whole and the
    # worker went on) but its counter missed it: a real counting bug.
    trail = read_trail(PROXIED)
    claims = ProxiedClaims(answered=[_row("j1", T1), _row("j2", T3, 2), _row("j4", T4)])
    finding = check_counters(_proxied_worker(2), trail, claims)
    assert not finding.passed
    assert finding.detail == ("worker-0 jobs_claimed_total=2 vs 3 claimed jobs whose answer "
                              "it took (proxy)")


def test_a_committed_claim_of_the_proxied_worker_that_nothing_explains_fails():
    # j4 committed in the audit trail, the worker did not count it, and the proxy saw
    # no answer for it (neither answered nor cut nor given up on): the old sum
    # "counter + cut rows = trail" is off by one, and the claim is named.
    trail = read_trail(PROXIED)
    claims = ProxiedClaims(answered=[_row("j1", T1), _row("j2", T3, 2)])
    finding = check_counters(_proxied_worker(2), trail, claims)
    assert not finding.passed
    assert finding.detail == ("worker-0 claims in the audit trail=3 vs 2 answered, cut or lost "
                              "by the proxy; no answer seen for job j4 token 44444444")
    # A row the proxy calls committed (lost) that the trail never had fails too.
    phantom = ProxiedClaims(answered=claims.answered, lost=[_row("j4", T4), _row("j6", T6)])
    finding = check_counters(_proxied_worker(2), trail, phantom)
    assert not finding.passed and "not in the trail: 1 token(s)" in finding.detail


def test_a_refused_ack_whose_token_completed_its_job_fails():
    trail = read_trail(HONEST)
    states = {"o2": "done"}
    requested = {"receipt:o2": ["1", "2"]}
    late = {"event": "stale_ack", "token": T2.replace("-", "")[:8], "order_id": "o2",
            "attempt": 1}
    assert check_stale_refused([late], trail, states, requested).passed
    completed = {**late, "token": T3.replace("-", "")[:8]}
    finding = check_stale_refused([completed], trail, states, requested)
    assert not finding.passed and finding.detail.endswith("1 completed anyway")


def test_a_whole_synthetic_run_passes_every_check():
    late = {"event": "stale_ack", "token": T2.replace("-", "")[:8], "order_id": "o2",
            "attempt": 1}
    cut = CutRow(job_id="j9", order_id="o9", token="99999999-0000-4000-8000-000000000009",
                 attempt=1)
    audit = [*HONEST, claim("j9", cut.token, W0), recovered("j9", cut.token),
             claim("j9", T6, W1, attempts=2), finish("j9", T6, W1, attempts=2)]
    evidence = Evidence(
        expected={"o1", "o2", "o3", "o9"},
        states={"o1": "done", "o2": "done", "o3": "failed", "o9": "done"},
        audit=audit,
        workers=[WorkerView("worker-0", W0, proxied=True, metrics=_metrics(2, 0, 0, 2)),
                 WorkerView("worker-1", W1, paused=True, metrics=_metrics(1, 1, 1, 4, 1),
                            stale=(late,))],
        provider_stats={"requests": 6, "receipts": 3, "duplicates_suppressed": 1},
        receipts={f"receipt:{o}": {"order_id": o} for o in ("o1", "o2", "o9")},
        requests=[["receipt:o1", "1"], ["receipt:o2", "1"], ["receipt:o2", "2"],
                  ["receipt:o3", "1"], ["receipt:o3", "2"], ["receipt:o9", "2"]],
        cut_rows=[cut], cuts=1, answered_rows=[_row("j1", T1), _row("j2", T3, 2)],
        faults=dict.fromkeys(FAULT_KINDS, 1),
        exit_codes={"worker-0": 0, "worker-1": 0, "provider": 0, "recover": 0},
    )
    result = evaluate(evidence)
    assert [f.name for f in result.findings if not f.passed] == []
    assert result.figures["redeliveries"] == 2
    assert result.figures["recovered"] == 2
    assert result.effects["stale_from_sigstop"] == 1
    assert result.effects["cut_jobs"] == 1


def test_a_synthetic_run_with_a_foreign_ack_fails_that_check_only():
    audit = [claim("j2", T2, W1), recovered("j2", T2), claim("j2", T3, W0, attempts=2),
             finish("j2", T2, W1, attempts=2)]
    evidence = Evidence(
        expected={"o2"}, states={"o2": "done"}, audit=audit,
        workers=[WorkerView("worker-0", W0, metrics=_metrics(0, 0, 0, 1)),
                 WorkerView("worker-1", W1, metrics=_metrics(1, 0, 0, 1))],
        provider_stats={"requests": 1, "receipts": 1, "duplicates_suppressed": 0},
        receipts={"receipt:o2": {"order_id": "o2"}}, requests=[["receipt:o2", "1"]],
        faults=dict.fromkeys(FAULT_KINDS, 1),
    )
    failed = [f.name.split(":")[0].split(";")[0]
              for f in evaluate(evidence).findings if not f.passed]
    # No claim was cut and no ack refused in this run: those two checks fail too.
    assert failed == [
        "every ack or reschedule the database accepted came from the attempt that held the "
        "current token, under an unexpired lease",
        "no attempt whose claim answer was cut reached the provider",
        "stale acks are refused",
    ]


def test_a_claim_given_up_on_must_not_be_delivered_by_its_attempt_and_must_be_recovered():
    trail = read_trail(PROXIED)
    cut, lost = _row("j1", T1), _row("j4", T4)  # T1 was acked, never recovered
    finding = check_cut_claims([lost], 1, {}, trail, [lost])
    assert finding.passed
    assert finding.detail.startswith("1 cut job(s) in 1 cut(s) and 1 job(s) of claims given up")
    delivered = check_cut_claims([lost], 1, {"receipt:o-j4": ["1"]}, trail, [lost])
    assert not delivered.passed
    unrecovered = check_cut_claims([lost], 1, {}, trail, [cut])
    assert not unrecovered.passed and unrecovered.detail.endswith("1 not recovered")


def test_a_cut_attempt_that_reused_a_refunded_attempts_number_is_not_taken_for_its_request():
    # w1's attempt 1 of j5 (T5) got a 503 in a provider outage and was given back
    # (attempts 1 -> 0), so w0's next claim of j5 (T6, cut) is attempt 1 again. The
    # one request numbered 1 is T5's; a second one would be the cut attempt's.
    cut = _row("j5", T6)
    trail = read_trail([claim("j5", T5, W1), finish("j5", T5, W1, new="ready", attempts=0),
                        claim("j5", T6, W0), recovered("j5", T6),
                        claim("j5", T1, W1, attempts=2), finish("j5", T1, W1, attempts=2)])
    once = {"receipt:o-j5": ["1", "2"]}
    assert check_cut_claims([cut], 1, once, trail).passed
    twice = {"receipt:o-j5": ["1", "1", "2"]}
    finding = check_cut_claims([cut], 1, twice, trail)
    assert not finding.passed and "1 delivered by the cut attempt" in finding.detail


def _given_up(job: str, token: str, at: float) -> dict[str, object]:
    return {"event": "lease_lost", "outcome": "write_unconfirmed", "statement": "reschedule",
            "job_id": job, "token": token.replace("-", "")[:8], "attempt": 1,
            "time": f"1970-01-01T00:00:{at:06.3f}Z"}


def test_a_landed_reschedule_resolve_writes_cannot_tell_is_excused_only_when_overwritten_first():
    # w0's reschedule of j1 (T1) landed at t=1 but its answer was lost; the job, ready
    # again, was claimed by w1 (T2) and acked at t=5, replacing last_token; w0's
    # resolve_writes then found no row with its token and gave the write up at t=9.
    def rows(acked_at: float) -> list[AuditRow]:
        return [AuditRow("j1", "ready", "running", None, T1, False, 1, W0, 0.5),
                AuditRow("j1", "running", "ready", T1, None, True, 0, W0, 1.0),
                AuditRow("j1", "ready", "running", None, T2, False, 1, W1, 1.1),
                AuditRow("j1", "running", "done", T2, None, True, 1, W1, acked_at)]

    def workers(*given_up: dict[str, object]) -> list[WorkerView]:
        return [WorkerView("worker-0", W0, metrics=_metrics(0, 0, 0, 1), unconfirmed=given_up),
                WorkerView("worker-1", W1, metrics=_metrics(1, 0, 0, 1))]

    finding = check_counters(workers(_given_up("j1", T1, 9.0)), read_trail(rows(5.0)),
                             ProxiedClaims())
    assert finding.passed and "1 landed reschedule(s) it could not confirm" in finding.detail
    # Overwritten only after w0 gave up: resolve_writes should have seen it. Not excused.
    late = check_counters(workers(_given_up("j1", T1, 9.0)), read_trail(rows(12.0)),
                          ProxiedClaims())
    assert not late.passed and late.detail == "worker-0 retries_total=0 vs 1"
    # And a retry missing from the counter with no such log record fails as before.
    silent = check_counters(workers(), read_trail(rows(5.0)), ProxiedClaims())
    assert not silent.passed and silent.detail == "worker-0 retries_total=0 vs 1"
