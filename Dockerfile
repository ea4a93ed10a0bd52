# syntax=docker/dockerfile:1
# receipts worker image: `receipts` entrypoint, non-root, read-only-root-filesystem friendly.
#   docker build -t receipts .
#   docker run --rm --read-only --tmpfs /tmp -e RECEIPTS_DATABASE_URL=... receipts worker
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---- build: the project wheel plus wheels of all its dependencies ----------------------
FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY migrations ./migrations
COPY src ./src
# This slim stage has no compiler: a dependency without a binary wheel fails here, loudly.
RUN pip wheel --wheel-dir /wheels .

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
# Installed as root (read-only for the runtime user); bytecode is compiled at install time,
# so nothing is written outside /tmp at run time.
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-index --find-links=/wheels /wheels/receipts-*.whl \
 && receipts --help >/dev/null
USER 10001:10001
WORKDIR /tmp
EXPOSE 9464
ENTRYPOINT ["receipts"]
CMD ["worker"]
