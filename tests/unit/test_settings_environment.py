"""Settings and the environment: unknown variables, service links, the worker's needs,
the secrets logs must mask (pure, no I/O)."""

from __future__ import annotations

import pytest

from receipts.settings import (
    SettingsError,
    check_worker_settings,
    load_settings,
    unknown_variables,
)


def test_misspelt_variables_are_found_with_the_nearest_setting() -> None:
    found = unknown_variables({
        "RECEIPTS_CONCURENCY": "4",
        "RECEIPTS_LEASE_SECONDS": "60",           # a setting
        "receipts_log_level": "DEBUG",            # settings are case-insensitive
        "RECEIPTS_FROBNICATE": "1",               # nothing close
        "RECEIPTS_METRIC_PORT": "9464",           # a typo that looks like a service port
        "PATH": "/usr/bin",
    })
    assert found == [("RECEIPTS_CONCURENCY", "RECEIPTS_CONCURRENCY"),
                     ("RECEIPTS_FROBNICATE", None),
                     ("RECEIPTS_METRIC_PORT", "RECEIPTS_METRICS_PORT")]


@pytest.mark.parametrize(("name", "value"), [
    ("RECEIPTS_SERVICE_HOST", "10.0.0.7"),
    ("RECEIPTS_SERVICE_PORT", "9464"),
    ("RECEIPTS_SERVICE_PORT_METRICS", "9464"),
    ("RECEIPTS_PORT", "tcp://10.0.0.7:9464"),
    ("RECEIPTS_PORT_9464_TCP", "tcp://10.0.0.7:9464"),
    ("RECEIPTS_PORT_9464_TCP_PROTO", "tcp"),
    ("RECEIPTS_PORT_9464_TCP_PORT", "9464"),
    ("RECEIPTS_PORT_9464_TCP_ADDR", "10.0.0.7"),
    ("RECEIPTS_PROVIDER_SERVICE_HOST", "10.0.0.8"),  # a Service named receipts-provider
    ("RECEIPTS_PROVIDER_PORT", "tcp://10.0.0.8:8080"),
])
def test_kubernetes_service_links_are_not_reported(name: str, value: str) -> None:
    assert unknown_variables({name: value}) == []


def test_the_worker_needs_a_provider_url_other_commands_do_not() -> None:
    settings = load_settings(database_url="postgresql://u@h/d", provider_url="  ")
    assert settings.provider_url == ""
    with pytest.raises(SettingsError, match="RECEIPTS_PROVIDER_URL"):
        check_worker_settings(settings)
    check_worker_settings(load_settings(database_url="postgresql://u@h/d",
                                        provider_url="https://receipts.example/v1"))


@pytest.mark.parametrize(("dsn", "expected"), [
    ("postgresql://app:pa%40ss@db/shop", ["pa@ss", "pa%40ss"]),
    ("host=db user=app password='s p'", ["s p"]),
    ("postgresql://app@db/shop", []),
])
def test_secrets_are_the_password_as_decoded_and_as_written_and_the_token(
    dsn: str, expected: list[str]
) -> None:
    assert load_settings(database_url=dsn).secrets() == expected
    with_token = load_settings(database_url=dsn, provider_token="tok-123456")
    assert with_token.secrets() == [*expected, "tok-123456"]
