# Two commands from a fresh machine: `make demo` and `make test`.
# Each creates the virtualenv (and the test tools) it needs on first use.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test test-fast test-long test-k8s docs lint tools bench soak chaos clean lock

$(STAMP): pyproject.toml src/receipts/__init__.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

## Run the whole service on an embedded PostgreSQL 18 and print a summary.
demo: $(STAMP)
	$(BIN)/receipts demo

## Install the test tools: helm, kubectl, promtool, axe-core into .tools/; as root, Debian's
## prometheus, chromium, pgbouncer, nginx, tinyproxy, squid (idempotent).
tools:
	bash scripts/install-tools.sh

# pytest in two parts for the marks $(1): the tests that measure nothing in two processes
# (pytest-xdist: a serial run leaves the machine idle most of the time, waiting on real
# workers and timeouts), then the `solo` ones (timing, throughput, fleets of processes)
# alone. Both parts run; either failing fails the target. A PYTEST_ARGS that selects
# nothing in one part leaves that part out (pytest's exit 5); nothing in both is exit 5.
# An interrupted first part (Ctrl-C), an internal error or bad usage stops there (2, 3, 4).
# PYTEST_ARGS must not carry its own -m or -n: the last one given wins in pytest, and the
# parts would no longer be what they say (run .venv/bin/pytest directly for that).
define PYTEST_PARTS
@export PATH="$(CURDIR)/.tools/bin:$(CURDIR)/$(BIN):$$PATH"; status=5; \
$(BIN)/pytest -q -p no:cacheprovider -n 2 -m "($(1)) and not solo" $(PYTEST_ARGS); \
rc=$$?; [ $$rc -eq 5 ] || status=$$rc; \
case $$rc in 2|3|4) exit $$rc;; esac; \
$(BIN)/pytest -q -p no:cacheprovider -m "($(1)) and solo" $(PYTEST_ARGS); \
rc=$$?; [ $$rc -eq 5 ] || [ $$status -ne 0 -a $$status -ne 5 ] || status=$$rc; \
exit $$status
endef

## The full test suite (real PostgreSQL, real processes, real helm/promtool), in two parts.
test: $(STAMP) tools
	$(call PYTEST_PARTS,not long)

## More variants of the fleet scenarios (verdicts: every error-body style, flapping phases,
## invalid shares; TLS versions) that `make test` runs one of each; about 10 minutes.
test-long: $(STAMP) tools
	PATH="$(CURDIR)/.tools/bin:$(CURDIR)/$(BIN):$$PATH" $(BIN)/pytest -q -p no:cacheprovider -m long $(PYTEST_ARGS)

## The fast lane: every test not marked slow (pytest -m "not slow"), under 3 minutes on 2
## cores; the same tools, databases and two parts as `make test`, which still runs everything.
test-fast: $(STAMP) tools
	$(call PYTEST_PARTS,not slow)

## The chart on a real Kubernetes (tests/k8s): builds Kubernetes 1.20.2 from Debian's source
## package, starts one control plane and one node, installs the chart with the image built
## from the Dockerfile, tests it and takes it all down. Root only; about 13 minutes the first
## time, a few minutes after (build cache in RECEIPTS_K8S_CACHE, default /var/cache/receipts-k8s).
test-k8s: $(STAMP) tools
	bash scripts/k8s/cluster.sh test

## The documentation site, built into site/ with every warning an error (broken links and
## anchors fail). The reference pages are generated from the code: python scripts/gen_docs.py.
docs: $(STAMP)
	$(BIN)/python scripts/gen_docs.py --check
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --clean --site-dir site

## The side-by-side benchmark (bench/README.md); ~38 min on 2 cores.
bench:
	bash bench/run.sh $(BENCH_ARGS)

## The soak (bench/README.md): hours of steady churn, plotted and judged; e.g.
## make soak SOAK_ARGS="--hours 2" (the default), SOAK_ARGS="--smoke" for 1 minute.
soak:
	bash bench/run.sh --only soak $(SOAK_ARGS)

## A bigger chaos run by hand (docs/chaos.md), e.g. make chaos CHAOS_ARGS="--jobs 50000",
## then PostgreSQL killed mid-drain with asynchronous and durable worker commits, interleaved.
CRASH_ARGS ?= --jobs 3000 --rounds 3
chaos: $(STAMP)
	$(BIN)/python -m tests.chaos.run $(CHAOS_ARGS)
	$(BIN)/python -m tests.chaos.crash $(CRASH_ARGS)

## Re-resolve requirements.lock: the image's exact dependencies (extras worker, binary, uvloop),
## with the hashes of every file of each version, so any platform's wheel verifies.
lock: $(STAMP)
	$(BIN)/uv pip compile pyproject.toml --extra worker --extra binary --extra uvloop --universal \
		--python-version 3.11 --generate-hashes --custom-compile-command 'make lock' \
		--output-file requirements.lock

lint: $(STAMP)
	$(BIN)/ruff check src tests bench scripts
	$(BIN)/mypy

clean:
	rm -rf $(VENV) .tools .tmp site build dist src/*.egg-info .hypothesis .mypy_cache .ruff_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
