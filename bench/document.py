"""A bench run's document on disk: one JSON file, written whole or not at all.

Below every bench command (the core's and the experiments'), so none of them
needs :mod:`bench.report` (which reads the bill's figures) just to write one.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def write_json(doc: dict[str, Any], out: Path) -> None:
    """Write a bench run's document to *out* (JSON, indented; values ``str()``-ed when
    JSON has no type for them), atomically: a half-written file never replaces a whole
    one. Creates the folder; says where it wrote on stderr."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    tmp.replace(out)
    print(f"\nwrote {out}", file=sys.stderr)
