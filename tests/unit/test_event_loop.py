"""Which event loop `receipts worker` runs on (RECEIPTS_EVENT_LOOP)."""

from __future__ import annotations

import asyncio
import sys

import pytest

from receipts.runtime import event_loop_name, loop_factory, run_on_loop
from receipts.settings import Settings, SettingsError, load_settings


def settings(event_loop: str) -> Settings:
    return load_settings(database_url="postgresql://u@127.0.0.1:1/db",
                         provider_url="http://127.0.0.1:9/r", event_loop=event_loop)


async def _name() -> str:
    return event_loop_name()


@pytest.mark.parametrize(("choice", "runs_on"), [
    ("auto", "uvloop"), ("uvloop", "uvloop"), ("asyncio", "asyncio"), ("AsyncIO", "asyncio")])
def test_the_setting_chooses_the_loop_and_auto_prefers_uvloop(choice, runs_on) -> None:
    assert run_on_loop(settings(choice), _name()) == runs_on


def test_auto_falls_back_to_asyncio_without_uvloop(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop now fails
    assert loop_factory(settings("auto")) is asyncio.new_event_loop
    assert run_on_loop(settings("auto"), _name()) == "asyncio"


def test_uvloop_asked_for_but_missing_is_a_settings_error_naming_the_variable(
        monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)
    main = _name()
    with pytest.raises(SettingsError, match="RECEIPTS_EVENT_LOOP"):
        run_on_loop(settings("uvloop"), main)
    assert main.cr_frame is None  # closed, not left unawaited
