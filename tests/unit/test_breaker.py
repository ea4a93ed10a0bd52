"""The provider-credentials breaker: one pause per outage, probes, closing rules."""

from __future__ import annotations

import uuid

from receipts.worker import AUTH_PAUSE_MAX_SECONDS, _Breaker


def test_rejections_of_jobs_claimed_before_the_pause_do_not_compound_it():
    breaker = _Breaker(first_pause_seconds=30)
    assert breaker.rejected(uuid.uuid4()) == 30
    assert [breaker.rejected(uuid.uuid4()) for _ in range(10)] == [None] * 10
    assert breaker.pause_seconds == 30
    assert 25 < breaker.remaining() <= 33


def test_a_rejected_probe_doubles_the_pause_up_to_the_cap():
    breaker = _Breaker(first_pause_seconds=30)
    breaker.rejected(uuid.uuid4())
    pauses = []
    for _ in range(8):
        breaker.probe = uuid.uuid4()
        pauses.append(breaker.rejected(breaker.probe))
    assert pauses == [60, 120, 240, 480, AUTH_PAUSE_MAX_SECONDS, AUTH_PAUSE_MAX_SECONDS,
                      AUTH_PAUSE_MAX_SECONDS, AUTH_PAUSE_MAX_SECONDS]


def test_a_5xx_from_an_older_job_does_not_close_the_breaker_but_the_probes_answer_does():
    breaker = _Breaker(first_pause_seconds=30)
    breaker.rejected(uuid.uuid4())
    assert breaker.answered(uuid.uuid4(), delivered=False) is False
    assert breaker.is_open
    breaker.probe = uuid.uuid4()
    assert breaker.answered(breaker.probe, delivered=False) is True
    assert not breaker.is_open and breaker.remaining() == 0


def test_any_delivered_job_proves_the_credentials_work():
    breaker = _Breaker(first_pause_seconds=30)
    breaker.rejected(uuid.uuid4())
    assert breaker.answered(uuid.uuid4(), delivered=True) is True
    assert not breaker.is_open
    assert breaker.rejected(uuid.uuid4()) == 30  # a new outage starts from the first pause
