"""Capacity planner: from a receipt rate and a delivery latency to pods, slots and connections.

Pure arithmetic, no I/O (``receipts plan`` prints what :func:`plan` returns).
The model, written out in docs/scaling.md:

* **Little's law**: jobs in flight = arrival rate × time each spends in flight
  (the provider's latency), so the fleet needs that many busy slots, and
  ``1 / utilisation`` times as many slots in total so that a burst finds some
  free.
* **Worker CPU**: a pod runs one Python event loop, which can use one core at
  most; each HTTP delivery costs :data:`HTTP_DELIVERY_CPU_SECONDS` of it. Pods
  are planned at :data:`POD_CPU_CORES` each.
* **Pods** are the larger of the two needs; the slots per pod follow from the
  pods (so that KEDA's target, slots × utilisation, matches the in-flight
  jobs each pod carries at the planned rate), within the range the bench
  measured.
* **Replicas**: the autoscaler may always add a pod (max > min), so a
  backlog after an outage drains faster than it grew, at any rate.
* **Memory** per pod follows its slots: a worker's resident set measured by
  ``python -m bench.memory`` at 32, 400 and 1,000 slots fits
  :data:`WORKER_RSS_BASE_BYTES` + :data:`WORKER_RSS_PER_SLOT_BYTES` × slots;
  the request is that figure, the limit :data:`MEMORY_LIMIT_HEADROOM` times it.
* **Connections** follow the chart's budget rule (pool + listener per pod,
  one extra draining pod in a rollout, recovery, migration, KEDA).
* **The database**: the rate as a share of the claim+ack ceiling of one
  PostgreSQL (the bench's, or one measured on your own server), and the WAL it
  writes. Above :data:`DB_SHARE_LIMIT` of that ceiling the queue is split over
  shards (a queue beside each orders shard, one release each) and the fleet
  figures are those of one release.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: Worker CPU per HTTP delivery, in seconds: the bench's figure
#: ``summary.capacity.worker_cpu_us_per_http_delivery`` of
#: ``bench/results/latest.json`` (one worker, 400 slots, reference provider at
#: 200 ms: the median of three rounds; it includes the claims, acks, event loop
#: and garbage collection a delivery brings with it). A test keeps the two equal;
#: ``receipts plan --cpu-per-delivery`` takes a figure measured on one's own nodes.
HTTP_DELIVERY_CPU_SECONDS = 390e-6

#: CPU a worker pod is planned to use at the given rate, in cores. One process
#: runs one event loop and cannot use more than one core; 0.7 keeps 30 % for
#: bursts, retries, TLS and the queue-statistics and commit-probe tasks.
POD_CPU_CORES = 0.7

#: Default share of a pod's slots kept busy (the chart's autoscaling.keda.utilisation).
DEFAULT_UTILISATION = 0.8

#: Fewest delivery slots per pod the planner proposes.
MIN_CONCURRENCY = 8

#: Most delivery slots per pod the planner proposes: the most the bench ran in
#: one process (500 slots, bench/README.md scenarios 2 and 7); more would be
#: unmeasured.
MAX_CONCURRENCY = 500

#: A worker process's resident memory at rest, bytes: the intercept of the line through
#: the peak resident sets ``python -m bench.memory`` measured at 32, 400 and 1,000 slots
#: (``summary.model.base_bytes`` of ``bench/results/memory.json``; a test keeps them equal).
WORKER_RSS_BASE_BYTES = 70_033_642

#: What each delivery slot adds to a worker's resident memory while its delivery is in
#: flight, bytes (``summary.model.per_slot_bytes`` of the same file: plain HTTP to the
#: reference provider; TLS connections add their own buffers, which the headroom covers).
WORKER_RSS_PER_SLOT_BYTES = 22_137

#: Memory limit / measured peak. The bench's peak has every slot waiting on a plain-HTTP
#: provider with small answers; in production a slot may also hold a TLS connection's
#: buffers (~34 KiB) and an answer body being read (up to 64 KiB), and garbage waits for
#: the collector: 500 slots × ~100 KiB is ~49 MiB on top of ~73 MiB measured, within 2×.
#: An OOM-killed worker abandons every lease it holds, so the limit errs high; the
#: request (what the scheduler reserves) stays the measured figure.
MEMORY_LIMIT_HEADROOM = 2.0

#: Memory figures are rounded up to this many bytes (Kubernetes quantities in Mi).
MEMORY_STEP_BYTES = 16 * 1024 * 1024

#: Database connections per worker pod: the chart's default pool (2) + the LISTEN connection.
CONNECTIONS_PER_POD = 3

#: Other connections of a release: recovery, migration, KEDA's scaler.
CONNECTIONS_OTHER = 3

#: Claim+ack jobs/s one PostgreSQL 18 sustained in the bench with nothing else
#: to do: pgbench running the project's claim (batch 100) and ack, 8 clients,
#: 2 vCPU, fsync and synchronous_commit on (bench/README.md, raw limit, on the
#: 2-vCPU AMD EPYC VM of 2026-11-30; other 2-vCPU VMs since measured 22,000–32,000,
#: so measure the database you run on and pass ``--db-ceiling``).
DB_CEILING_BATCHED_JOBS_PER_SECOND = 52_650

#: WAL written per job, in bytes: enqueue (one transaction each) + claim + ack +
#: VACUUM of the dead rows, without full-page images (1,330-1,490 B measured for
#: claim batches of 1, 10 and 100 on PostgreSQL 18.6; up to 1,940 B when every
#: page is touched for the first time after a checkpoint). docs/scaling.md says how.
WAL_BYTES_PER_JOB = 1_500

#: Above this share of the batched ceiling, one PostgreSQL of the bench's size
#: has no room left for the orders it serves: plan a second queue database.
DB_SHARE_LIMIT = 0.5


class PlanError(ValueError):
    """An input the planner cannot work with; ``str()`` is one line naming it."""


@dataclass(frozen=True)
class Plan:
    """A capacity plan. Rates in jobs per second, durations in seconds, CPU in cores.

    Attributes:
        rate: the receipt rate planned for (the peak, all shards), jobs/s.
        db_ceiling: claim+ack jobs/s one queue database sustains (measured).
        shards: queue databases (and releases) the rate needs; the fleet
            figures below are per release, for rate ÷ shards.
        latency_seconds: mean time a delivery is in flight (provider latency), s.
        utilisation: share of the slots kept busy at that rate (0 < u ≤ 1).
        in_flight: rate × latency (Little's law), jobs.
        worker_cpu_cores: rate × CPU per delivery, cores.
        cpu_per_delivery_seconds: worker CPU one HTTP delivery costs, seconds.
        pods_for_cpu: pods needed for the worker CPU at POD_CPU_CORES each.
        pods_for_slots: pods needed for the slots at MAX_CONCURRENCY each.
        concurrency: delivery slots per pod (config.concurrency).
        min_replicas, max_replicas: the autoscaling range; max > min always, so the
            autoscaler can add a pod for a backlog whatever the rate.
        memory_request_bytes: a pod's expected resident memory at its slots (bench).
        memory_limit_bytes: its limit, MEMORY_LIMIT_HEADROOM × that, rounded up.
        keda_target: jobs due or in flight per pod KEDA aims for,
            floor(concurrency × utilisation), at least 1.
        connections: the chart's connection budget for this plan.
        db_share: the rate of one shard ÷ db_ceiling.
        wal_bytes_per_second: one shard's rate × WAL_BYTES_PER_JOB.
        provider_capacity: concurrent requests the provider takes (None: not
            given); with it, the plan turns adaptive concurrency on.
    """

    rate: float
    db_ceiling: float
    shards: int
    latency_seconds: float
    utilisation: float
    in_flight: float
    worker_cpu_cores: float
    cpu_per_delivery_seconds: float
    pods_for_cpu: int
    pods_for_slots: int
    concurrency: int
    min_replicas: int
    max_replicas: int
    memory_request_bytes: int
    memory_limit_bytes: int
    keda_target: int
    connections: int
    db_share: float
    wal_bytes_per_second: float
    provider_capacity: float | None = None

    @property
    def provider_rate(self) -> float | None:
        """Receipts/s the provider's capacity allows (capacity ÷ latency); None: not given."""
        if self.provider_capacity is None:
            return None
        return self.provider_capacity / self.latency_seconds

    @property
    def capacity_pods(self) -> int | None:
        """The most pods the capped signal (KEDA's, or the external-metric HPA's recording
        rule) asks for while the provider holds the fleet at its capacity:
        ceil(capacity ÷ slots per pod) + 1 (the headroom pod)."""
        if self.provider_capacity is None:
            return None
        return math.ceil(self.provider_capacity / self.concurrency) + 1

    @property
    def release_rate(self) -> float:
        """Jobs/s one release (one shard) carries."""
        return self.rate / self.shards


def plan(rate: float, latency_seconds: float, *,
         utilisation: float = DEFAULT_UTILISATION,
         db_ceiling: float = DB_CEILING_BATCHED_JOBS_PER_SECOND,
         cpu_per_delivery_seconds: float = HTTP_DELIVERY_CPU_SECONDS,
         provider_capacity: float | None = None) -> Plan:
    """Plan a fleet for *rate* receipts/s whose deliveries take *latency_seconds* each.

    The rate is the peak to carry; the result has a quarter more pods (at
    least one, and always more than the minimum) as headroom to drain a
    backlog after an outage and to lose a pod, and at least two pods so that a
    rollout or one pod's loss never stops delivery. Each pod's memory request
    and limit follow from its slots and the bench's memory figures.
    *db_ceiling* is the claim+ack jobs/s one queue database sustains
    (default: the bench's 2-vCPU PostgreSQL; measure your own with the
    bench's raw scenario). *cpu_per_delivery_seconds* is the worker CPU
    one HTTP delivery costs (default: the bench's figure; ``bench/run.sh`` on
    your own nodes writes yours as
    ``summary.capacity.worker_cpu_us_per_http_delivery``). *provider_capacity*
    is how many requests the provider takes at once, when known: the plan
    then says what rate that allows and turns adaptive concurrency on, so the
    fleet finds the capacity by itself and KEDA stops adding pods it cannot
    use (docs/scaling.md). Raises
    :class:`PlanError` for a rate, latency, ceiling or CPU figure that is not
    a positive finite number, a provider capacity that is not a whole number of
    requests, or a utilisation outside (0, 1].
    """
    _check("--rate", rate, upper=10_000_000)
    _check("--latency", latency_seconds, upper=3_600)
    _check("--db-ceiling", db_ceiling, upper=100_000_000)
    _check("--cpu-per-delivery", cpu_per_delivery_seconds * 1e6, upper=1_000_000)
    if provider_capacity is not None:
        _check("--provider-capacity", provider_capacity, upper=10_000_000)
        if provider_capacity != int(provider_capacity):
            raise PlanError("--provider-capacity counts requests at once: a whole number, "
                            f"not {provider_capacity:g}")
    if not (math.isfinite(utilisation) and 0 < utilisation <= 1):
        raise PlanError(f"--utilisation must be above 0 and at most 1, not {utilisation:g}")

    shards = max(1, math.ceil(rate / (db_ceiling * DB_SHARE_LIMIT)))
    release_rate = rate / shards
    in_flight = release_rate * latency_seconds
    slots_total = in_flight / utilisation
    cpu = release_rate * cpu_per_delivery_seconds
    pods_for_cpu = max(1, math.ceil(cpu / POD_CPU_CORES))
    pods_for_slots = max(1, math.ceil(slots_total / MAX_CONCURRENCY))
    pods = max(pods_for_cpu, pods_for_slots)
    concurrency = min(MAX_CONCURRENCY, max(MIN_CONCURRENCY, math.ceil(slots_total / pods)))
    min_replicas = 2
    max_replicas = max(min_replicas + 1, pods + max(1, math.ceil(pods / 4)))
    rss = WORKER_RSS_BASE_BYTES + WORKER_RSS_PER_SLOT_BYTES * concurrency
    keda_target = max(1, math.floor(concurrency * utilisation))
    connections = (max_replicas + 1) * CONNECTIONS_PER_POD + CONNECTIONS_OTHER
    return Plan(
        rate=rate,
        db_ceiling=db_ceiling,
        shards=shards,
        latency_seconds=latency_seconds,
        utilisation=utilisation,
        in_flight=in_flight,
        worker_cpu_cores=cpu,
        cpu_per_delivery_seconds=cpu_per_delivery_seconds,
        pods_for_cpu=pods_for_cpu,
        pods_for_slots=pods_for_slots,
        concurrency=concurrency,
        min_replicas=min_replicas,
        max_replicas=max_replicas,
        memory_request_bytes=_round_up(rss, MEMORY_STEP_BYTES),
        memory_limit_bytes=_round_up(rss * MEMORY_LIMIT_HEADROOM, MEMORY_STEP_BYTES),
        keda_target=keda_target,
        connections=connections,
        db_share=release_rate / db_ceiling,
        wal_bytes_per_second=release_rate * WAL_BYTES_PER_JOB,
        provider_capacity=provider_capacity,
    )


def _round_up(value: float, step: int) -> int:
    return math.ceil(value / step) * step


def _mi(value: int) -> str:
    """Bytes as a Kubernetes quantity in Mi."""
    return f"{value // (1024 * 1024)}Mi"


def _check(option: str, value: float, *, upper: float) -> None:
    if not (math.isfinite(value) and 0 < value <= upper):
        raise PlanError(f"{option} must be a number above 0 and at most {upper:,.0f}, "
                        f"not {value:g}")


def helm_values(p: Plan) -> str:
    """The Helm values of *p* as a YAML snippet to paste into a values file."""
    pods = max(p.pods_for_cpu, p.pods_for_slots)
    millicores = max(100, math.ceil(p.worker_cpu_cores / pods * 1000 / 50) * 50)
    adaptive = "" if p.provider_capacity is None else "  adaptiveConcurrency: true\n"
    if adaptive:
        # The limit never exceeds its ceiling (default 64): one below the slots would leave
        # slots unused, so the plan sets it to the slots.
        adaptive += f"  adaptiveConcurrencyCeiling: {p.concurrency}\n"
    return (
        "config:\n"
        f"  concurrency: {p.concurrency}\n"
        f"{adaptive}"
        "worker:\n"
        "  resources:\n"
        "    requests:\n"
        f"      cpu: {millicores}m\n"
        f"      memory: {_mi(p.memory_request_bytes)}\n"
        "    limits:\n"
        f"      memory: {_mi(p.memory_limit_bytes)}\n"
        "autoscaling:\n"
        "  enabled: true\n"
        f"  minReplicas: {p.min_replicas}\n"
        f"  maxReplicas: {p.max_replicas}\n"
        "  keda:\n"
        "    enabled: true\n"
        f"    utilisation: {p.utilisation:g}\n"
        "connectionBudget:\n"
        f"  maxConnections: {p.connections}\n"
    )


def describe(p: Plan) -> str:
    """*p* as the text ``receipts plan`` prints: the figures, the reasoning, the values."""
    mb = p.wal_bytes_per_second / 1e6
    lines = [
        f"plan for {p.rate:,g} receipts/s at {p.latency_seconds:g} s per delivery "
        f"(utilisation {p.utilisation:g})",
        "",
    ]
    if p.shards > 1:
        lines += [
            f"shards             {p.shards} queue databases, one release each, "
            f"{p.release_rate:,.0f} receipts/s per release",
            f"                   ({p.rate:,g}/s is above {DB_SHARE_LIMIT:.0%} of one database's "
            f"{p.db_ceiling:,g}/s claim+ack ceiling; docs/scaling.md)",
            "",
            "per release:",
        ]
    lines += [
        f"in flight          {p.in_flight:,.1f} jobs (Little's law: rate × latency)",
        f"worker CPU         {p.worker_cpu_cores:,.2f} cores "
        f"({p.cpu_per_delivery_seconds * 1e6:.0f} µs per delivery"
        f"{', bench' if p.cpu_per_delivery_seconds == HTTP_DELIVERY_CPU_SECONDS else ''})",
        f"pods               {max(p.pods_for_cpu, p.pods_for_slots)} needed "
        f"({p.pods_for_cpu} for CPU at {POD_CPU_CORES:g} core each, {p.pods_for_slots} for "
        f"slots at ≤ {MAX_CONCURRENCY} each)",
        f"concurrency        {p.concurrency} slots per pod",
        f"replicas           min {p.min_replicas}, max {p.max_replicas} "
        "(+25 % headroom, at least 1 pod more than min)",
        f"memory             {_mi(p.memory_request_bytes)} per pod, limit "
        f"{_mi(p.memory_limit_bytes)} (bench: "
        f"{WORKER_RSS_BASE_BYTES / 2**20:.0f} MiB + {WORKER_RSS_PER_SLOT_BYTES / 1024:.0f} KiB"
        f" × {p.concurrency} slots; × {MEMORY_LIMIT_HEADROOM:g} for the limit)",
        f"KEDA target        {p.keda_target} jobs due or in flight per pod "
        "(slots × utilisation)",
        f"DB connections     {p.connections} = ({p.max_replicas} + 1 draining) × "
        f"{CONNECTIONS_PER_POD} + recovery, migration, KEDA",
        f"database           {p.db_share:.1%} of the {p.db_ceiling:,g}/s claim+ack ceiling, "
        f"WAL ≈ {mb:,.2f} MB/s ({WAL_BYTES_PER_JOB:,} B per job)",
        *_provider_lines(p),
        "",
        "Helm values" + (" (each release):" if p.shards > 1 else ":"),
        "",
        helm_values(p).rstrip("\n"),
    ]
    return "\n".join(lines)


def _provider_lines(p: Plan) -> list[str]:
    """What the provider's capacity means for *p* (nothing when it was not given)."""
    if p.provider_capacity is None or p.provider_rate is None:
        return []
    capacity = int(p.provider_capacity)
    held = (f"a fleet the provider holds asks for at most {p.capacity_pods} pods "
            f"(ceil({capacity:,d} / {p.concurrency}) + 1)")
    if p.capacity_pods is not None and p.capacity_pods > p.max_replicas:
        held = (f"it takes more than maxReplicas {p.max_replicas} pods can send "
                f"({p.max_replicas * p.concurrency:,d} at once), so it never holds this "
                "fleet: the limits guard a drop in its capacity")
    lines = [f"provider           {capacity:,d} requests at once allow "
             f"{p.provider_rate:,.1f} receipts/s at {p.latency_seconds:g} s; adaptive "
             "concurrency on: with KEDA, or the HPA on the external metric (the chart's "
             f"recording rule), {held}"]
    if p.release_rate > p.provider_rate:
        lines.append(f"                   the rate is above it: backlogs drain at "
                     f"{p.provider_rate:,.1f}/s whatever the pods (ask the provider for more)")
    if p.min_replicas > p.provider_capacity:
        # Each pod keeps at least its floor (1) in flight: more pods than the capacity
        # overload the provider whatever their limits say.
        lines.append(f"                   minReplicas {p.min_replicas} is above it: each pod "
                     "keeps at least one request in flight (the limit's floor), so that many "
                     "pods overload it; run fewer or ask the provider for more")
    return lines
