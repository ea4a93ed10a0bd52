"""The package's import graph keeps its floors and rooms (read from the source, nothing imported).

* No cycle among the modules' head-of-file imports (``TYPE_CHECKING`` blocks aside).
* The ground floor imports nothing of the package above it.
* Each audience's statement room stays its own: the worker's (``jobqueue``) and
  the operator's (``operations``) never import each other or the rooms above
  them, the orders service's (``enqueue``) needs only the ground floor, and the
  worker's loop never imports the operator's rooms.
* A function-local import of the package's own modules names its reason in a
  comment (an optional extra), so a file's head shows what it depends on.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "receipts"

#: Modules that import nothing of the package but each other.
GROUND = {"model", "errors", "statements", "retry", "deadlines", "admission", "flow",
          "proxy", "planner", "transport"}
#: The operator's rooms and the entry points above every room.
OPERATOR = {"operations", "review", "bulk", "fleet"}
TOP = {"cli", "console", "__main__", "runtime", "ui", "ui.app", "ui.monitor", "demo", "check"}
#: room -> modules it must not import.
FORBIDDEN = {
    "jobqueue": OPERATOR | TOP | {"enqueue", "recovery", "worker", "completion", "waker",
                                 "heartbeat", "settings"},
    "operations": TOP | {"jobqueue", "worker", "completion", "waker", "heartbeat", "recovery",
                         "enqueue", "review", "bulk", "fleet", "settings"},
    "enqueue": OPERATOR | TOP | {"jobqueue", "db", "settings", "worker", "recovery"},
    "worker": OPERATOR | TOP,
    "completion": OPERATOR | TOP,
    "waker": OPERATOR | TOP,
    "heartbeat": OPERATOR | TOP,
    "recovery": OPERATOR | TOP,
    "review": TOP | {"jobqueue"},
    "bulk": TOP | {"jobqueue"},
    "fleet": TOP | {"jobqueue"},
}


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts) or "receipts"
        out[name] = path
    return out


def _imports(node: ast.AST, inside: bool = False, typing_only: bool = False
             ) -> Iterator[tuple[ast.stmt, bool, bool]]:
    """Every import statement under *node*: (statement, in a function, under TYPE_CHECKING)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Import | ast.ImportFrom):
            yield child, inside, typing_only
        in_function = inside or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef)
        checking = typing_only or (isinstance(child, ast.If)
                                   and "TYPE_CHECKING" in ast.unparse(child.test))
        yield from _imports(child, in_function, checking)


def _targets(statement: ast.stmt, known: dict[str, Path]) -> set[str]:
    """The package's modules *statement* imports (``receipts.x`` → ``x``)."""
    names: list[str] = []
    if isinstance(statement, ast.Import):
        names = [a.name for a in statement.names]
    elif isinstance(statement, ast.ImportFrom) and statement.module and not statement.level:
        names = [f"{statement.module}.{a.name}" for a in statement.names] + [statement.module]
    found = set()
    for name in names:
        if name == "receipts" or not name.startswith("receipts."):
            continue
        short = name.removeprefix("receipts.")
        if short in known:
            found.add(short)
        elif short.rpartition(".")[0] in known:
            found.add(short.rpartition(".")[0])
    if isinstance(statement, ast.ImportFrom) and any(
            f"{statement.module}.{a.name}".removeprefix("receipts.") in known
            for a in statement.names):
        found.discard(str(statement.module).removeprefix("receipts."))
    return found


def _graph() -> tuple[dict[str, set[str]], list[tuple[str, int, str]]]:
    """(head-of-file import edges, function-local imports as (module, line, text))."""
    known = _modules()
    edges: dict[str, set[str]] = {name: set() for name in known}
    local: list[tuple[str, int, str]] = []
    for name, path in known.items():
        source = path.read_text("utf-8")
        lines = source.splitlines()
        for statement, inside, typing_only in _imports(ast.parse(source)):
            targets = _targets(statement, known) - {name}
            if not targets or typing_only:
                continue
            if inside:
                local.append((name, statement.lineno, lines[statement.end_lineno - 1]
                              if statement.end_lineno else ""))
            else:
                edges[name] |= targets
    return edges, local


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle() -> None:
    edges, _ = _graph()
    assert _cycles(edges) == []


def test_the_ground_floor_imports_nothing_above_it() -> None:
    edges, _ = _graph()
    assert set(edges) >= GROUND
    upward = {m: sorted(edges[m] - GROUND) for m in GROUND if edges[m] - GROUND}
    assert upward == {}


def test_each_audience_keeps_to_its_own_rooms() -> None:
    edges, _ = _graph()
    crossing = {room: sorted(edges[room] & forbidden)
                for room, forbidden in FORBIDDEN.items() if edges[room] & forbidden}
    assert crossing == {}


def test_a_function_local_import_of_the_package_says_why() -> None:
    _, local = _graph()
    unexplained = [(m, line, text.strip()) for m, line, text in local
                   if "#" not in text]
    assert unexplained == []
