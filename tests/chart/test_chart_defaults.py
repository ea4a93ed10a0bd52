"""The chart's `config` defaults are the worker's own defaults: one source for each.

A key of `config` in values.yaml that names a setting (camelCase of the field) must
default to what `Settings` defaults to, so an install with the chart behaves as the
docs and `--help` say. The few that differ on purpose are listed with their reason.
"""

from __future__ import annotations

import re

import pytest
import yaml

from receipts.settings import Settings
from tests.chart.chartkit import CHART

#: Keys whose chart default differs from the setting's on purpose, with the reason.
DELIBERATE = {
    # The chart must point at a provider; the setting has no default at all.
    "providerUrl": "required at install",
    # None means "min(10, lease / 4)": with the chart's 60 s lease that is the chart's 10.
    "leaseMarginSeconds": "the derived default, written out",
}


def _config() -> dict[str, object]:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    config: dict[str, object] = values["config"]
    return config


def _field(key: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", key).lower()


def _same(chart: object, setting: object) -> bool:
    if setting is None:
        return chart in ("", None)
    if isinstance(setting, bool) or isinstance(chart, bool):
        return chart is setting
    if isinstance(setting, int | float) and isinstance(chart, int | float):
        return float(chart) == float(setting)
    return chart == setting


@pytest.mark.parametrize("key", sorted(_config()))
def test_a_chart_config_default_is_the_settings_default(key):
    fields = Settings.model_fields
    field = _field(key)
    if key in DELIBERATE or field not in fields:
        pytest.skip(f"{key}: {DELIBERATE.get(key, 'no setting of that name')}")
    assert _same(_config()[key], fields[field].default), (key, _config()[key],
                                                           fields[field].default)


def test_the_deliberate_differences_name_real_settings():
    derived = Settings.model_validate({"database_url": "postgresql://127.0.0.1/x",
                                       "provider_url": "http://127.0.0.1:1/",
                                       "lease_seconds": _config()["leaseSeconds"]})
    assert derived.lease_margin == _config()["leaseMarginSeconds"]
    assert set(DELIBERATE) <= set(_config())
