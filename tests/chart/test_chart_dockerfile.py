"""The Dockerfile: hadolint-clean, non-root, and what it installs really runs.

There is no container engine here, so the image test does what the image does: build the
project wheel from exactly the build context the .dockerignore lets through, fetch the
locked dependencies with their hashes checked (binary wheels only), install both into a
clean virtualenv without resolving anything, and run `receipts --help` /
`receipts worker --help` as a non-root user who cannot write to the installation (the
image's read-only root).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from chartkit import DOCKERFILE, REPO, find_tool, run

# What .dockerignore lets into the build context, and what the Dockerfile COPYs.
BUILD_CONTEXT = ("requirements.lock", "pyproject.toml", "README.md", "migrations", "src")
NON_ROOT_USER = "nobody"


def stages() -> list[list[str]]:
    """Dockerfile instructions (continuations joined), split into stages."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    lines = [line.strip() for line in text.splitlines()]
    instructions = [line for line in lines if line and not line.startswith("#")]
    result: list[list[str]] = []
    for line in instructions:
        if line.upper().startswith("FROM "):
            result.append([])
        if result:
            result[-1].append(line)
    return result


def test_hadolint_is_clean() -> None:
    result = run([find_tool("hadolint"), "--no-color", str(DOCKERFILE)])
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_is_multi_stage_with_a_slim_non_root_runtime() -> None:
    build, *_, runtime = stages()
    assert len(stages()) >= 2
    text = DOCKERFILE.read_text()
    assert re.search(r"^ARG PYTHON_IMAGE=python:3\.11-slim", text, re.MULTILINE)
    assert runtime[0].startswith("FROM ${PYTHON_IMAGE}")
    assert any("pip wheel" in line or "python -m build" in line for line in build)
    runtime_text = "\n".join(runtime)
    assert not re.search(r"\b(gcc|g\+\+|build-essential|clang|make)\b", runtime_text)
    assert "apt-get install" not in runtime_text
    (user,) = [line for line in runtime if line.startswith("USER ")]
    uid = user.split()[1].split(":")[0]
    assert uid.isdigit() and int(uid) > 0, "USER must be a numeric non-root UID"
    assert 'ENTRYPOINT ["receipts"]' in runtime
    assert 'CMD ["worker"]' in runtime
    assert "EXPOSE 9464" in runtime
    assert re.search(r"PYTHONUNBUFFERED=1", runtime_text)
    assert runtime.index(user) > max(i for i, line in enumerate(runtime) if line.startswith("RUN"))


def test_uid_matches_the_chart_security_context() -> None:
    import yaml

    values = yaml.safe_load((REPO / "helm" / "receipts" / "values.yaml").read_text())
    (user,) = [line for line in stages()[-1] if line.startswith("USER ")]
    uid, gid = user.split()[1].split(":")
    assert values["podSecurityContext"]["runAsUser"] == int(uid)
    assert values["podSecurityContext"]["runAsGroup"] == int(gid)


def test_dockerignore_keeps_the_build_context_small() -> None:
    lines = (REPO / ".dockerignore").read_text().splitlines()
    assert "*" in lines
    for name in BUILD_CONTEXT:
        assert f"!{name}" in lines or f"!{name}/" in lines, name
    copied = re.findall(r"^COPY (?!--from)(.+?) \S+$", DOCKERFILE.read_text(), re.MULTILINE)
    sources = {src.rstrip("/") for line in copied for src in line.split()}
    assert sources == set(BUILD_CONTEXT)


# ------------------------------------------------------------- build and run


def _runs_as(user: str | None, python: str) -> bool:
    cmd = [python, "-c", "import sys, venv; assert sys.version_info >= (3, 11)"]
    if user:
        cmd = ["runuser", "-u", user, "--", *cmd]
    return run(cmd, cwd="/").returncode == 0


def _base_python(user: str | None) -> str:
    """A Python >= 3.11 that `user` can execute (the image's interpreter stand-in)."""
    candidates = [
        getattr(sys, "_base_executable", sys.executable),
        "/usr/local/bin/python3.11",
        "/usr/bin/python3.11",
        "/usr/bin/python3",
        sys.executable,
    ]
    for candidate in candidates:
        if candidate and Path(candidate).exists() and _runs_as(user, candidate):
            return candidate
    pytest.fail(f"no Python >= 3.11 that user {user or 'current'} can run: {candidates}")


