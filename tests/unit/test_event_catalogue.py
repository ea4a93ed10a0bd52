"""Every log event the code writes is in the docs' catalogue, and nothing else is."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import receipts
from receipts.logs import LIBRARY_EVENT

REPO = Path(__file__).resolve().parents[2]
PACKAGE = Path(receipts.__file__).parent
LEVELS = {"debug", "info", "warning", "error", "exception", "critical"}


def events_in_code() -> dict[str, set[str]]:
    """{event name: modules} for every string literal given as the event of a `log.<level>()`
    call (both branches of a conditional included)."""
    found: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in LEVELS and isinstance(node.func.value, ast.Name)
                    and node.func.value.id == "log" and node.args):
                for part in ast.walk(node.args[0]):
                    if isinstance(part, ast.Constant) and isinstance(part.value, str):
                        found.setdefault(part.value, set()).add(path.name)
    return found


def events_in_catalogue() -> set[str]:
    text = (REPO / "docs" / "operations.md").read_text()
    section = text[text.index("## Logs and their events"):]
    section = section.split("\n## ", 1)[0]
    return set(re.findall(r"^\| `([a-z_]+)` \|", section, flags=re.MULTILINE))


def test_event_names_are_snake_case() -> None:
    for name in events_in_code():
        assert re.fullmatch(r"[a-z]+(_[a-z]+)*", name), name


def test_every_event_is_documented_and_every_documented_event_exists() -> None:
    code = set(events_in_code()) | {LIBRARY_EVENT}
    documented = events_in_catalogue()
    assert len(code) >= 20
    assert not code - documented, f"undocumented events: {sorted(code - documented)}"
    assert not documented - code, f"documented but never logged: {sorted(documented - code)}"
