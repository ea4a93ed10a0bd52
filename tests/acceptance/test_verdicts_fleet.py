"""Rejections judged on evidence across a fleet: two real worker processes with the default
settings, one reference provider process whose behaviour is switched while it runs
(``PUT /faults``), PostgreSQL.

Orders whose id starts with ``bad-`` are genuinely invalid: a provider that judges
orders answers them 422 (``invalid_pattern``). The provider's other behaviours reject
everything in ways no rule can fit to one shape: bodies with random request ids and
ISO timestamps, HTML error pages, statuses rotating through 400/404/422, phases of
rejecting and accepting everything.
"""

from __future__ import annotations

import json
import random
import re
import time
from collections.abc import Callable, Iterator

import pytest
import yaml

from receipts.embedded import free_port
from receipts.supervisor import Child, Supervisor, run_command
from tests.chart import chartkit
from tests.conftest import Trickle, check_invariants, enqueue_many, fetch_rows

#: The other variants of a scenario: `make test-long` runs them, `make test` one of each.
LONG = pytest.mark.long

INVALID = "^bad-"


def until(predicate: Callable[[], bool], what: str, timeout_seconds: float) -> None:
    deadline = time.monotonic() + timeout_seconds
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout_seconds:g}s: {what}"
        time.sleep(0.1)


@pytest.fixture
def dsn(pg18) -> Iterator[str]:
    """A fresh migrated database (PostgreSQL 18 only: what these prove does not depend
    on the server version)."""
    database = pg18.new_database()
    yield database
    pg18.drop_database(database)


def set_faults(provider: Child, **faults: object) -> None:
    provider.request("PUT", "/faults", json=faults).raise_for_status()


#: The variants with adaptive concurrency on (``RECEIPTS_ADAPTIVE_CONCURRENCY``): each
#: scenario's verdict must not change when every worker's limit on deliveries in flight
#: adapts to the provider's answers (a rejection is no overload signal; a held claim is
#: no decrease).
ADAPTIVE = pytest.param(True, marks=LONG, id="adaptive")
FIXED = pytest.param(False, id="fixed")


def start_workers(sup: Supervisor, dsn: str, provider: Child, n: int = 2, *,
                  adaptive: bool = False) -> list[Child]:
    workers = []
    for i in range(n):
        port = free_port()
        env = {"RECEIPTS_DATABASE_URL": dsn, "RECEIPTS_PROVIDER_URL": provider.url("/receipts"),
               "RECEIPTS_METRICS_PORT": str(port)}
        if adaptive:
            env["RECEIPTS_ADAPTIVE_CONCURRENCY"] = "true"
        workers.append(sup.start(f"worker-{i}", ["worker"], env, port=port))
    return [w.wait_healthy() for w in workers]


def counts(dsn: str) -> dict[str, int]:
    """Jobs by outcome: valid done/failed, invalid failed, held, pending."""
    (row,) = fetch_rows(
        dsn,
        "SELECT count(*) FILTER (WHERE state = 'done' AND order_id NOT LIKE 'bad-%%'),"
        " count(*) FILTER (WHERE state = 'failed' AND order_id NOT LIKE 'bad-%%'),"
        " count(*) FILTER (WHERE state = 'failed' AND order_id LIKE 'bad-%%'),"
        " count(*) FILTER (WHERE state = 'ready' AND last_error LIKE 'held rejection:%%'),"
        " count(*) FILTER (WHERE state IN ('ready', 'running'))"
        " FROM receipt_jobs")
    return dict(zip(("done", "failed_valid", "failed_invalid", "held", "pending"), row,
                    strict=True))  # type: ignore[arg-type]


def paused_for_rejecting(workers: list[Child]) -> bool:
    return any(w.scrape().value("receipts_provider_paused", reason="rejecting") == 1
               for w in workers)


def pauses(workers: list[Child]) -> float:
    return sum(w.scrape().value("receipts_provider_pauses_total", reason="rejecting")
               for w in workers)


def accepted_after(provider: Child, since: float) -> float | None:
    times = [t for t, status in provider.get_json("/answers") if status < 300 and t > since]
    return min(times) - since if times else None


