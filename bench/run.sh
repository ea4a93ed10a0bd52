#!/usr/bin/env bash
# The side-by-side benchmark from a fresh clone (bench/README.md).
# Builds a bench-only virtualenv (.tmp/bench-venv, git-ignored) holding receipts
# and its optional `bench` extra (PgQueuer, Procrastinate, asyncpg, uvloop, py-spy
# from PyPI, latest): they never become runtime dependencies of receipts.
# Then runs `python -m bench.run "$@"` (e.g. --rounds 5, --smoke, --only raw,receipts).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${BENCH_VENV:-.tmp/bench-venv}
if [ ! -x "$VENV/bin/python" ] || [ pyproject.toml -nt "$VENV/.installed" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install --quiet --upgrade pip
  "$VENV/bin/pip" install --quiet --upgrade -e '.[bench]'
  touch "$VENV/.installed"
fi
export XDG_RUNTIME_DIR=${XDG_RUNTIME_DIR:-/tmp}
exec "$VENV/bin/python" -m bench.run "$@"
