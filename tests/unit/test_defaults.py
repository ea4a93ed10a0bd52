"""One source for each default: a policy built from default Settings is the policy's own
default, so a knob's default cannot differ between the code that runs it and the setting."""

from __future__ import annotations

import subprocess
import sys

from receipts.admission import AdmissionPolicy
from receipts.flow import FlowPolicy
from receipts.retry import BackoffPolicy
from receipts.settings import Settings, load_settings
from receipts.worker import admission_policy, flow_policy


def _defaults() -> Settings:
    return load_settings(database_url="postgresql://u@h/d")


def test_the_backoff_policy_s_defaults_are_the_settings_defaults() -> None:
    settings = _defaults()
    from_settings = BackoffPolicy(base_seconds=settings.retry_base_seconds,
                                  cap_seconds=settings.retry_cap_seconds,
                                  retry_after_max_seconds=settings.retry_after_max_seconds)
    assert from_settings == BackoffPolicy()
    assert BackoffPolicy().base_seconds == 10.0  # docs/design.md, "Retry defaults"


def test_the_flow_policy_s_defaults_are_the_settings_defaults() -> None:
    assert flow_policy(_defaults()) == FlowPolicy()


def test_the_admission_policy_s_defaults_are_the_settings_defaults() -> None:
    assert admission_policy(_defaults()) == AdmissionPolicy()


def test_the_transport_setting_offers_the_transports_and_their_default() -> None:
    from typing import get_args

    from receipts.transport import DEFAULT_TRANSPORT, TransportName

    field = Settings.model_fields["provider_transport"]
    assert get_args(field.annotation) == get_args(TransportName)
    assert field.default == DEFAULT_TRANSPORT == _defaults().provider_transport


def test_the_dsn_helpers_need_neither_pydantic_nor_the_settings() -> None:
    probe = ("import sys, receipts.dsn; "
             "print(sorted(m for m in sys.modules if m.split('.')[0] in "
             "('pydantic', 'pydantic_settings') or m in ('receipts.settings', 'receipts.ui')))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"


def test_the_settings_import_nothing_from_the_review_page() -> None:
    probe = ("import sys, receipts.settings; "
             "print(sorted(m for m in sys.modules if 'ui' in m.split('.')))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"
