# syntax=docker/dockerfile:1
# receipts worker image: `receipts` entrypoint, non-root, read-only-root-filesystem friendly.
#   docker build -t receipts .
#   docker run --rm --read-only --tmpfs /tmp -e RECEIPTS_DATABASE_URL=... receipts worker
# Reproducible builds: every dependency comes from requirements.lock (exact versions, each
# file checked against its sha256; `make lock` regenerates it). The base image defaults to
# a tag; pin it by digest for a byte-identical base:
#   docker build --build-arg PYTHON_IMAGE=python:3.11-slim-bookworm@sha256:<digest> .
# (`docker buildx imagetools inspect python:3.11-slim-bookworm` prints the digest.)
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---- build: the project wheel plus the locked wheels of its `worker` and `binary` extras -
FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY requirements.lock pyproject.toml README.md ./
COPY migrations ./migrations
COPY src ./src
# This slim stage has no compiler: binary wheels only, so a dependency without one fails
# here, loudly. --require-hashes refuses any file whose hash the lock does not list.
RUN pip download --require-hashes --only-binary=:all: --no-deps --dest /wheels \
        -r requirements.lock \
 && pip wheel --no-deps --wheel-dir /wheels .

# ---- runtime ---------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS runtime
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/tmp \
    TMPDIR=/tmp
RUN groupadd --system --gid 10001 receipts \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin receipts
# Installed as root (read-only for the runtime user), offline, from the build stage:
# the locked dependencies (hashes checked again), then the project wheel without
# resolving anything; `pip check` proves the two agree. Bytecode is compiled at install
# time, so nothing is written outside /tmp at run time.
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    --mount=type=bind,from=build,source=/src/requirements.lock,target=/requirements.lock \
    pip install --no-index --find-links=/wheels --require-hashes --no-deps \
        -r /requirements.lock \
 && pip install --no-index --no-deps /wheels/receipts_queue-*.whl \
 && pip check \
 && receipts --help >/dev/null
USER 10001:10001
WORKDIR /tmp
EXPOSE 9464
ENTRYPOINT ["receipts"]
CMD ["worker"]
