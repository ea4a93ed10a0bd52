"""The supervisor's pure parts: a child's environment and the parsed scrape."""

from __future__ import annotations

import pytest

from receipts.supervisor import child_env, parse_metrics

EXPOSITION = """\
# HELP receipts_acks_total Jobs acknowledged.
# TYPE receipts_acks_total counter
receipts_acks_total 7.0
receipts_acks_created 1.7e9
# HELP receipts_retries_total Reschedules.
# TYPE receipts_retries_total counter
receipts_retries_total{reason="timeout"} 3.0
receipts_retries_total{reason="status_503"} 2.0
# HELP receipts_pool_connections Pool.
# TYPE receipts_pool_connections gauge
receipts_pool_connections{state="in_use",pool="worker"} 1.0
"""


def test_a_child_gets_path_home_locale_module_path_and_only_the_settings_it_is_given():
    parent = {"PATH": "/usr/bin", "HOME": "/root", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
              "TZ": "UTC", "RECEIPTS_CONCURRENCY": "0", "RECEIPTS_PROVIDER_TOKEN": "t0k",
              "AWS_SECRET_ACCESS_KEY": "x", "PYTHONPATH": "/src", "VIRTUAL_ENV": "/venv"}
    env = child_env({"RECEIPTS_DATABASE_URL": "postgresql:///db"}, parent=parent)
    assert env == {"PATH": "/usr/bin", "HOME": "/root", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
                   "TZ": "UTC", "PYTHONPATH": "/src", "RECEIPTS_DATABASE_URL": "postgresql:///db"}


def test_a_named_variable_overrides_the_parents():
    assert child_env({"PATH": "/opt/bin"}, parent={"PATH": "/usr/bin"}) == {"PATH": "/opt/bin"}


def test_a_scrape_is_keyed_by_sample_name_and_sorted_labels():
    samples = parse_metrics(EXPOSITION)
    assert samples.value("receipts_acks_total") == 7.0
    assert samples[("receipts_acks_total", ())] == 7.0
    assert samples.value("receipts_retries_total", reason="timeout") == 3.0
    assert samples.value("receipts_pool_connections", pool="worker", state="in_use") == 1.0
    assert samples.total("receipts_retries_total") == 5.0
    assert samples.total("receipts_not_exposed") == 0.0
    assert samples.by_label("receipts_retries_total", "reason") == {
        "timeout": 3.0, "status_503": 2.0}
    with pytest.raises(KeyError):
        samples.value("receipts_retries_total", reason="reset")


def test_text_that_is_not_the_exposition_format_is_refused():
    with pytest.raises(ValueError):
        parse_metrics("receipts_acks_total seven\n")