# ------------------------------------------------------------- fast lane: a smoke


def test_a_provider_rejecting_everything_with_ever_different_answers_fails_nothing(
        dsn, sup, provider):
    """Statuses rotating 400/404/422, each body with a random request id and a timestamp."""
    enqueue_many(dsn, [f"ok-{i}" for i in range(100)])
    set_faults(provider, reject_statuses=[400, 404, 422], reject_body="json_ids")
    workers = start_workers(sup, dsn, provider)
    until(lambda: paused_for_rejecting(workers), "a rejecting pause", 30)
    assert counts(dsn)["failed_valid"] == 0
    set_faults(provider, reject_statuses=None)
    healed = time.monotonic()
    until(lambda: counts(dsn)["done"] == 100, "every receipt delivered", 60)
    assert accepted_after(provider, healed) <= 10.0
    assert counts(dsn)["failed_valid"] == 0
    check_invariants(dsn, 5)


def test_the_held_rejections_are_one_group_an_operator_can_list_and_discard(dsn, sup, provider):
    """Every queued order invalid while the provider is healthy cannot be told from a
    provider rejecting everything: the fleet pauses, nothing fails, and the operator
    sees the held rejections as one group and gives up on them."""
    enqueue_many(dsn, [f"bad-{i}" for i in range(30)])
    set_faults(provider, invalid_pattern=INVALID)
    workers = start_workers(sup, dsn, provider)
    until(lambda: paused_for_rejecting(workers), "a rejecting pause", 30)
    until(lambda: counts(dsn)["held"] == 30, "every job held and ready", 30)
    env = {"RECEIPTS_DATABASE_URL": dsn}
    # The paused fleet probes now and then: a probed job is running for a moment, not
    # held, and is held again once the provider rejects it. So the operator may have to
    # look twice, and discard twice (a machine under load once caught a probe: 26 of 30).
    deadline = time.monotonic() + 30
    while True:
        listed = run_command(["jobs", "list", "--held", "--json"], env, timeout_seconds=30)
        assert listed.returncode == 0, listed.stderr
        rows = json.loads(listed.stdout)
        if len(rows) == 30 or time.monotonic() > deadline:
            break
    assert len(rows) == 30 and all(r["last_error"].startswith("held rejection: 422 ")
                                   for r in rows)
    discarded = 0
    while discarded < 30 and time.monotonic() < deadline + 30:
        out = run_command(["jobs", "discard", "--held"], env, timeout_seconds=30)
        assert out.returncode == 0, out.stderr
        said = re.search(r"(\d+) held rejection\(s\) discarded", out.stdout)
        assert said is not None, out.stdout
        discarded += int(said.group(1))
    assert discarded == 30
    assert counts(dsn)["failed_valid"] == 0
    # New orders: the next probe is accepted and the fleet resumes.
    enqueue_many(dsn, [f"ok-{i}" for i in range(10)])
    until(lambda: counts(dsn)["done"] == 10, "new orders delivered after the resume", 30)
    assert fetch_rows(dsn, "SELECT count(*) FROM receipt_jobs WHERE state = 'discarded'") == [
        (30,)]


# ---------------------------------------------------------------- the slow lane


@pytest.mark.slow
@pytest.mark.parametrize(("statuses", "body", "adaptive"), [
    ([422], "json_ids", False), pytest.param([400], "html", False, marks=LONG),
    pytest.param([400, 404, 422], "json", False, marks=LONG),
    pytest.param([422], "text", False, marks=LONG),
    pytest.param([422], "json_ids", True, marks=LONG)],
    ids=["ids-and-timestamps", "html-pages", "rotating-statuses", "text",
         "ids-and-timestamps-adaptive"])
