"""The process supervisor against real child processes: receipts workers and providers."""

from __future__ import annotations

import signal
import textwrap

import httpx
import pytest

from receipts.embedded import free_port
from receipts.supervisor import ChildError, Supervisor
from tests.conftest import enqueue_many, fetch_rows

STUBBORN = textwrap.dedent("""\
    import os, signal, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print("ready", flush=True)
    print("RECEIPTS_" + ",".join(sorted(k for k in os.environ if k.startswith("RECEIPTS_"))),
          flush=True)
    time.sleep(120)
""")


def _provider(sup: Supervisor, name: str = "provider", *extra: str):
    port = free_port()
    return sup.start(name, ["provider", "--port", str(port), *extra], port=port,
                     health_path="/stats")


@pytest.mark.slow
def test_a_worker_becomes_healthy_delivers_and_its_scrape_and_exit_say_so(
        dsn, tmp_path, monkeypatch):
    # Settings exported in the parent's shell must not reach the child.
    monkeypatch.setenv("RECEIPTS_CONCURRENCY", "0")
    monkeypatch.setenv("RECEIPTS_MAX_ATTEMPTS", "not-a-number")
    enqueue_many(dsn, ["sup-1", "sup-2", "sup-3"])
    with Supervisor(tmp_path) as sup:
        provider = _provider(sup).wait_healthy()
        port = free_port()
        worker = sup.start("worker", ["worker"], {
            "RECEIPTS_DATABASE_URL": dsn,
            "RECEIPTS_PROVIDER_URL": provider.url("/receipts"),
            "RECEIPTS_POLL_INTERVAL_SECONDS": "0.2",
            "RECEIPTS_METRICS_PORT": str(port),
            "RECEIPTS_LOG_LEVEL": "DEBUG",
        }, port=port).wait_healthy()
        worker.wait_for_output('"event": "delivered"', count=3, timeout_seconds=30)
        samples = worker.scrape()
        assert samples.value("receipts_acks_total") == 3.0
        assert provider.get_json("/stats")["receipts"] == 3
        assert worker.stop() == 0
    assert fetch_rows(dsn, "SELECT count(*) FROM receipt_jobs WHERE state = 'done'") == [(3,)]
    log = (tmp_path / "worker.log").read_text()
    assert '"event": "stopped"' in log


@pytest.mark.slow
def test_a_child_that_exits_before_it_is_healthy_is_named_with_its_output(tmp_path):
    with Supervisor(tmp_path) as sup:
        port = free_port()
        child = sup.start("worker-bad", ["worker"], {
            "RECEIPTS_DATABASE_URL": "postgresql://u@127.0.0.1:1/d",
            "RECEIPTS_CONCURRENCY": "0", "RECEIPTS_METRICS_PORT": str(port)}, port=port)
        with pytest.raises(ChildError) as caught:
            child.wait_healthy(timeout_seconds=20)
    message = str(caught.value)
    assert message.startswith("worker-bad (pid ")
    assert "exited with 2 before /healthz answered" in message
    assert "RECEIPTS_CONCURRENCY" in message  # the tail of its output
    assert caught.value.returncode == 2


def test_a_child_that_never_answers_times_out_with_a_clear_error():
    with Supervisor() as sup:
        port = free_port()
        child = sup.start("provider", ["provider", "--port", str(port)], port=port,
                          health_path="/no-such-page")
        with pytest.raises(ChildError, match=r"did not answer .*/no-such-page within 1s"):
            child.wait_healthy(timeout_seconds=1)
        assert child.running


@pytest.mark.slow
def test_a_paused_child_does_not_answer_until_it_is_continued(tmp_path):
    with Supervisor(tmp_path) as sup:
        provider = _provider(sup).wait_healthy()
        provider.pause()
        with pytest.raises(ChildError, match="paused"):
            provider.get_json("/stats")
        with pytest.raises(httpx.TimeoutException):
            httpx.get(provider.url("/stats"), timeout=0.5, trust_env=False)
        provider.resume()
        assert provider.get_json("/stats")["requests"] == 0
        assert provider.stop() == 0


@pytest.mark.slow
def test_kill_reaps_the_child_and_a_paused_child_is_stopped_cleanly(tmp_path):
    with Supervisor(tmp_path) as sup:
        first = _provider(sup, "first").wait_healthy()
        second = _provider(sup, "second").wait_healthy()
        assert first.kill() == -signal.SIGKILL
        second.pause()
        assert sup.stop_all(timeout_seconds=10) == {"first": -9, "second": 0}


def test_stop_escalates_to_sigkill_and_only_named_settings_reach_the_child(
        tmp_path, monkeypatch):
    monkeypatch.setenv("RECEIPTS_PROVIDER_TOKEN", "from-the-parent-shell")
    (tmp_path / "stubborn.py").write_text(STUBBORN)
    with Supervisor(cwd=tmp_path) as sup:
        child = sup.start("stubborn", [], {"RECEIPTS_LOG_LEVEL": "INFO"}, module="stubborn")
        child.wait_for_output("ready")
        child.wait_for_output("RECEIPTS_")
        assert child.stop(timeout_seconds=0.5) == -signal.SIGKILL
    assert "RECEIPTS_RECEIPTS_LOG_LEVEL\n" in child.stdout_text
    assert child.stderr_text == ""


@pytest.mark.slow
def test_leaving_the_block_stops_every_child_even_on_an_error(tmp_path):
    (tmp_path / "stubborn.py").write_text(STUBBORN)
    with pytest.raises(RuntimeError, match="boom"), Supervisor(
            cwd=tmp_path, stop_timeout_seconds=2) as sup:
        provider = _provider(sup).wait_healthy()
        stubborn = sup.start("stubborn", [], module="stubborn")
        stubborn.wait_for_output("ready")
        raise RuntimeError("boom")
    assert provider.returncode == 0
    assert stubborn.returncode == -signal.SIGKILL


def test_stdin_releases_a_child_waiting_for_its_go(tmp_path):
    (tmp_path / "gate.py").write_text(
        'import sys\nprint("ready", flush=True)\nprint("got", sys.stdin.readline().strip())\n')
    with Supervisor(cwd=tmp_path) as sup:
        child = sup.start("gate", [], module="gate", stdin=True)
        child.wait_for_output("ready")
        child.send_input("go\n")
        assert child.wait(timeout_seconds=10) == 0
    assert child.stdout_text == "ready\ngot go\n"


def test_a_second_child_with_the_same_name_is_refused():
    with Supervisor() as sup:
        _provider(sup)
        with pytest.raises(ValueError, match="provider"):
            _provider(sup)
