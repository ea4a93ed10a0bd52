"""The chaos run's report: what was injected, what followed, and every check's verdict."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from tests.chaos.checks import FAULT_KINDS, Finding, all_passed, failed_lines

if TYPE_CHECKING:
    from tests.chaos.run import ChaosConfig


@dataclass(slots=True)
class ChaosReport:
    """What a run did and whether its checks passed."""

    config: ChaosConfig
    wall_seconds: float = 0.0
    drain_seconds: float = 0.0
    states: dict[str, int] = field(default_factory=dict)
    faults: Counter[str] = field(default_factory=Counter)
    effects: dict[str, int] = field(default_factory=dict)
    figures: dict[str, float] = field(default_factory=dict)
    checks: list[Finding] = field(default_factory=list)
    workdir: Path | None = None

    @property
    def ok(self) -> bool:
        """True when every check passed."""
        return all_passed(self.checks)

    @property
    def failures(self) -> list[str]:
        """The failed checks as ``name: detail`` lines."""
        return failed_lines(self.checks)

    def table(self) -> str:
        """The run's figures as a plain-text table."""
        f, e = self.figures, self.effects
        rows: list[tuple[str, str]] = [
            ("jobs enqueued", f"{self.config.jobs}"),
            ("done / failed", f"{self.states.get('done', 0)} / {self.states.get('failed', 0)}"),
            ("lost (not done or failed)", f"{int(f.get('lost', 0))}"),
            ("worker processes (incl. replacements)", f"{int(f.get('worker_processes', 0))}"),
        ]
        labels = {
            "sigkill": ("SIGKILL mid-delivery (+ replacement)", "jobs_abandoned"),
            "sigstop": ("SIGSTOP past the lease, then SIGCONT", "stale_from_sigstop"),
            "pg_restart": ("PostgreSQL restart (fast)", ""),
            "terminate": ("pg_terminate_backend bursts", ""),
            "claim_cut": ("claim committed, answer cut (proxy)", "cut_jobs"),
            "write_cut": ("ack/reschedule committed, answer cut (proxy)", "write_answers_cut"),
            # claim jobs given up: committed claims whose answer the worker had given
            # up on at its deadline (it never took them; recovery did)
            "half_open": ("all connections half-open past the deadline (proxy)",
                          "claim_jobs_given_up"),
            "db_stall": ("DB link stalled past the lease (proxy)", "stale_from_stall"),
            "latency_spike": ("provider latency > delivery timeout", "timeouts"),
            # timeouts: every worker's retries{reason="timeout"} (hangs included)
            "burst_5xx": ("provider 503 bursts", "status_503"),
            "burst_429": ("provider 429 + Retry-After bursts", "status_429"),
            "hang_after_headers": ("provider hang after headers", "fault_hang_after_headers"),
            "reset": ("provider reset after recording", "fault_reset"),
            "hang": ("provider hang after recording", "fault_timeout"),
        }
        rows.append(("faults injected", "windows/events   effect"))
        for kind in FAULT_KINDS:
            label, effect = labels[kind]
            extra = f"{e.get(effect, 0)} {effect.replace('_', ' ')}" if effect else ""
            rows.append((f"  {label}", f"{self.faults.get(kind, 0):<16} {extra}".rstrip()))
        rows.append(("  backends terminated mid-claim / mid-ack",
                     f"{e.get('terminated_claim', 0)} / {e.get('terminated_ack', 0)}"))
        rows += [
            ("provider requests", f"{int(f.get('provider_requests', 0))}"),
            ("receipts recorded by the provider", f"{int(f.get('receipts', 0))}"),
            ("redeliveries (repeat requests for a key)", f"{int(f.get('redeliveries', 0))}"),
            ("duplicates suppressed by the provider",
             f"{int(f.get('duplicates_suppressed', 0))}"),
            ("stale acks/reschedules refused (logs, all workers)",
             f"{int(f.get('stale_refused_logged', 0))}"),
            ("  of which delivered, then ack refused", f"{int(f.get('stale_acks_logged', 0))}"),
            ("stale acks (metric, surviving workers)", f"{int(f.get('stale_metric', 0))}"),
            ("leases expired and recovered", f"{int(f.get('recovered', 0))}"),
            ("acks accepted from a non-current token", f"{int(f.get('foreign_acks', 0))}"),
            ("wall time", f"{self.wall_seconds:.1f} s (drain {self.drain_seconds:.1f} s)"),
            ("throughput", f"{f.get('throughput', 0):.0f} jobs/s"),
        ]
        width = max(len(k) for k, _ in rows)
        lines = [f"{k.ljust(width)}  {v}" for k, v in rows]
        lines.append("")
        lines += [f"[{'ok' if c.passed else 'FAIL'}] {c.name}"
                  + (f" — {c.detail}" if c.detail else "") for c in self.checks]
        return "\n".join(lines)