def test_a_provider_rejecting_everything_pauses_the_fleet_and_resumes_soon_after_it_heals(
        dsn, sup, provider, statuses, body, adaptive):
    enqueue_many(dsn, [f"ok-{i}" for i in range(50)])
    set_faults(provider, latency_seconds=0.01)
    workers = start_workers(sup, dsn, provider, adaptive=adaptive)
    until(lambda: counts(dsn)["done"] == 50, "deliveries under way", 30)
    # The provider turns while the fleet has work (enqueued after the turn: a fleet that
    # delivers faster than this test reads would otherwise have nothing left to reject).
    set_faults(provider, reject_statuses=statuses, reject_body=body)
    enqueue_many(dsn, [f"ok-{i}" for i in range(50, 300)])
    until(lambda: all(paused_for_rejecting([w]) for w in workers), "every worker paused", 30)
    time.sleep(12)  # the pause holds through probes rejected again
    assert paused_for_rejecting(workers)
    during = counts(dsn)
    assert during["failed_valid"] == 0
    assert fetch_rows(dsn, "SELECT max(attempts) FROM receipt_jobs WHERE state = 'ready'") == [
        (0,)]  # every rejected attempt given back
    set_faults(provider, reject_statuses=None)
    healed = time.monotonic()
    until(lambda: counts(dsn)["done"] == 300, "every receipt delivered", 90)
    resumed = accepted_after(provider, healed)
    print(f"\n[figures] rejecting everything ({statuses}, {body}): 0 failed, "
          f"{pauses(workers):g} pause extensions, first receipt {resumed:.1f}s after healing")
    assert resumed is not None and resumed <= 10.0
    assert counts(dsn)["failed_valid"] == 0
    check_invariants(dsn, 5)


@pytest.mark.slow
@pytest.mark.parametrize(("phase_seconds", "adaptive"), [
    (5.0, False), pytest.param(12.0, False, marks=LONG), pytest.param(30.0, False, marks=LONG),
    pytest.param(5.0, True, marks=LONG)],
    ids=["5s-phases", "12s-phases", "30s-phases", "5s-phases-adaptive"])
def test_a_flapping_provider_fails_no_valid_receipt(dsn, sup, provider, phase_seconds, adaptive):
    """Orders arrive at 10/s while the provider rejects everything and accepts everything
    in turns; the run spans at least two rejecting phases (20 s: four 5 s phases)."""
    set_faults(provider, reject_statuses=[422], reject_body="json_ids",
               flap_seconds=phase_seconds)
    workers = start_workers(sup, dsn, provider, adaptive=adaptive)
    trickle = Trickle(dsn, 10.0, prefix="ok-")
    try:
        time.sleep(max(20.0, 3.5 * phase_seconds))
    finally:
        trickle.stop()
    set_faults(provider, reject_statuses=None, flap_seconds=0)
    until(lambda: counts(dsn)["pending"] == 0, "every receipt delivered", 120)
    final = counts(dsn)
    print(f"\n[figures] flapping {phase_seconds:g}s: {trickle.sent} orders, "
          f"{final['done']} delivered, {final['failed_valid']} failed, "
          f"{pauses(workers):g} pause extensions")
    assert final["failed_valid"] == 0 and final["done"] == trickle.sent


@pytest.mark.slow
@pytest.mark.parametrize(("invalid_share", "adaptive"), [
    pytest.param(0.10, False, marks=LONG), (0.60, False), pytest.param(0.95, False, marks=LONG),
    pytest.param(0.60, True, marks=LONG)],
    ids=["10%-invalid", "60%-invalid", "95%-invalid", "60%-invalid-adaptive"])