@pytest.fixture(scope="module")
def world_readable_tmp() -> Iterator[Path]:
    # pytest's tmp_path lives under a 0700 folder the non-root user cannot enter.
    path = Path(tempfile.mkdtemp(prefix="receipts-image-"))
    path.chmod(0o755)
    yield path
    for child in [path, *path.rglob("*")]:
        if child.is_dir() and not child.is_symlink():
            child.chmod(0o755)
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def installed_receipts(world_readable_tmp: Path) -> tuple[Path, str | None]:
    """The wheel built from the Docker build context, installed into a clean venv."""
    if not (REPO / "src" / "receipts" / "cli.py").exists():
        pytest.fail("src/receipts/cli.py is missing: the image has nothing to run")
    context = world_readable_tmp / "context"
    context.mkdir()
    for name in BUILD_CONTEXT:
        source = REPO / name
        if source.is_dir():
            shutil.copytree(source, context / name, symlinks=True,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
        else:
            shutil.copy2(source, context / name)

    wheels = world_readable_tmp / "wheels"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    built = run([*pip, "wheel", "--no-deps", "--wheel-dir", str(wheels), str(context)])
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = wheels.glob("receipts_queue-*.whl")
    lock = str(context / "requirements.lock")
    fetched = run([*pip, "download", "--require-hashes", "--only-binary=:all:", "--no-deps",
                   "--dest", str(wheels), "-r", lock])
    assert fetched.returncode == 0, fetched.stdout + fetched.stderr

    user = NON_ROOT_USER if os.geteuid() == 0 else None
    venv = world_readable_tmp / "venv"
    created = run([_base_python(user), "-m", "venv", "--without-pip", str(venv)])
    assert created.returncode == 0, created.stderr
    target = [*pip, "--python", str(venv / "bin" / "python")]
    for step in (
        ["install", "--quiet", "--no-index", "--find-links", str(wheels), "--require-hashes",
         "--no-deps", "-r", lock],
        ["install", "--quiet", "--no-index", "--no-deps", str(wheel)],
        ["check"],
    ):
        installed = run([*target, *step])
        assert installed.returncode == 0, installed.stdout + installed.stderr
    # Readable by everyone, writable by no one (like the image's read-only root filesystem).
    for path in [world_readable_tmp, *world_readable_tmp.rglob("*")]:
        if not path.is_symlink():
            mode = path.stat().st_mode | 0o444 | (0o111 if path.is_dir() else 0)
            path.chmod(mode & ~0o222 if path.is_relative_to(venv) else mode)
    return venv, user


def run_installed(venv: Path, user: str | None, *args: str) -> subprocess.CompletedProcess[str]:
    home = venv.parent / "home"  # the only writable place, like the image's /tmp
    home.mkdir(exist_ok=True)
    home.chmod(0o777)
    env = {
        "PATH": f"{venv / 'bin'}:/usr/bin:/bin",
        "HOME": str(home),
        "TMPDIR": str(home),
        "PYTHONUNBUFFERED": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
        "LANG": "C.UTF-8",
    }
    cmd = [str(venv / "bin" / "receipts"), *args]
    if user:
        cmd = ["runuser", "-u", user, "--", "env", "-i", *(f"{k}={v}" for k, v in env.items()),
               *cmd]
        return run(cmd, cwd="/")
    return run(cmd, env=env, cwd="/")


@pytest.mark.slow
@pytest.mark.parametrize("args", [["--help"], ["worker", "--help"]], ids=" ".join)
def test_the_installed_entrypoint_runs_as_non_root(
    installed_receipts: tuple[Path, str | None], args: list[str]
) -> None:
    venv, user = installed_receipts
    result = run_installed(venv, user, *args)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "usage" in result.stdout.lower()
    if args == ["--help"]:
        for command in ("migrate", "worker", "recover", "jobs", "enqueue", "provider", "demo"):
            assert command in result.stdout, command


def test_the_image_carries_the_migrations_and_sql(
    installed_receipts: tuple[Path, str | None],
) -> None:
    # `receipts migrate` (the chart's hook Job) reads them from the installed package.
    venv, _ = installed_receipts
    (package,) = venv.glob("lib/python3*/site-packages/receipts")
    shipped = {p.name for p in (package / "migrations").glob("*.sql")}
    assert shipped == {p.name for p in (REPO / "migrations").glob("*.sql")} != set()
    assert list((package / "sql").glob("*.sql"))


@pytest.mark.slow
def test_the_non_root_user_cannot_write_the_installation(
    installed_receipts: tuple[Path, str | None],
) -> None:
    venv, user = installed_receipts
    touch = ["touch", str(venv / "lib" / "probe")]
    result = run(["runuser", "-u", user, "--", *touch] if user else touch)
    assert result.returncode != 0, "the installation must be read-only for the runtime user"