def test_a_batch_of_mostly_invalid_orders_fails_them_and_stalls_no_valid_one(
        dsn, sup, provider, invalid_share, adaptive):
    """400 orders at once beside the shop's ordinary traffic (5 valid orders/s): no
    pause, each invalid order fails with its reason within 60 s, every valid one is
    delivered."""
    set_faults(provider, invalid_pattern=INVALID)
    workers = start_workers(sup, dsn, provider, adaptive=adaptive)
    trickle = Trickle(dsn, 5.0)
    try:
        until(lambda: counts(dsn)["done"] >= 5, "the ordinary traffic flowing", 30)
        rng = random.Random(11)
        bad = set(rng.sample(range(400), round(400 * invalid_share)))
        enqueue_many(dsn, [f"{'bad' if i in bad else 'ok'}-{i}" for i in range(400)])
        until(lambda: counts(dsn)["failed_invalid"] == len(bad), "every invalid order failed",
              60)
        until(lambda: fetch_rows(dsn, "SELECT count(*) FROM receipt_jobs WHERE state = 'done'"
                                      " AND order_id LIKE 'ok-%%' AND order_id NOT LIKE 'ok-t%%'"
                                 ) == [(400 - len(bad),)], "every valid order delivered", 30)
    finally:
        trickle.stop()
    ((slowest, errors),) = fetch_rows(
        dsn, "SELECT max(extract(epoch FROM finished_at - created_at)),"
             " count(*) FILTER (WHERE last_error NOT LIKE '422 order bad-%%')"
             " FROM receipt_jobs WHERE state = 'failed'")
    print(f"\n[figures] {len(bad)} invalid of 400 beside 5/s of traffic: slowest failed "
          f"{float(slowest):.1f}s after enqueue, {pauses(workers):g} pauses")
    assert pauses(workers) == 0
    assert counts(dsn)["failed_valid"] == 0
    assert errors == 0  # each failed with the provider's reason
    assert float(slowest) <= 60.0


@pytest.mark.slow
@pytest.mark.parametrize("adaptive", [FIXED, ADAPTIVE])
def test_a_trickle_meets_a_provider_that_starts_rejecting_everything(dsn, sup, provider,
                                                                    adaptive):
    """2 orders/s over 2 pods: each pod has mostly nothing else in flight when a rejection
    comes back; none of them fails."""
    workers = start_workers(sup, dsn, provider, adaptive=adaptive)
    trickle = Trickle(dsn, 2.0, prefix="ok-")
    try:
        until(lambda: counts(dsn)["done"] >= 10, "the trickle flowing", 30)
        set_faults(provider, reject_statuses=[422], reject_body="json")
        until(lambda: paused_for_rejecting(workers), "a rejecting pause", 30)
        time.sleep(10)
        assert counts(dsn)["failed_valid"] == 0
        set_faults(provider, reject_statuses=None)
        healed = time.monotonic()
        until(lambda: accepted_after(provider, healed) is not None, "a receipt again", 15)
        assert accepted_after(provider, healed) <= 10.0
    finally:
        trickle.stop()
    until(lambda: counts(dsn)["pending"] == 0, "every receipt delivered", 60)
    assert counts(dsn)["failed_valid"] == 0


# ------------------------------------------- the alert, from the workers' own metrics

#: Prometheus's scrape interval in the chart (``serviceMonitor.interval``): each scrape
#: of this test stands for one scrape at that interval.
PROMETHEUS_SCRAPE = "30s"
#: How often this test scrapes, seconds.
SCRAPE_SECONDS = 0.5
#: Scrapes kept once every worker reports the rejecting pause: more than the alert's
#: 10-minute window holds at that interval (20).
SCRAPES_PAUSED = 22


def _scrape_series(workers: list[Child], names: set[str]) -> list[dict[tuple[str, tuple], float]]:
    """One scrape of every worker: {(sample name, labels with job, namespace and
    instance added): value} for the samples named in *names*."""
    out: dict[tuple[str, tuple], float] = {}
    for i, w in enumerate(workers):
        for (name, labels), value in w.scrape().items():
            if name in names:
                extra = (("instance", f"worker-{i}"), ("job", "receipts"), ("namespace", "shop"))
                out[(name, tuple(sorted(labels + extra)))] = value
    return [out]


def _promtool_input(scrapes: list[dict[tuple[str, tuple], float]]) -> list[dict[str, str]]:
    """promtool ``input_series``: one series per (name, labels), one value per scrape
    (``_`` where a scrape lacked it)."""
    keys = sorted({k for s in scrapes for k in s})
    series = []
    for name, labels in keys:
        selector = ",".join(f'{k}="{v}"' for k, v in labels)
        values = " ".join(f"{s[(name, labels)]:g}" if (name, labels) in s else "_"
                          for s in scrapes)
        series.append({"series": f"{name}{{{selector}}}", "values": values})
    return series


@pytest.mark.slow
def test_the_rejecting_alert_fires_on_the_workers_own_metrics(dsn, sup, provider, tmp_path):
    """A provider that turns to rejecting everything under two real workers: their
    /metrics, scraped twice a second, become promtool's input series (one scrape per
    Prometheus scrape interval of the chart, so the fleet's seconds stand for minutes:
    the two alerts read how many scrapes showed a pause and how far counters rose,
    which the compression does not change), and the chart's rendered rules run on
    them: ``ReceiptsProviderRejecting`` is silent while the fleet delivers and as the
    pause begins, and fires once the pause has filled its window;
    ``ReceiptsJobsFailed`` never fires (no job failed)."""
    rules = yaml.safe_load(chartkit.default_rules_text())
    exprs = {r["alert"]: r["expr"] for g in rules["groups"] for r in g["rules"] if "alert" in r}
    names = set()
    for alert in ("ReceiptsProviderRejecting", "ReceiptsJobsFailed"):
        names |= set(re.findall(r"receipts_[a-z_]+", exprs[alert]))
    enqueue_many(dsn, [f"ok-{i}" for i in range(50)])
    set_faults(provider, latency_seconds=0.01)
    workers = start_workers(sup, dsn, provider)
    scrapes: list[dict[tuple[str, tuple], float]] = []

    def scrape_until(predicate: Callable[[], bool], what: str, timeout_seconds: float) -> None:
        deadline = time.monotonic() + timeout_seconds
        while True:
            step = time.monotonic()
            scrapes.extend(_scrape_series(workers, names))
            if predicate():
                return
            assert time.monotonic() < deadline, f"timed out after {timeout_seconds:g}s: {what}"
            time.sleep(max(0.0, SCRAPE_SECONDS - (time.monotonic() - step)))

    scrape_until(lambda: len(scrapes) >= 3 and counts(dsn)["done"] == 50,
                 "deliveries under way", 30)
    healthy = len(scrapes)
    set_faults(provider, reject_statuses=[422], reject_body="json_ids")
    enqueue_many(dsn, [f"ok-{i}" for i in range(50, 300)])
    scrape_until(lambda: all(paused_for_rejecting([w]) for w in workers),
                 "every worker paused", 30)
    onset = len(scrapes)
    scrape_until(lambda: len(scrapes) >= onset + SCRAPES_PAUSED, "scrapes of the pause", 60)
    assert counts(dsn)["failed_valid"] == 0
    for group in rules["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations", None)  # promtool would compare them too
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rules))
    step = int(PROMETHEUS_SCRAPE.rstrip("s"))
    last = (len(scrapes) - 1) * step
    fired = [{"exp_labels": {"severity": "warning", "namespace": "shop", "job": "receipts"}}]
    tests = {
        "rule_files": ["rules.yaml"],
        "evaluation_interval": PROMETHEUS_SCRAPE,
        "tests": [{
            "interval": PROMETHEUS_SCRAPE,
            "input_series": _promtool_input(scrapes),
            "alert_rule_test": [
                {"eval_time": f"{(healthy - 1) * step}s",
                 "alertname": "ReceiptsProviderRejecting", "exp_alerts": []},
                {"eval_time": f"{onset * step}s",
                 "alertname": "ReceiptsProviderRejecting", "exp_alerts": []},
                {"eval_time": f"{last}s", "alertname": "ReceiptsProviderRejecting",
                 "exp_alerts": fired},
                {"eval_time": f"{last}s", "alertname": "ReceiptsJobsFailed", "exp_alerts": []},
            ],
        }],
    }
    (tmp_path / "rules.test.yaml").write_text(yaml.safe_dump(tests))
    result = chartkit.run([chartkit.find_tool("promtool"), "test", "rules", "rules.test.yaml"],
                          cwd=tmp_path)
    print(f"\n[figures] {len(scrapes)} scrapes of 2 workers: {healthy} healthy, "
          f"{onset - healthy} before every worker paused, {len(scrapes) - onset} paused")
    assert result.returncode == 0, result.stdout + result.stderr
